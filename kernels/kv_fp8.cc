// Host-side whole-row quantization and dequantization of the FP8 KV cache format
// (kernels/kv_fp8.h), built from the same element functions the device code uses.
#include "kernels/kv_fp8.h"

#include <cmath>

#include "kernels/cpu/half.h"

namespace latentd::kernels {

void QuantizeKvRowFp8(DType dtype, const uint16_t* src, uint8_t* dst) {
  for (int blk = 0; blk < kFp8Blocks; ++blk) {
    const uint16_t* s = src + blk * kFp8BlockValues;
    float amax = 0.f;
    for (int i = 0; i < kFp8BlockValues; ++i) {
      const float a = std::fabs(HalfToFloat(dtype, s[i]));
      if (a <= 3.4028235e38f && a > amax) amax = a;  // finite values only
    }
    const int e = Fp8BlockExponent(amax, dtype);
    const float inv = Fp8Pow2(-e);  // exact: e is within [-119, 7]
    for (int i = 0; i < kFp8BlockValues; ++i)
      dst[blk * kFp8BlockValues + i] = FloatToE4m3(HalfToFloat(dtype, s[i]) * inv);
    const float scale = Fp8Pow2(e);
    std::memcpy(dst + kFp8ScaleOffset + 4 * blk, &scale, 4);
  }
  std::memcpy(dst + kFp8RopeOffset, src + kHeadDimV, (kHeadDimQK - kHeadDimV) * 2);
}

void DequantizeKvRowFp8(DType dtype, const uint8_t* src, uint16_t* dst) {
  for (int blk = 0; blk < kFp8Blocks; ++blk) {
    float scale;
    std::memcpy(&scale, src + kFp8ScaleOffset + 4 * blk, 4);
    for (int i = 0; i < kFp8BlockValues; ++i) {
      const int d = blk * kFp8BlockValues + i;
      dst[d] = FloatToHalf(dtype, E4m3ToFloat(src[d]) * scale);  // the product is exact in float
    }
  }
  std::memcpy(dst + kHeadDimV, src + kFp8RopeOffset, (kHeadDimQK - kHeadDimV) * 2);
}

}  // namespace latentd::kernels
