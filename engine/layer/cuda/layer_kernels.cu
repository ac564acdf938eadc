// RMSNorm and RoPE kernels for CudaLayerMath (layer_kernels.h). Each float32 step is written
// with an explicit round-to-nearest intrinsic so that nvcc cannot contract it into an FMA:
// the results are then CpuLayerMath's bit for bit, given the same rounded inputs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "engine/layer/cuda/layer_kernels.h"

namespace latentd::engine::layer {
namespace {

using kernels::DType;

constexpr int kRopeDim = 64;
constexpr int kRopeHalf = kRopeDim / 2;  // one pair per lane of a warp
constexpr int kLatent = 512;
constexpr int kRow = kLatent + kRopeDim;

template <DType kDtype>
__device__ __forceinline__ float Load(uint16_t bits) {
  if constexpr (kDtype == DType::kBF16) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  } else {
    return __half2float(__ushort_as_half(bits));
  }
}

// Round to nearest even, as kernels/cpu/half.h's FloatToHalf (NaN stays NaN; its payload may differ).
template <DType kDtype>
__device__ __forceinline__ uint16_t Store(float f) {
  if constexpr (kDtype == DType::kBF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  } else {
    return __half_as_ushort(__float2half_rn(f));
  }
}

template <DType kDtype>
__device__ __forceinline__ float Round(float f) {
  return Load<kDtype>(Store<kDtype>(f));
}

template <DType kDtype>
constexpr uint16_t kNan = kDtype == DType::kBF16 ? 0x7fc0 : 0x7e00;

// Sum over the block; every thread gets the same value. Double: the squares of 16-bit values
// are exact in double, and their sums almost always are, so the order (a tree here, a loop on
// the CPU) does not change the result.
__device__ double BlockSum(double v, double* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, m));
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < warps; ++w) total = __dadd_rn(total, shared[w]);
  return total;
}

// One row of RMSNorm in place by the whole block (blockDim.x a multiple of 32, at most 1024).
template <DType kDtype>
__device__ void RmsNormRow(uint16_t* row, int width, const uint16_t* __restrict__ weight, float eps) {
  __shared__ double partial[32];
  double sum = 0;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    const double x = Load<kDtype>(row[i]);
    sum = __dadd_rn(sum, __dmul_rn(x, x));
  }
  sum = BlockSum(sum, partial);
  // CpuLayerMath: variance = float(sum / width); inv = 1.0f / sqrt(variance + eps).
  const float variance = __double2float_rn(__ddiv_rn(sum, static_cast<double>(width)));
  const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(variance, eps)));
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    const float normed = Round<kDtype>(__fmul_rn(Load<kDtype>(row[i]), inv));
    row[i] = Store<kDtype>(__fmul_rn(Load<kDtype>(weight[i]), normed));
  }
}

// One 64-value vector rotated by one full warp; src may equal dst (all reads happen before
// the __syncwarp, all writes after it).
template <DType kDtype>
__device__ void RopeVector(const uint16_t* src, uint16_t* dst, int position, const DeviceRopeTable& table) {
  const int i = threadIdx.x & 31;
  const float first = Load<kDtype>(table.interleave ? src[2 * i] : src[i]);
  const float second = Load<kDtype>(table.interleave ? src[2 * i + 1] : src[i + kRopeHalf]);
  __syncwarp();
  uint16_t a = kNan<kDtype>, b = kNan<kDtype>;
  if (position >= 0 && position < table.max_positions) {
    const int64_t at = static_cast<int64_t>(position) * kRopeHalf + i;
    const float c = table.cos[at], s = table.sin[at];
    // Rope::ApplyUnchecked: x[i] = first * c - second * s; x[i + 32] = second * c + first * s.
    a = Store<kDtype>(__fsub_rn(__fmul_rn(first, c), __fmul_rn(second, s)));
    b = Store<kDtype>(__fadd_rn(__fmul_rn(second, c), __fmul_rn(first, s)));
  }
  dst[i] = a;
  dst[i + kRopeHalf] = b;
}

