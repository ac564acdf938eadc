// The KV cache in device memory: one cudaMalloc at start-up, copies ordered on the
// engine's stream. Kept out of the bookkeeping library so CPU-only builds (and the
// manager's tests) never see CUDA; this header includes no CUDA headers.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/kv/config.h"
#include "engine/kv/storage.h"

typedef struct CUstream_st* cudaStream_t;

namespace latentd::engine::kv {

// Allocates and zeroes config.total_bytes() on `device`. WriteRows and CopyPage are
// asynchronous on `stream` (nullptr: the legacy default stream), so they are ordered
// before any kernel later launched there. WriteRows' source may be reused once it
// returns when it is pageable memory (CUDA stages it); pinned sources must stay
// untouched until Synchronize() (an fp8 cache quantizes into its own scratch first, so
// there any source may be reused at once). ReadRows waits for its copy and returns the
// stored bytes. RESOURCE_EXHAUSTED when
// the allocation fails, UNAVAILABLE when the device cannot be used.
absl::StatusOr<std::unique_ptr<KvStorage>> MakeCudaKvStorage(const KvCacheConfig& config,
                                                             int device, cudaStream_t stream);

// Free memory on `device` now, in bytes (cudaMemGetInfo).
absl::StatusOr<int64_t> CudaFreeMemoryBytes(int device);

// A config whose pool takes `fraction` of the free memory on `device`.
absl::StatusOr<KvCacheConfig> KvCacheConfigFromFreeGpuMemory(int num_layers,
                                                             int num_heads_kv,
                                                             double fraction, int device,
                                                             int bytes_per_value = 2,
                                                             kernels::KvDType kv_dtype = kernels::KvDType::kModel,
                                                             kernels::DType dtype = kernels::DType::kBF16);

}  // namespace latentd::engine::kv
