// DeviceRegion without CUDA support built in (--config=nocuda): Create fails.
#include "tools/serving/device_region.h"

namespace latentd::tools {

absl::StatusOr<std::unique_ptr<DeviceRegion>> DeviceRegion::Create(int, uint64_t, const std::vector<std::string>&) {
  return absl::UnimplementedError("--cuda_region: this build has no CUDA support (--config=nocuda)");
}

}  // namespace latentd::tools
