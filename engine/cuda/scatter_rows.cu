// Scatter kernel for new KV rows, and the copy-list kernel that moves a same-host
// client's tensors between its registered memory and device staging; see scatter_rows.h.
#include <cuda_runtime.h>

#include "engine/cuda/scatter_rows.h"

namespace latentd::engine {
namespace {

__global__ void ScatterRowsKernel(const uint4* __restrict__ src, const int64_t* __restrict__ dst_rows,
                                  int vecs_per_row, uint4* __restrict__ pool) {
  const int row = blockIdx.x;
  const uint4* s = src + static_cast<int64_t>(row) * vecs_per_row;
  uint4* d = pool + dst_rows[row] * vecs_per_row;
  for (int i = threadIdx.x; i < vecs_per_row; i += blockDim.x) d[i] = s[i];
}

constexpr uint64_t kChunkBytes = 16384;

__global__ void CopyListKernel(const DeviceCopy* __restrict__ list) {
  const DeviceCopy c = list[blockIdx.x];
  const uint64_t begin = uint64_t(blockIdx.y) * kChunkBytes;
  if (begin >= c.bytes) return;
  const uint64_t end = c.bytes - begin < kChunkBytes ? c.bytes : begin + kChunkBytes;
  if (((c.src | c.dst | begin | end) & 15) == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(c.src + begin);
    uint4* d = reinterpret_cast<uint4*>(c.dst + begin);
    const int n = static_cast<int>((end - begin) / 16);
    // Four loads in flight per thread before their stores: host-mapped reads are slow.
    int i = threadIdx.x;
    for (; i + 3 * blockDim.x < n; i += 4 * blockDim.x) {
      const uint4 a = s[i], b = s[i + blockDim.x], e = s[i + 2 * blockDim.x], f = s[i + 3 * blockDim.x];
      d[i] = a;
      d[i + blockDim.x] = b;
      d[i + 2 * blockDim.x] = e;
      d[i + 3 * blockDim.x] = f;
    }
    for (; i < n; i += blockDim.x) d[i] = s[i];
  } else {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(c.src + begin);
    uint16_t* d = reinterpret_cast<uint16_t*>(c.dst + begin);
    const int n = static_cast<int>((end - begin) / 2);
    for (int i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
  }
}

}  // namespace

int LaunchCopyList(const DeviceCopy* list, int n, uint64_t max_bytes, cudaStream_t stream) {
  if (n <= 0 || max_bytes == 0) return cudaSuccess;
  const uint64_t chunks = (max_bytes + kChunkBytes - 1) / kChunkBytes;
  if (chunks > 65535) return cudaErrorInvalidValue;
  CopyListKernel<<<dim3(n, static_cast<unsigned>(chunks)), 256, 0, stream>>>(list);
  return cudaGetLastError();
}

int LaunchScatterRows(const void* src, const int64_t* dst_rows, int n, int row_bytes, void* pool,
                      cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (row_bytes % 16 != 0) return cudaErrorInvalidValue;
  const int vecs = row_bytes / 16;
  ScatterRowsKernel<<<n, 128, 0, stream>>>(static_cast<const uint4*>(src), dst_rows, vecs,
                                          static_cast<uint4*>(pool));
  return cudaGetLastError();
}

}  // namespace latentd::engine
