// Split-K combine: merges the partial outputs and LSEs of every sequence that the
// planner cut into more than one partition, for any number of partitions.
// lse = log(sum_p exp(lse_p)); out = sum_p exp(lse_p - lse) * o_p.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "kernels/sm80/launch.h"

namespace latentd::kernels::sm80 {
namespace {

constexpr int kMaxCombineWarps = 32;
constexpr int kColsPerCta = 128;  // 32 lanes x float4
constexpr int kChunks = kHeadDimV / kColsPerCta;
constexpr int kUnroll = 8;  // partitions whose loads are in flight together per warp

// Online merge of one partition (lse lp, normalised output o) into (m, s, acc).
__device__ __forceinline__ void Merge(float lp, const float4& o, float& m, float& s, float4& acc) {
  if (lp == -INFINITY) return;  // a partition whose rows saw no keys
  if (lp > m) {
    const float c = __expf(m - lp);  // m = -inf gives 0
    acc.x *= c;
    acc.y *= c;
    acc.z *= c;
    acc.w *= c;
    s *= c;
    m = lp;
  }
  const float w = __expf(lp - m);
  acc.x = fmaf(w, o.x, acc.x);
  acc.y = fmaf(w, o.y, acc.y);
  acc.z = fmaf(w, o.z, acc.z);
  acc.w = fmaf(w, o.w, acc.w);
  s += w;
}

// grid: (row groups, kChunks column chunks); block: (32 x W, R), W warps over the
// partitions of one row, R rows per CTA. Each lane keeps a running (max, sum, 4 columns)
// over its warp's partitions with no block-wide reduction; a row's W warp states merge
// once through shared memory, behind a barrier of that row's warps only (rows of one
// CTA may belong to different sequences, which stop at different points).
// W = ceil(partitions / kUnroll) puts every partition's load of the first round in
// flight at once; R fills the CTA to 8 warps where W is small, so a 4-partition plan
// runs 8 rows per CTA instead of one CTA of 4 warps per row (906cbdd).
template <DType kDType>
__global__ void __launch_bounds__(kMaxCombineWarps * 32) CombineKernel(const CombineArgs args) {
  const MlaDecodeParams& p = args.p;
  const int rows_total = p.h_q * p.s_q;
  // Rows fit an int (LaunchCombineKernel).
  const int row_all = static_cast<int>(blockIdx.x * blockDim.y + threadIdx.y);
  if (row_all >= p.batch * rows_total) return;  // the last group's rows past the end
  const int b = row_all / rows_total, r = row_all % rows_total;

  __shared__ float4 part_acc[kMaxCombineWarps][32];
  __shared__ float part_m[kMaxCombineWarps], part_s[kMaxCombineWarps];
  const int warps = blockDim.x >> 5;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slot0 = threadIdx.y * warps;  // this row's first warp slot in shared memory
  const int64_t first = int64_t(b) * args.num_splits * rows_total + r;  // partition 0 of this row
  const int col = blockIdx.y * kColsPerCta + lane * 4;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of the decode kernel (SM90): resident early,
  // it waits here until the decode grid has finished and its partials are visible.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif

  // The first round of partial loads is issued before seqlens is known (bounded by the
  // grid's partition count; slots past this sequence's count are read but not merged),
  // so the seqlens load and the partial loads share one memory round trip.
  float lp[kUnroll];
  float4 o[kUnroll];
  auto load_round = [&](int i0, int bound) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * warps;
      const int64_t pr = first + int64_t(i) * rows_total;
      lp[u] = i < bound ? args.lse_part[pr] : -INFINITY;
      o[u] = i < bound ? *reinterpret_cast<const float4*>(args.o_part + pr * kHeadDimV + col) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  load_round(warp, args.num_splits);
  const int seqlen = p.seqlens[b];
  const int n = (seqlen + args.keys_per_split - 1) / args.keys_per_split;
  if (n <= 1) return;  // written directly by the decode kernel (the row's warps alike)

  float m = -INFINITY, s = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int i0 = warp;;) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + u * warps < n) Merge(lp[u], o[u], m, s, acc);
    i0 += warps * kUnroll;
    if (i0 >= n) break;
    load_round(i0, n);
  }
  float mx = m, sum = s;
  float4 t = acc;
  if (warps > 1) {
    part_acc[slot0 + warp][lane] = acc;
    if (lane == 0) {
      part_m[slot0 + warp] = m;
      part_s[slot0 + warp] = s;
    }
    // The row's warps only: barrier 1 + row (at most 4 rows per CTA have 2+ warps).
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + static_cast<int>(threadIdx.y)), "r"(warps * 32) : "memory");
    if (warp != 0) return;
    mx = -INFINITY;
    for (int w = 0; w < warps; ++w) mx = fmaxf(mx, part_m[slot0 + w]);
    sum = 0.f;
    t = make_float4(0.f, 0.f, 0.f, 0.f);
    if (mx != -INFINITY) {
      for (int w = 0; w < warps; ++w) {
        if (part_m[slot0 + w] == -INFINITY) continue;
        const float c = __expf(part_m[slot0 + w] - mx);
        sum = fmaf(part_s[slot0 + w], c, sum);
        t.x = fmaf(part_acc[slot0 + w][lane].x, c, t.x);
        t.y = fmaf(part_acc[slot0 + w][lane].y, c, t.y);
        t.z = fmaf(part_acc[slot0 + w][lane].z, c, t.z);
        t.w = fmaf(part_acc[slot0 + w][lane].w, c, t.w);
      }
    }
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  t.x *= inv;
  t.y *= inv;
  t.z *= inv;
  t.w *= inv;
  const float lse = sum > 0.f ? mx + logf(sum) : -INFINITY;
  // Row r = kv head * (group * s_q) + token * group + head within the group.
  const int group = p.h_q / p.h_kv, rows_kv = group * p.s_q;
  const int kvh = r / rows_kv, rl = r % rows_kv;
  const int token = rl / group, head = kvh * group + rl % group;
  uint16_t* dst = static_cast<uint16_t*>(p.out) + int64_t(b) * p.out_batch_stride + int64_t(token) * p.out_seq_stride +
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
  *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
  if (blockIdx.y == 0 && lane == 0) p.lse[int64_t(b) * p.lse_batch_stride + int64_t(head) * p.lse_head_stride + token] = lse;
}

