// DeviceRegion over the CUDA runtime (tools/serving/device_region.h).
#include "tools/serving/device_region.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"

namespace latentd::tools {
namespace {

absl::Status Cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

class CudaRegion final : public DeviceRegion {
 public:
  ~CudaRegion() override {
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (region_ != nullptr) cudaFree(region_);
    if (pool_ != nullptr) cudaFree(pool_);
  }

  absl::Status Init(int device, uint64_t region_bytes, const std::vector<std::string>& pool) {
    device_ = device;
    absl::Status st = Cuda(cudaSetDevice(device), "cudaSetDevice");
    if (st.ok()) st = Cuda(cudaMalloc(&region_, region_bytes), "cudaMalloc region");
    if (st.ok()) st = Cuda(cudaMemset(region_, 0, region_bytes), "cudaMemset");
    size_t total = 0;
    for (const std::string& t : pool) {
      offsets_.push_back(total);
      sizes_.push_back(t.size());
      total += (t.size() + 255) / 256 * 256;
    }
    if (st.ok()) st = Cuda(cudaMalloc(&pool_, total == 0 ? 256 : total), "cudaMalloc pool");
    for (size_t i = 0; st.ok() && i < pool.size(); ++i)
      st = Cuda(cudaMemcpy(pool_ + offsets_[i], pool[i].data(), pool[i].size(), cudaMemcpyHostToDevice), "upload");
    if (st.ok()) st = Cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    return st;
  }

  // Each call selects the region's device first: the current device is per host thread.
  std::string IpcHandle() const override {
    cudaSetDevice(device_);
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, region_) != cudaSuccess) return "";
    return std::string(h.reserved, sizeof(h.reserved));
  }
  void CopyFromPool(uint64_t offset, int i) override {
    cudaSetDevice(device_);
    cudaMemcpyAsync(region_ + offset, pool_ + offsets_[i], sizes_[i], cudaMemcpyDeviceToDevice, stream_);
  }
  absl::Status Sync() override {
    cudaSetDevice(device_);
    return Cuda(cudaStreamSynchronize(stream_), "copies");
  }
  std::string Read(uint64_t offset, size_t n) override {
    cudaSetDevice(device_);
    std::string out(n, '\0');
    cudaMemcpy(out.data(), region_ + offset, n, cudaMemcpyDeviceToHost);
    return out;
  }

 private:
  char* region_ = nullptr;
  char* pool_ = nullptr;
  std::vector<size_t> offsets_, sizes_;
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceRegion>> DeviceRegion::Create(int device, uint64_t region_bytes,
                                                                   const std::vector<std::string>& pool) {
  auto r = std::make_unique<CudaRegion>();
  absl::Status st = r->Init(device, region_bytes, pool);
  if (!st.ok()) return st;
  return std::unique_ptr<DeviceRegion>(std::move(r));
}

}  // namespace latentd::tools
