// The FP8 KV cache format: per token and KV head, 512 latent values in e4m3 with one
// power-of-two float32 scale per 128 of them, and the 64 rope values kept in the model's
// 16-bit dtype: 656 bytes instead of 1152. Plain C++; the element functions compile for
// host and device so the CPU backend, the CUDA scatter kernel and the oracle quantize
// and dequantize bit-identically (docs/fp8-kv-cache.md).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/params.h"

#if defined(__CUDACC__)
#define LATENTD_HD __host__ __device__ __forceinline__
#else
#define LATENTD_HD inline
#endif

namespace latentd::kernels {

// Row layout, bytes: [0, 512) e4m3 latent values, [512, 528) four float32 scales (value
// d uses scale d / 128), [528, 656) 64 rope values in the model dtype. 41 16-byte chunks.
inline constexpr int kFp8RowBytes = 656;
inline constexpr int kFp8ScaleOffset = 512;
inline constexpr int kFp8RopeOffset = 528;
inline constexpr int kFp8BlockValues = 128;
inline constexpr int kFp8Blocks = kHeadDimV / kFp8BlockValues;  // 4

// Bytes one KV head's row takes in the cache.
inline int KvRowBytes(DType dtype, KvDType kv_dtype) {
  return kv_dtype == KvDType::kFp8E4M3 ? kFp8RowBytes : kHeadDimQK * DTypeBytes(dtype);
}

// A block's scale is 2^e. e4m3 is a floating-point format, so a power of two costs no
// relative precision against amax / 448 (at most one binade of headroom at the bottom),
// and in return dequantization is exact: e4m3 x 2^e is representable in bf16 and fp16,
// and the kernel applies it with one multiply per pair of values. e is bounded so that
// 2^e times the kernel's bit-level decoding (which yields x * 2^-120 for bf16, x * 2^-8
// for fp16) stays a normal number: bf16 [-119, 7], fp16 [-22, 7]. Blocks whose largest
// magnitude exceeds 448 * 2^7 = 57344 saturate to it.
inline constexpr int kFp8MaxExponent = 7;
LATENTD_HD int Fp8MinExponent(DType dtype) { return dtype == DType::kBF16 ? -119 : -22; }

LATENTD_HD uint32_t Fp8FloatBits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}
LATENTD_HD float Fp8BitsFloat(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}

// Round to nearest even, saturating at +-448; NaN becomes +0 (so one bad value cannot
// turn into the e4m3 NaN code), +-inf becomes +-448.
LATENTD_HD uint8_t FloatToE4m3(float y) {
  const uint32_t bits = Fp8FloatBits(y);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return 0;                    // NaN
  if (a >= 0x43e00000u) return sign | 0x7eu;        // >= 448, inf included
  const uint32_t exp = a >> 23, mant = a & 0x7fffffu;
  if (a < 0x3c800000u) {  // below 2^-6: subnormal e4m3, steps of 2^-9
    if (exp == 0) return sign;
    const uint32_t m = mant | 0x800000u;  // a = m * 2^(exp - 150); q = rne(m * 2^(exp - 141))
    const uint32_t s = 141u - exp;        // >= 21
    if (s >= 25) return sign;             // below half a step
    const uint32_t keep = m >> s, rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
    const uint32_t q = keep + ((rem > half || (rem == half && (keep & 1u))) ? 1u : 0u);
    return sign | static_cast<uint8_t>(q);  // q == 8 is the smallest normal's code
  }
  const uint32_t keep = mant >> 20, rem = mant & 0xfffffu;
  const uint32_t up = (rem > 0x80000u || (rem == 0x80000u && (keep & 1u))) ? 1u : 0u;
  uint32_t code = ((exp - 120u) << 3) + keep + up;  // a carry moves into the exponent
  if (code > 0x7eu) code = 0x7eu;
  return sign | static_cast<uint8_t>(code);
}

// Exact value of an e4m3 code.
LATENTD_HD float E4m3ToFloat(uint8_t c) {
  const uint32_t exp = (c >> 3) & 15u, m = c & 7u;
  // m * 2^-9, or (8 + m) * 2^(exp - 10), built from float bits.
  float v;
  if (exp == 0) {
    v = static_cast<float>(m) * Fp8BitsFloat(118u << 23);  // 2^-9
  } else {
    v = Fp8BitsFloat(((exp + 120u) << 23) | (m << 20));
  }
  return (c & 0x80u) ? -v : v;
}

// The block exponent e for the largest finite magnitude `amax` of a block: the smallest
// e with amax <= 448 * 2^e, clamped to the dtype's range; 0 where amax is 0 (a block
// with no nonzero finite value: zeros only, or zeros beside NaN or +-inf), which gives
// nothing to scale by, so +-inf there quantizes to +-448 x 2^0.
LATENTD_HD int Fp8BlockExponent(float amax, DType dtype) {
  const int lo = Fp8MinExponent(dtype);
  if (!(amax > 0.f)) return 0;
  const uint32_t bits = Fp8FloatBits(amax);
  const int exp = static_cast<int>(bits >> 23);
  if (exp == 0) return lo;  // float subnormal
  const int u = exp - 127;
  int e = (bits & 0x7fffffu) <= 0x600000u ? u - 8 : u - 7;  // 448 = 1.75 * 2^8
  if (e < lo) e = lo;
  if (e > kFp8MaxExponent) e = kFp8MaxExponent;
  return e;
}

LATENTD_HD float Fp8Pow2(int e) { return Fp8BitsFloat(static_cast<uint32_t>(e + 127) << 23); }

// Whole rows, host side (the CPU backend, the storage's uploads and the oracle).
// src: 576 values in `dtype`; dst: kFp8RowBytes bytes.
void QuantizeKvRowFp8(DType dtype, const uint16_t* src, uint8_t* dst);
// The 576 16-bit values every kernel path computes with: e4m3 x scale rounded to `dtype`
// (exact within the exponent bounds above), rope values as stored.
void DequantizeKvRowFp8(DType dtype, const uint8_t* src, uint16_t* dst);

}  // namespace latentd::kernels
