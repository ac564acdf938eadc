// Scatter kernel for new KV rows, and the copy-list kernel that moves a same-host
// client's tensors between its registered memory and device staging; see scatter_rows.h.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/cuda/scatter_rows.h"
#include "kernels/kv_fp8.h"

namespace latentd::engine {
namespace {

using kernels::DType;

// One CTA per token row. Each warp quantizes one 128-value block of one head at a time,
// four values a lane; the block's largest finite magnitude comes from a butterfly max.
// Max is order independent and the rest is the element functions of kv_fp8.h applied
// per value, so the bytes equal QuantizeKvRowFp8's (this file is built without
// fast-math / flush-to-zero, which would change subnormal inputs).
template <DType kDtype>
__global__ void ScatterRowsFp8Kernel(const uint16_t* __restrict__ src, const int64_t* __restrict__ dst_rows,
                                     int h_kv, uint8_t* __restrict__ pool) {
  using namespace kernels;
  const int row = blockIdx.x;
  const uint16_t* s_row = src + int64_t{row} * h_kv * kHeadDimQK;
  uint8_t* d_row = pool + dst_rows[row] * h_kv * kFp8RowBytes;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int task = warp; task < h_kv * kFp8Blocks; task += warps) {
    const int head = task / kFp8Blocks, blk = task % kFp8Blocks;
    const uint16_t* s = s_row + head * kHeadDimQK + blk * kFp8BlockValues + lane * 4;
    const uint2 raw = *reinterpret_cast<const uint2*>(s);  // 8-byte aligned: rows are 1152 bytes
    const uint16_t h[4] = {static_cast<uint16_t>(raw.x & 0xffffu), static_cast<uint16_t>(raw.x >> 16),
                           static_cast<uint16_t>(raw.y & 0xffffu), static_cast<uint16_t>(raw.y >> 16)};
    float x[4];
    uint32_t amax = 0;  // bits of the largest finite |x|: for non-negative floats bit order is value order
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[i] = kDtype == DType::kBF16 ? Fp8BitsFloat(uint32_t{h[i]} << 16) : __half2float(__ushort_as_half(h[i]));
      const uint32_t a = Fp8FloatBits(x[i]) & 0x7fffffffu;
      if (a < 0x7f800000u && a > amax) amax = a;  // NaN and +-inf do not choose the scale
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    const int e = Fp8BlockExponent(Fp8BitsFloat(amax), kDtype);
    const float inv = Fp8Pow2(-e);
    uint32_t q = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) q |= uint32_t{FloatToE4m3(__fmul_rn(x[i], inv))} << (8 * i);
    uint8_t* d = d_row + head * kFp8RowBytes;
    *reinterpret_cast<uint32_t*>(d + blk * kFp8BlockValues + lane * 4) = q;
    if (lane == 0) *reinterpret_cast<float*>(d + kFp8ScaleOffset + 4 * blk) = Fp8Pow2(e);
  }
  // The rope values as they came: 128 bytes, eight 16-byte vectors per head (both rows'
  // rope parts are 16-byte aligned: 1024 of 1152, 528 of 656).
  constexpr int kRopeVecs = (kHeadDimQK - kHeadDimV) * 2 / 16;
  for (int i = threadIdx.x; i < h_kv * kRopeVecs; i += blockDim.x) {
    const int head = i / kRopeVecs, v = i % kRopeVecs;
    const uint4 val = reinterpret_cast<const uint4*>(s_row + head * kHeadDimQK + kHeadDimV)[v];
    reinterpret_cast<uint4*>(d_row + head * kFp8RowBytes + kFp8RopeOffset)[v] = val;
  }
}

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

int LaunchScatterRowsFp8(const void* src, const int64_t* dst_rows, int n, int h_kv, kernels::DType dtype,
                         void* pool, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (h_kv < 1) return cudaErrorInvalidValue;
  const auto* s = static_cast<const uint16_t*>(src);
  auto* d = static_cast<uint8_t*>(pool);
  if (dtype == DType::kBF16) {
    ScatterRowsFp8Kernel<DType::kBF16><<<n, 128, 0, stream>>>(s, dst_rows, h_kv, d);
  } else if (dtype == DType::kFP16) {
    ScatterRowsFp8Kernel<DType::kFP16><<<n, 128, 0, stream>>>(s, dst_rows, h_kv, d);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace latentd::engine
