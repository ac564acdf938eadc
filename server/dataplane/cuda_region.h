// The CUDA IPC region of the same-host data plane: a client's device allocation, opened
// from its IPC handle for one Decode stream, so steps' tensors move between the client's
// GPU memory and the kernels with no host copy. The CUDA calls stay behind
// engine::Engine (OpenDeviceMemory), so this builds and runs without CUDA.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "proto/wire.h"

namespace latentd::server::dataplane {

// Host-side the region is an inaccessible reservation of the region's size: steps'
// pointers are computed from it (and checked against it, region_layout.h) like a shared
// file's, but only the device ever touches the memory. Move-only; closes the device
// memory and frees the reservation when destroyed (only once no step uses it).
class CudaRegion {
 public:
  // The request's own fields: a handle of cudaIpcMemHandle_t's size (INVALID_ARGUMENT),
  // a size above 0 (INVALID_ARGUMENT) and at most max_region_bytes
  // (RESOURCE_EXHAUSTED). Messages name the DecodeRequest field.
  static absl::Status CheckRequest(const wire::CudaRegionFields& req, int64_t max_region_bytes);
  // Opens a checked request's handle through the engine and reserves its host
  // placeholder. The engine's error (prefixed with "DecodeRequest."), or
  // RESOURCE_EXHAUSTED when no address space is left; nothing stays open on failure.
  static absl::StatusOr<CudaRegion> Open(engine::Engine* engine, const wire::CudaRegionFields& req);

  CudaRegion() = default;
  CudaRegion(CudaRegion&& other) noexcept;
  CudaRegion& operator=(CudaRegion&& other) noexcept;
  CudaRegion(const CudaRegion&) = delete;
  CudaRegion& operator=(const CudaRegion&) = delete;
  ~CudaRegion();

  bool empty() const { return host_ == nullptr; }
  char* host() const { return host_; }          // the placeholder; never dereferenced
  uint64_t device() const { return memory_.address; }
  uint64_t bytes() const { return bytes_; }

 private:
  void Reset();

  engine::Engine* engine_ = nullptr;
  engine::DeviceMemory memory_;
  char* host_ = nullptr;
  uint64_t bytes_ = 0;
};

}  // namespace latentd::server::dataplane
