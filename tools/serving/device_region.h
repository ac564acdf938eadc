// A benchmark runner's tensors on the GPU, for the CUDA region of a Decode stream
// (DecodeRequest.open_cuda_region): one device allocation shared through CUDA IPC, plus
// a pool of inputs uploaded once, from which each layer's q and kv are copied on the
// device, the way a model produces them. Without CUDA support built in, Create fails.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace latentd::tools {

class DeviceRegion {
 public:
  // region_bytes of memory on CUDA device `device` for the stream, and the pool's tensors
  // there. The daemon may run on another device of the host: it opens the handle with
  // peer access (the attention/FFN layout of one host, runner and daemon on two GPUs).
  static absl::StatusOr<std::unique_ptr<DeviceRegion>> Create(int device, uint64_t region_bytes,
                                                              const std::vector<std::string>& pool);
  virtual ~DeviceRegion() = default;
  // The region allocation's cudaIpcMemHandle_t (64 bytes).
  virtual std::string IpcHandle() const = 0;
  // Queues a device copy of pool tensor i to the region at offset (no host work).
  virtual void CopyFromPool(uint64_t offset, int i) = 0;
  // Waits for the queued copies.
  virtual absl::Status Sync() = 0;
  // n bytes of the region at offset, copied to the host.
  virtual std::string Read(uint64_t offset, size_t n) = 0;
};

}  // namespace latentd::tools
