// The e4m3 -> 16-bit conversion every FP8 KV cache pipeline uses (bit moves plus one
// exact fma by the block scale), and the source address of a raw cache row's chunk.
// The pipelines themselves: fp8_in_place.cuh, fp8_in_registers.cuh, fp8_dequant_ahead.cuh.
#pragma once

#include <cstdint>

#include "kernels/kv_fp8.h"
#include "kernels/sm80/cta.cuh"
#include "kernels/sm80/primitives.cuh"

namespace latentd::kernels::sm80 {
namespace detail {

// FP8 cache (kernels/kv_fp8.h): two e4m3 codes in bits 8-15 and 24-31 of y become two
// 16-bit values by moving their bits into place: x * 2^-120 as bf16, x * 2^-8 as fp16
// (subnormal codes included), exactly. One fma by 2^(e+120) (2^(e+8)) then applies the
// block scale 2^e, also exactly. So the kernel computes with the same 16-bit values the
// CPU implementation dequantizes to (DequantizeKvRowFp8).
template <DType kDType>
__device__ __forceinline__ uint32_t E4m3PairBits(uint32_t y) {
  if constexpr (kDType == DType::kBF16) {
    return (y & 0x80008000u) | ((y >> 4) & 0x07f007f0u);
  } else {
    return (y & 0x80008000u) | ((y >> 1) & 0x3f803f80u);
  }
}
// The block scale's multiplier as a pair of 16-bit values, from the float32 scale's bits.
template <DType kDType>
__device__ __forceinline__ uint32_t Fp8ScalePair(uint32_t scale_bits) {
  // Stored scales are 2^e with e in [Fp8MinExponent, 7]; the clamp only keeps rows no
  // sequence owns (zero-filled past the end) finite.
  const int e_biased = static_cast<int>((scale_bits >> 23) & 0xffu);  // e + 127
  uint32_t h;
  if constexpr (kDType == DType::kBF16) {
    h = static_cast<uint32_t>(min(max(e_biased, 127 - 119), 127 + kFp8MaxExponent) + 120) << 7;
  } else {
    h = static_cast<uint32_t>(min(max(e_biased, 127 - 22), 127 + kFp8MaxExponent) - 104) << 10;
  }
  return h | (h << 16);
}
template <DType kDType>
__device__ __forceinline__ uint32_t Fma2NegZero(uint32_t a, uint32_t b) {
  uint32_t r;
  if constexpr (kDType == DType::kBF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  }
  return r;
}
// The transpose of an 8x8 matrix of 16-bit values held in mma fragment order (lane l:
// row l / 4, columns 2 (l % 4) and +1), in the same order.
__device__ __forceinline__ uint32_t MovTrans(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}
// 16 e4m3 codes (one 16-byte chunk, one block) -> 16 values in two 16-byte chunks.
template <DType kDType>
__device__ __forceinline__ void DequantChunk(const uint4& raw, uint32_t scale_pair, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = Fma2NegZero<kDType>(E4m3PairBits<kDType>(__byte_perm(w[i], 0u, 0x1404)), scale_pair);
    o[2 * i + 1] = Fma2NegZero<kDType>(E4m3PairBits<kDType>(__byte_perm(w[i], 0u, 0x3424)), scale_pair);
  }
  lo = make_uint4(o[0], o[1], o[2], o[3]);
  hi = make_uint4(o[4], o[5], o[6], o[7]);
}

static_assert(kFp8ScaleOffset == 32 * 16 && kFp8RopeOffset == 33 * 16, "raw row: 32 latent chunks, scales, rope");

// One thread's share of a raw-row copy: kCta / kN threads per row of tile t (on `page`),
// thread c of a row taking the row's chunks c, c + kCta / kN, ... Keys past cta_end copy
// nothing (zero fill) from the cache's base, never from an unowned row.
template <class T>
struct Fp8RowCopy {
  static constexpr int kT = T::kCta / T::kN;  // threads per raw row
  static_assert(kT * T::kN == T::kCta, "whole threads per raw row");
  int key, c;
  bool valid;
  const uint8_t* src;  // chunk c of the key's raw row

  __device__ __forceinline__ Fp8RowCopy(const Cta<T>& cta, int t, int page) {
    const int key0 = cta.key_begin + t * T::kN;
    const int page_key0 = key0 & (kPageSize - 1);
    const auto* kv8 = static_cast<const uint8_t*>(cta.p->kv);
    key = cta.tid / kT;
    c = cta.tid % kT;
    valid = key0 + key < cta.cta_end;
    src = valid ? kv8 + int64_t(page) * cta.p->kv_page_stride + cta.kv_head_off +
                      int64_t(page_key0 + key) * cta.p->kv_row_stride + c * 16
                : kv8;
  }
};

}  // namespace detail
}  // namespace latentd::kernels::sm80
