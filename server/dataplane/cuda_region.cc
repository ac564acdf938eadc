// Opening and closing a client's CUDA IPC region (cuda_region.h).
#include "server/dataplane/cuda_region.h"

#include <sys/mman.h>

#include "absl/strings/str_cat.h"

namespace latentd::server::dataplane {

absl::Status CudaRegion::CheckRequest(const wire::CudaRegionFields& req, int64_t max_region_bytes) {
  if (req.handle_bytes != wire::CudaRegionFields::kMaxIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("DecodeRequest.open_cuda_region.ipc_handle: ", req.handle_bytes,
                                                   " bytes; expected ", wire::CudaRegionFields::kMaxIpcHandleBytes,
                                                   " (a cudaIpcMemHandle_t from cudaIpcGetMemHandle)"));
  }
  if (req.bytes == 0) {
    return absl::InvalidArgumentError("DecodeRequest.open_cuda_region.bytes: 0; expected the region's size in bytes");
  }
  if (req.bytes > static_cast<uint64_t>(max_region_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat("DecodeRequest.open_cuda_region.bytes: ", req.bytes,
                                                     " bytes is over --max_region_bytes=", max_region_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaRegion> CudaRegion::Open(engine::Engine* engine, const wire::CudaRegionFields& req) {
  absl::StatusOr<engine::DeviceMemory> mem = engine->OpenDeviceMemory(req.handle, req.offset, req.bytes);
  if (!mem.ok()) return absl::Status(mem.status().code(), absl::StrCat("DecodeRequest.", mem.status().message()));
  void* reservation = mmap(nullptr, req.bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reservation == MAP_FAILED) {
    engine->CloseDeviceMemory(*mem);
    return absl::ResourceExhaustedError(
        "DecodeRequest.open_cuda_region: cannot reserve host address space for the region");
  }
  CudaRegion r;
  r.engine_ = engine;
  r.memory_ = *mem;
  r.host_ = static_cast<char*>(reservation);
  r.bytes_ = req.bytes;
  return r;
}

CudaRegion::CudaRegion(CudaRegion&& other) noexcept
    : engine_(other.engine_), memory_(other.memory_), host_(other.host_), bytes_(other.bytes_) {
  other.host_ = nullptr;
  other.engine_ = nullptr;
  other.bytes_ = 0;
}

CudaRegion& CudaRegion::operator=(CudaRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    engine_ = other.engine_;
    memory_ = other.memory_;
    host_ = other.host_;
    bytes_ = other.bytes_;
    other.host_ = nullptr;
    other.engine_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

CudaRegion::~CudaRegion() { Reset(); }

void CudaRegion::Reset() {
  if (host_ == nullptr) return;
  engine_->CloseDeviceMemory(memory_);
  munmap(host_, bytes_);
  host_ = nullptr;
  engine_ = nullptr;
  bytes_ = 0;
}

}  // namespace latentd::server::dataplane
