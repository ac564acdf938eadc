// Reads fuzz input bytes as bounded choices. Past the end every choice is its lowest
// value, so any input, however short, decodes to a well-defined run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace latentd::fuzz {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool empty() const { return pos_ >= size_; }
  size_t remaining() const { return size_ - pos_; }

  uint8_t Byte() { return empty() ? 0 : data_[pos_++]; }

  // A value in [lo, hi]: one byte for ranges up to 256 values, two beyond.
  int Range(int lo, int hi) {
    if (hi <= lo) return lo;
    const uint32_t span = static_cast<uint32_t>(hi - lo) + 1;
    uint32_t v = Byte();
    if (span > 256) v = (v << 8) | Byte();
    return lo + static_cast<int>(v % span);
  }

  // Up to n bytes (fewer at the end).
  std::string Bytes(size_t n) {
    if (n > remaining()) n = remaining();
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace latentd::fuzz
