// Where one tensor of a decode step lies, as one typed value: plain host bytes, an
// offset into a host region registered with the engine (the device reads it in place),
// or an offset into a client's CUDA allocation (device memory only). The server writes
// it; the backends read it through the accessors instead of decoding base addresses.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace latentd::engine {

// Memory a step's tensors may lie in: host memory given to Engine::RegisterHostMemory
// (host and the device address it returned), or device memory from
// Engine::OpenDeviceMemory (device only; host is unused).
struct MemoryRegion {
  char* host = nullptr;
  uint64_t device = 0;
  uint64_t bytes = 0;
};

class TensorLocation {
 public:
  enum class Kind : uint8_t {
    kNone,          // not set: the step is incomplete
    kHost,          // plain host memory: the backend stages it to and from the device
    kHostRegion,    // registered host memory: reachable at host() and, in place, at device()
    kDeviceRegion,  // device memory: reachable at device() only
  };

  TensorLocation() = default;

  static TensorLocation Host(void* data, size_t bytes) {
    return TensorLocation(Kind::kHost, static_cast<char*>(data), 0, bytes);
  }
  // `bytes` at `offset` into a registered host region (the caller checked the bounds).
  static TensorLocation InHostRegion(const MemoryRegion& r, uint64_t offset, size_t bytes) {
    return TensorLocation(Kind::kHostRegion, r.host + offset, r.device + offset, bytes);
  }
  // `bytes` at `offset` into device memory (the caller checked the bounds).
  static TensorLocation InDeviceRegion(const MemoryRegion& r, uint64_t offset, size_t bytes) {
    return TensorLocation(Kind::kDeviceRegion, nullptr, r.device + offset, bytes);
  }

  Kind kind() const { return kind_; }
  size_t bytes() const { return bytes_; }
  bool set() const { return kind_ != Kind::kNone; }
  // The host can read and write it (kHost, kHostRegion).
  bool on_host() const { return kind_ == Kind::kHost || kind_ == Kind::kHostRegion; }
  // The device reaches it in place, with no staging copy (kHostRegion, kDeviceRegion).
  bool device_direct() const { return kind_ == Kind::kHostRegion || kind_ == Kind::kDeviceRegion; }
  // Its host address; nullptr unless on_host().
  char* host() const { return host_; }
  // Its device address; 0 unless device_direct().
  uint64_t device() const { return device_; }
  // Its bytes as the host sees them; empty unless on_host().
  absl::string_view view() const { return on_host() ? absl::string_view(host_, bytes_) : absl::string_view(); }

 private:
  TensorLocation(Kind kind, char* host, uint64_t device, size_t bytes)
      : host_(host), device_(device), bytes_(bytes), kind_(kind) {}

  char* host_ = nullptr;
  uint64_t device_ = 0;
  size_t bytes_ = 0;
  Kind kind_ = Kind::kNone;
};

}  // namespace latentd::engine
