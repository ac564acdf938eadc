// The layer stage's CUDA side where the build has no CUDA (--config=nocuda).
#include "engine/layer_stage.h"

namespace latentd::engine {

absl::StatusOr<std::unique_ptr<LayerStage>> MakeCudaLayerStage(const EngineOptions& options) {
  return absl::UnavailableError("layer API: this build has no CUDA support (the CUDA layer math is not built in)");
}

}  // namespace latentd::engine
