// Backend selection: auto takes CUDA when a device is present, else the CPU backend.
#include "engine/attention_backend.h"

namespace latentd::engine {

absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeBackend(BackendKind kind, const BackendOptions& options) {
  switch (kind) {
    case BackendKind::kCpu:
      return MakeCpuBackend(options);
    case BackendKind::kCuda:
      return MakeCudaBackend(options);
    case BackendKind::kAuto:
      if (CudaDevicePresent()) return MakeCudaBackend(options);
      return MakeCpuBackend(options);
  }
  return absl::InvalidArgumentError("backend: expected auto, cuda or cpu");
}

}  // namespace latentd::engine
