// The SM80 instructions the decode kernel is written with (cp.async, named barriers,
// ldmatrix, mma.sync, ex2) and the XOR swizzle of its shared-memory tiles, as inline
// device functions. Included by kernel.cuh and the FP8 pipeline headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/params.h"
#include "kernels/sm80/config.h"

namespace latentd::kernels::sm80 {
namespace detail {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy, bypassing L1 (KV is streamed once). src_bytes 0 fills
// the destination with zeros without reading src: keys past the end never touch memory
// (unowned cache rows hold NaN).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
// Barrier `id` (1 + group) over the 128 threads of one group of 4 warps; barrier 0 is
// __syncthreads.
__device__ __forceinline__ void GroupSync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
// The same barrier, returning whether `v` was true in any of the group's threads.
__device__ __forceinline__ bool GroupAny(int id, bool v) {
  int r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.s32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(int(v)), "r"(id), "n"(kThreads)
      : "memory");
  return r != 0;
}
// Named barrier `id` over `n` threads: wait for all n (sync), or count this thread in and
// go on (arrive), the producer/consumer pair of the 64-row tile's ping-pong.
__device__ __forceinline__ void BarSync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void BarArrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void Ldmatrix4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void Ldmatrix4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <DType kDType>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kDType == DType::kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// 2^x on the SFU alone. Results below 2^-126 flush to zero: they are P values or
// rescale factors under 2^-126 of the running max, whose rows' sums are >= 1, so they
// change no output; exp2f would spend three more instructions keeping them subnormal.
__device__ __forceinline__ float Exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// Two floats -> two 16-bit values in one register (lo in the low half).
template <DType kDType>
__device__ __forceinline__ uint32_t Pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (kDType == DType::kBF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&v);
  }
  return r;
}

// Low part of a bf16 split: x - bf16(x), so that bf16(x) + PackLow(x) carries ~16 bits.
__device__ __forceinline__ uint32_t PackLowBf16(float lo, float hi, uint32_t packed_high) {
  const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&packed_high);
  const float2 f = __bfloat1622float2(h);
  __nv_bfloat162 v = __floats2bfloat162_rn(lo - f.x, hi - f.y);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Element offset of (row, 16-byte chunk) in a [rows][576] swizzled tile. A row is 72
// chunks = 1152 bytes, a multiple of 128, so without the XOR the 8 rows of an ldmatrix
// would all hit the same banks.
__device__ __forceinline__ int Swizzle(int row, int chunk) {
  return row * kHeadDimQK + (((chunk & ~7) | ((chunk ^ row) & 7)) << 3);
}
// The same swizzle for rows of kChunks chunks (a multiple of 8): the Q tile, which keeps
// fewer than 72 chunks per row when some of Q lives in registers.
template <int kChunks>
__device__ __forceinline__ int SwizzleRow(int row, int chunk) {
  static_assert(kChunks % 8 == 0, "whole 128-byte groups per row");
  return row * kChunks * 8 + (((chunk & ~7) | ((chunk ^ row) & 7)) << 3);
}

}  // namespace detail
}  // namespace latentd::kernels::sm80
