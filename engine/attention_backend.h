// The attention backends behind one interface: CUDA (planner, SM80 kernel and combine
// on one stream, with the next batch's copies overlapping this one's compute) and CPU
// (kernels/cpu). The scheduler drives them in three phases per batch.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/batch.h"
#include "engine/types.h"
#include "engine/kv/manager.h"

namespace latentd::engine {

// A backend is built from the engine's own options: it reads the model, device, launch
// sizes (max_batch_size, max_batch_tokens, max_s_q), cpu_threads and the pool's sizing
// and format (kv_pages, kv_bytes, kv_memory_fraction, kv_dtype), and nothing else.
// One struct, so a new option reaches the backends without being copied field by field.
using BackendOptions = EngineOptions;

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  virtual std::string Name() const = 0;          // "cpu" or "cuda:<device name>"
  virtual kv::KvStorage* storage() = 0;          // the KV pool's bytes
  virtual const kv::KvCacheConfig& kv_config() const = 0;

  // Phase 1, under the engine's KV lock: copy what the batch needs (q, block tables,
  // seqlens) into this backend's staging for batch.slot, and write (CPU) or queue the
  // writes of (CUDA, on the pool's stream) the new rows, so that any page copy the KV
  // cache makes later is ordered after them. May mark entries failed.
  virtual void Stage(Batch& batch) = 0;
  // Phase 2, without locks: start (GPU) or run (CPU) the attention.
  virtual void Launch(Batch& batch) = 0;
  // Phase 3: wait for the batch, write each OK entry's out and lse into its step.
  virtual void Finish(Batch& batch) = 0;
  // True when Launch computes the batch before returning (the CPU backend): the
  // scheduler then finishes it at once instead of after the next batch's launch, which
  // only pays when the launch is asynchronous.
  virtual bool SynchronousLaunch() const { return false; }
  // Whether Finish(batch) would return without waiting (the device is done with it).
  virtual bool Ready(Batch& batch) { return true; }

  // Host memory that steps' tensors will lie in (see Engine::RegisterHostMemory): the
  // address the device reaches `base` at, or 0 when this backend does not reach host
  // memory directly (the CPU backend) or could not register it.
  virtual uint64_t RegisterHostMemory(void* base, size_t bytes) { return 0; }
  virtual void UnregisterHostMemory(void* base) {}

  // Another process's device allocation (see Engine::OpenDeviceMemory).
  virtual absl::StatusOr<DeviceMemory> OpenDeviceMemory(absl::string_view ipc_handle, uint64_t offset,
                                                        uint64_t bytes) {
    return absl::FailedPreconditionError(
        "open_cuda_region: this daemon serves on the CPU backend, which cannot reach device memory; use "
        "open_region_bytes");
  }
  virtual void CloseDeviceMemory(const DeviceMemory& memory) {}

  // For work queued around a batch's own (the CUDA layer stage's projections), as
  // cudaStream_t / cudaEvent_t: the stream kernels run on, the stream the inputs' copies
  // run on, the device, and an event recorded once the batch's results are written
  // (device-direct outputs included; valid after Launch). Null on the CPU backend.
  virtual void* compute_stream() { return nullptr; }
  virtual void* input_stream() { return nullptr; }
  virtual int device() const { return 0; }
  virtual void* results_event(const Batch& batch) { return nullptr; }
};

// kCpu always works; kCuda fails without a device or without CUDA support built in;
// kAuto picks CUDA when a device is present.
absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeBackend(BackendKind kind, const BackendOptions& options);

absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCpuBackend(const BackendOptions& options);
// Defined only when built with CUDA; elsewhere returns UNAVAILABLE.
absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCudaBackend(const BackendOptions& options);
bool CudaDevicePresent();

}  // namespace latentd::engine