template <DType kDtype>
__global__ void RmsNormKernel(uint16_t* v, int width, int64_t stride, const uint16_t* __restrict__ weight, float eps) {
  RmsNormRow<kDtype>(v + blockIdx.x * stride, width, weight, eps);
}

constexpr int kRopeWarpsPerBlock = 4;

// One warp per (token, head) vector.
template <DType kDtype>
__global__ void RopeKernel(const uint16_t* src, int64_t src_token_stride, int64_t src_head_stride, uint16_t* dst,
                           int64_t dst_token_stride, int64_t dst_head_stride, int n, int heads,
                           const int32_t* __restrict__ positions, DeviceRopeTable table) {
  const int64_t vector = static_cast<int64_t>(blockIdx.x) * kRopeWarpsPerBlock + (threadIdx.x >> 5);
  if (vector >= static_cast<int64_t>(n) * heads) return;  // whole warps leave together
  const int t = static_cast<int>(vector / heads), j = static_cast<int>(vector % heads);
  RopeVector<kDtype>(src + t * src_token_stride + j * src_head_stride,
                     dst + t * dst_token_stride + j * dst_head_stride, positions[t], table);
}

constexpr int kLatentThreads = 128;

// One block per row: RMSNorm of the 512 latent values by the block, RoPE of the 64 rope
// values by warp 0 (disjoint values, so no ordering between the two is needed).
template <DType kDtype>
__global__ void LatentNormRopeKernel(uint16_t* rows, const uint16_t* __restrict__ weight, float eps,
                                     const int32_t* __restrict__ positions, DeviceRopeTable table) {
  uint16_t* row = rows + static_cast<int64_t>(blockIdx.x) * kRow;
  RmsNormRow<kDtype>(row, kLatent, weight, eps);
  if (threadIdx.x < 32) RopeVector<kDtype>(row + kLatent, row + kLatent, positions[blockIdx.x], table);
}

}  // namespace

int LaunchRmsNorm(DType dtype, uint16_t* v, int n, int width, int64_t stride, const uint16_t* weight, float eps,
                  cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int threads = width >= 1024 ? 256 : 128;
  if (dtype == DType::kBF16) {
    RmsNormKernel<DType::kBF16><<<n, threads, 0, stream>>>(v, width, stride, weight, eps);
  } else {
    RmsNormKernel<DType::kFP16><<<n, threads, 0, stream>>>(v, width, stride, weight, eps);
  }
  return cudaGetLastError();
}

int LaunchRope(DType dtype, const uint16_t* src, int64_t src_token_stride, int64_t src_head_stride, uint16_t* dst,
               int64_t dst_token_stride, int64_t dst_head_stride, int n, int heads, const int32_t* positions,
               const DeviceRopeTable& table, cudaStream_t stream) {
  if (n <= 0 || heads <= 0) return cudaSuccess;
  const int64_t vectors = static_cast<int64_t>(n) * heads;
  const unsigned blocks = static_cast<unsigned>((vectors + kRopeWarpsPerBlock - 1) / kRopeWarpsPerBlock);
  constexpr int threads = 32 * kRopeWarpsPerBlock;
  if (dtype == DType::kBF16) {
    RopeKernel<DType::kBF16><<<blocks, threads, 0, stream>>>(src, src_token_stride, src_head_stride, dst,
                                                               dst_token_stride, dst_head_stride, n, heads, positions,
                                                               table);
  } else {
    RopeKernel<DType::kFP16><<<blocks, threads, 0, stream>>>(src, src_token_stride, src_head_stride, dst,
                                                               dst_token_stride, dst_head_stride, n, heads, positions,
                                                               table);
  }
  return cudaGetLastError();
}

int LaunchLatentNormRope(DType dtype, uint16_t* rows, int n, const uint16_t* weight, float eps,
                         const int32_t* positions, const DeviceRopeTable& table, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (dtype == DType::kBF16) {
    LatentNormRopeKernel<DType::kBF16><<<n, kLatentThreads, 0, stream>>>(rows, weight, eps, positions, table);
  } else {
    LatentNormRopeKernel<DType::kFP16><<<n, kLatentThreads, 0, stream>>>(rows, weight, eps, positions, table);
  }
  return cudaGetLastError();
}

}  // namespace latentd::engine::layer
