// Built under --config=nocuda: there is no CUDA backend, and auto falls back to the CPU.
#include "engine/attention_backend.h"

namespace latentd::engine {

bool CudaDevicePresent() { return false; }

absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCudaBackend(const BackendOptions&) {
  return absl::UnavailableError("backend cuda: this build has no CUDA support (built with --config=nocuda)");
}

}  // namespace latentd::engine