// Whether the combine kernel may launch as a programmatic dependent of the decode kernel:
// the device runs programmatic dependent launches (SM90 and up) and the combine kernel's
// machine code holds its griddepcontrol.wait. Only PTX for compute_90 and up can carry
// that instruction; machine code for sm_90 built from compute_80 PTX (how the decode
// kernels themselves are built) has it compiled out, and a dependent launch of such a
// combine could then start as the decode grid's last CTAs exit and read partials whose
// stores were not yet visible: wrong columns in a few rows, now and then.
// LATENTD_COMBINE_PDL=0 never launches it so; =1 always does where the device can, wait
// or not: a testing aid that brings that race back (docs/testing.md).
// One query per device.
bool CombineUsesPdl() {
  static std::atomic<uint64_t> known{0}, yes{0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= 64) return false;
  const uint64_t bit = uint64_t{1} << dev;
  if (known.load(std::memory_order_acquire) & bit) return (yes.load(std::memory_order_relaxed) & bit) != 0;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, CombineKernel<DType::kBF16>) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  bool use = major >= 9 && attr.ptxVersion >= 90;
  if (const char* env = std::getenv("LATENTD_COMBINE_PDL"); env != nullptr && (env[0] == '0' || env[0] == '1'))
    use = major >= 9 && env[0] == '1';
  if (use) yes.fetch_or(bit, std::memory_order_relaxed);
  known.fetch_or(bit, std::memory_order_acq_rel);
  return use;
}

}  // namespace

cudaError_t LaunchCombineKernel(const CombineArgs& args, cudaStream_t stream) {
  const int64_t rows = int64_t(args.p.batch) * args.p.h_q * args.p.s_q;
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffff - 8) return cudaErrorInvalidConfiguration;
  // Warps per row: every partition's first load in flight at once (up to 32 x kUnroll);
  // rows per CTA: up to 8 warps in all.
  const int warps = std::max(1, std::min(kMaxCombineWarps, (args.num_splits + kUnroll - 1) / kUnroll));
  const int rows_per_cta = std::max(1, 8 / warps);
  const int64_t groups = (rows + rows_per_cta - 1) / rows_per_cta;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(groups), kChunks);
  cfg.blockDim = dim3(32 * warps, rows_per_cta);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  // SM90 with the wait compiled in (CombineUsesPdl): launched while the decode kernel
  // still runs (it waits in griddepcontrol.wait), so the launch latency overlaps the
  // decode kernel's tail.
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = CombineUsesPdl() ? 1 : 0;
  if (args.p.dtype == DType::kBF16) return cudaLaunchKernelEx(&cfg, CombineKernel<DType::kBF16>, args);
  if (args.p.dtype == DType::kFP16) return cudaLaunchKernelEx(&cfg, CombineKernel<DType::kFP16>, args);
  return cudaErrorInvalidValue;
}

}  // namespace latentd::kernels::sm80
