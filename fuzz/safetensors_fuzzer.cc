// libFuzzer target: the safetensors header parser (engine/model), which reads untrusted
// checkpoint files. The input is a whole file. Whatever it accepts must describe ranges
// that lie inside the input, match shape x dtype size and do not overlap; a violated
// check aborts.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/status/statusor.h"
#include "engine/model/safetensors.h"

using latentd::engine::model::ParseSafetensors;
using latentd::engine::model::SafetensorsHeader;
using latentd::engine::model::TensorDTypeBits;
using latentd::engine::model::TensorInfo;

namespace {

[[noreturn]] void Fail(const char* what, const TensorInfo& t) {
  std::fprintf(stderr, "safetensors_fuzzer: tensor %s: %s\n", t.name.c_str(), what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensors(data, size, "fuzz-input");
  if (!h.ok()) {
    if (h.status().message().empty()) std::abort();  // every rejection says why
    return 0;
  }
  if (h->data_offset < 8 || h->data_offset > size) std::abort();
  const uint64_t data_bytes = size - h->data_offset;
  uint64_t reach = 0;
  for (const TensorInfo& t : h->tensors) {
    if (t.begin > t.end || t.end > data_bytes) Fail("range outside the data section", t);
    unsigned __int128 bits = static_cast<unsigned>(TensorDTypeBits(t.dtype));
    for (int64_t d : t.shape) {
      if (d < 0) Fail("negative dimension", t);
      bits *= static_cast<uint64_t>(d);
    }
    if (bits != static_cast<unsigned __int128>(t.num_bytes()) * 8) Fail("byte size is not shape x dtype", t);
    if (t.begin != t.end) {
      if (t.begin < reach) Fail("overlaps an earlier tensor", t);
      reach = t.end > reach ? t.end : reach;
    }
    // Touch the bytes the range names: ASan reports a read outside the input.
    volatile uint8_t sink = 0;
    for (uint64_t i = t.begin; i < t.end; ++i) sink = sink ^ data[h->data_offset + i];
  }
  return 0;
}
