// Scatter kernel for new KV rows; see scatter_rows.h. One CTA per row, 16-byte moves.
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

}  // namespace

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
