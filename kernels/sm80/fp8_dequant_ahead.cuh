// FP8 KV cache, dequantized one tile ahead (Fp8Pipeline::kDequantAhead: the 64-row
// tile's SM90 plan, 904a104). Raw rows land in a 2-stage ring of their own
// (Fp8AheadSharedMemoryPlan); tile t+1 is dequantized into the other 16-bit stage between
// tile t's PV mma, whose issue slots are two-thirds idle, so the conversion costs no
// barriers: the tile's first barrier publishes it.
#pragma once

#include <cstdint>

#include "kernels/kv_fp8.h"
#include "kernels/sm80/cta.cuh"
#include "kernels/sm80/fp8_common.cuh"
#include "kernels/sm80/primitives.cuh"
#include "kernels/sm80/traits.h"

namespace latentd::kernels::sm80::detail {

template <class T>
struct Fp8DequantAhead {
  using Plan = typename T::SharedMemoryPlan;
  static constexpr int kRawChunks = kFp8RowBytes / 16;  // 41 per row
  static_assert(T::kCta == 256 && T::kN == 32, "dequantization ahead: 8 warps over 32-key tiles");
  // Parts of a thread's share of one tile's conversion, spread over the PV's 16 steps.
  static constexpr int kParts = 9;

  // Copies tile t's raw rows (on `page`) into raw stage s, packed.
  static __device__ __forceinline__ void CopyTile(const Cta<T>& cta, Plan& sm, int t, int s, int page) {
    const Fp8RowCopy<T> rc(cta, t, page);
    constexpr int kT = Fp8RowCopy<T>::kT;
    const uint32_t dst = SmemAddr(&sm.raw[s][0][0]) + rc.key * kFp8RowBytes + rc.c * 16;
#pragma unroll
    for (int j = 0; j < (kRawChunks + kT - 1) / kT; ++j) {
      if ((kRawChunks % kT) != 0 && j == kRawChunks / kT && rc.c >= kRawChunks % kT) break;
      CpAsync16(dst + j * kT * 16, rc.src + j * kT * 16, rc.valid);
    }
  }

  // Part `part` (0-8) of a thread's share of raw stage `st` into 16-bit stage `st`.
  // Parts 0-7: 8 latent values (half a scale block's 16-byte chunk) of key warp + 8
  // (part / 2), output chunk lane + 32 (part % 2), so a warp reads 256 contiguous raw
  // bytes and writes 32 whole chunks of one row (conflict-free); part 8: one 16-byte
  // chunk of the rope values, copied. 8 warps x 4 keys = the 32 keys.
  static __device__ inline void Part(const Cta<T>& cta, Plan& sm, int part, int st) {
    const int tid = cta.tid, lane = cta.lane;
    const uint8_t* raw = &sm.raw[st][0][0];
    uint16_t* dst = &sm.kv[st][0][0];
    if (part < 8) {
      const int key = (tid >> 5) + 8 * (part >> 1), c = lane + 32 * (part & 1);
      const uint8_t* row = raw + key * kFp8RowBytes;
      const uint2 codes = *reinterpret_cast<const uint2*>(row + c * 8);
      const uint32_t sp = Fp8ScalePair<T::kDType>(
          *reinterpret_cast<const uint32_t*>(row + kFp8ScaleOffset + (c * 8 / kFp8BlockValues) * 4));
      uint4 o;
      o.x = Fma2NegZero<T::kDType>(E4m3PairBits<T::kDType>(__byte_perm(codes.x, 0u, 0x1404)), sp);
      o.y = Fma2NegZero<T::kDType>(E4m3PairBits<T::kDType>(__byte_perm(codes.x, 0u, 0x3424)), sp);
      o.z = Fma2NegZero<T::kDType>(E4m3PairBits<T::kDType>(__byte_perm(codes.y, 0u, 0x1404)), sp);
      o.w = Fma2NegZero<T::kDType>(E4m3PairBits<T::kDType>(__byte_perm(codes.y, 0u, 0x3424)), sp);
      *reinterpret_cast<uint4*>(dst + Swizzle(key, c)) = o;
    } else {
      const int key = tid >> 3, c = tid & 7;
      *reinterpret_cast<uint4*>(dst + Swizzle(key, kHeadDimV / 8 + c)) =
          *reinterpret_cast<const uint4*>(raw + key * kFp8RowBytes + kFp8RopeOffset + c * 16);
    }
  }

  // Before the loop: tile 0 (and Q) landed; dequantize it, and the loop's first barrier
  // publishes it.
  static __device__ __forceinline__ void Prologue(const Cta<T>& cta, Plan& sm) {
    CpAsyncWait<T::kAhead - 1>();
    __syncthreads();
    if (cta.num_tiles > 0)
#pragma unroll
      for (int part = 0; part < kParts; ++part) Part(cta, sm, part, 0);
  }

  // Inside PV step `step` (0-15) of tile t: tile t+1's parts 0-7 on even steps, the rope
  // copy on the last. On the last tile it converts whatever raw stage (t+1) % 2 holds,
  // into a stage nobody reads again: it keeps the PV loop free of a branch.
  static __device__ __forceinline__ void DuringPv(const Cta<T>& cta, Plan& sm, int step, int ahead_stage) {
    static_assert(T::kVT == 16 && T::kNT == 4, "16 PV steps per tile");
    if (step % 2 == 0) Part(cta, sm, step / 2, ahead_stage);
    if (step == 15) Part(cta, sm, 8, ahead_stage);
  }
};

}  // namespace latentd::kernels::sm80::detail
