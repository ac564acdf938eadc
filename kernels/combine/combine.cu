// Split-K combine: merges the partial outputs and LSEs of every sequence that the
// planner cut into more than one partition, for any number of partitions.
// lse = log(sum_p exp(lse_p)); out = sum_p exp(lse_p - lse) * o_p.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/sm80/launch.h"

namespace latentd::kernels::sm80 {
namespace {

constexpr int kCombineWarps = 8;
constexpr int kCombineThreads = kCombineWarps * 32;
constexpr int kColsPerCta = 128;  // 32 lanes x float4
constexpr int kChunks = kHeadDimV / kColsPerCta;

__device__ __forceinline__ float BlockReduce(float v, float* red, bool is_max) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float u = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, u) : v + u;
  }
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
  __syncthreads();
  return r;
}

// grid: (b * h_q * s_q rows, kChunks column chunks). Warps split the partitions.
template <DType kDType>
__global__ void __launch_bounds__(kCombineThreads) CombineKernel(const CombineArgs args) {
  const MlaDecodeParams& p = args.p;
  const int rows_total = p.h_q * p.s_q;
  const int b = blockIdx.x / rows_total, r = blockIdx.x % rows_total;
  const int seqlen = p.seqlens[b];
  const int n = (seqlen + args.keys_per_split - 1) / args.keys_per_split;
  if (n <= 1) return;  // written directly by the decode kernel

  __shared__ float red[kCombineWarps];
  __shared__ float4 part[kCombineWarps][32];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t first = int64_t(b) * args.num_splits * rows_total + r;  // partition 0 of this row
  const float* lse_p = args.lse_part + first;

  float mx = -INFINITY;
  for (int i = tid; i < n; i += kCombineThreads) mx = fmaxf(mx, lse_p[int64_t(i) * rows_total]);
  mx = BlockReduce(mx, red, true);
  const float m_use = mx == -INFINITY ? 0.f : mx;
  float sum = 0.f;
  for (int i = tid; i < n; i += kCombineThreads) sum += __expf(lse_p[int64_t(i) * rows_total] - m_use);
  sum = BlockReduce(sum, red, false);
  const float lse = sum > 0.f ? m_use + logf(sum) : -INFINITY;

  const int col = blockIdx.y * kColsPerCta + lane * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (sum > 0.f) {
    for (int i = warp; i < n; i += kCombineWarps) {
      const float w = __expf(lse_p[int64_t(i) * rows_total] - lse);
      const float4 o = *reinterpret_cast<const float4*>(args.o_part + (first + int64_t(i) * rows_total) * kHeadDimV + col);
      acc.x = fmaf(w, o.x, acc.x);
      acc.y = fmaf(w, o.y, acc.y);
      acc.z = fmaf(w, o.z, acc.z);
      acc.w = fmaf(w, o.w, acc.w);
    }
  }
  part[warp][lane] = acc;
  __syncthreads();
  if (warp != 0) return;
  float4 t = part[0][lane];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) {
    t.x += part[w][lane].x;
    t.y += part[w][lane].y;
    t.z += part[w][lane].z;
    t.w += part[w][lane].w;
  }
  // Row r = kv head * (group * s_q) + token * group + head within the group.
  const int group = p.h_q / p.h_kv, rows_kv = group * p.s_q;
  const int kvh = r / rows_kv, rl = r % rows_kv;
  const int token = rl / group, head = kvh * group + rl % group;
  uint16_t* o = static_cast<uint16_t*>(p.out) + int64_t(b) * p.out_batch_stride + int64_t(token) * p.out_seq_stride +
                int64_t(head) * p.out_head_stride + col;
  uint32_t lo, hi;
  if constexpr (kDType == DType::kBF16) {
    __nv_bfloat162 a = __floats2bfloat162_rn(t.x, t.y), c = __floats2bfloat162_rn(t.z, t.w);
    lo = *reinterpret_cast<uint32_t*>(&a);
    hi = *reinterpret_cast<uint32_t*>(&c);
  } else {
    __half2 a = __floats2half2_rn(t.x, t.y), c = __floats2half2_rn(t.z, t.w);
    lo = *reinterpret_cast<uint32_t*>(&a);
    hi = *reinterpret_cast<uint32_t*>(&c);
  }
  *reinterpret_cast<uint2*>(o) = make_uint2(lo, hi);
  if (blockIdx.y == 0 && lane == 0) p.lse[int64_t(b) * p.lse_batch_stride + int64_t(head) * p.lse_head_stride + token] = lse;
}

}  // namespace

cudaError_t LaunchCombineKernel(const CombineArgs& args, cudaStream_t stream) {
  const int64_t rows = int64_t(args.p.batch) * args.p.h_q * args.p.s_q;
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(rows), kChunks);
  if (args.p.dtype == DType::kBF16) {
    CombineKernel<DType::kBF16><<<grid, kCombineThreads, 0, stream>>>(args);
  } else if (args.p.dtype == DType::kFP16) {
    CombineKernel<DType::kFP16><<<grid, kCombineThreads, 0, stream>>>(args);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace latentd::kernels::sm80
