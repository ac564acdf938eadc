// The FP8 KV cache format: e4m3 rounding and saturation, block exponents, whole rows
// (NaN and Inf must not poison a block's scale), and the CPU decoder over an fp8 cache
// against the double-precision reference, with the quantization error itself printed.
#include "kernels/kv_fp8.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

#include <gtest/gtest.h>

#include "kernels/cpu/half.h"
#include "kernels/cpu/mla_decode_cpu.h"
#include "kernels/testing/problem.h"

namespace latentd::kernels {
namespace {

TEST(Fp8E4m3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // the NaN codes are never produced
    const float v = E4m3ToFloat(uint8_t(c));
    if (c == 0x80) {
      EXPECT_EQ(FloatToE4m3(v), 0x80);  // -0 keeps its sign
      continue;
    }
    EXPECT_EQ(FloatToE4m3(v), c) << c << " " << v;
  }
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.f);
  EXPECT_EQ(E4m3ToFloat(0x01), std::ldexp(1.f, -9));
  EXPECT_EQ(E4m3ToFloat(0x08), std::ldexp(1.f, -6));
  EXPECT_EQ(E4m3ToFloat(0xb8), -1.f);
}

TEST(Fp8E4m3, RoundsToNearestEvenAndSaturates) {
  // Between 1 and 1.125 (codes 0x38, 0x39): the midpoint goes to the even code.
  EXPECT_EQ(FloatToE4m3(1.0625f), 0x38);
  EXPECT_EQ(FloatToE4m3(1.0626f), 0x39);
  EXPECT_EQ(FloatToE4m3(1.1875f), 0x3a);  // midpoint of 1.125 and 1.25: even is 1.25
  // Subnormals: steps of 2^-9, ties to even.
  EXPECT_EQ(FloatToE4m3(std::ldexp(1.f, -10)), 0x00);
  EXPECT_EQ(FloatToE4m3(std::ldexp(3.f, -10)), 0x02);
  EXPECT_EQ(FloatToE4m3(std::ldexp(15.f, -10)), 0x08);  // rounds up into the smallest normal
  EXPECT_EQ(FloatToE4m3(std::ldexp(1.f, -12)), 0x00);
  // A carry out of the mantissa moves into the exponent.
  EXPECT_EQ(FloatToE4m3(1.97f), 0x40);  // 2.0
  EXPECT_EQ(FloatToE4m3(447.f), 0x7e);
  EXPECT_EQ(FloatToE4m3(470.f), 0x7e);
  EXPECT_EQ(FloatToE4m3(1e30f), 0x7e);
  EXPECT_EQ(FloatToE4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(FloatToE4m3(std::numeric_limits<float>::quiet_NaN()), 0x00);
}

TEST(Fp8E4m3, BlockExponentIsTheSmallestThatFits) {
  EXPECT_EQ(Fp8BlockExponent(448.f, DType::kBF16), 0);
  EXPECT_EQ(Fp8BlockExponent(449.f, DType::kBF16), 1);
  EXPECT_EQ(Fp8BlockExponent(224.f, DType::kBF16), -1);
  EXPECT_EQ(Fp8BlockExponent(1.f, DType::kBF16), -8);
  EXPECT_EQ(Fp8BlockExponent(0.f, DType::kBF16), 0);
  EXPECT_EQ(Fp8BlockExponent(1e30f, DType::kBF16), kFp8MaxExponent);
  EXPECT_EQ(Fp8BlockExponent(1e-30f, DType::kBF16), -108);  // 1e-30 = 1.27 x 2^-100
  EXPECT_EQ(Fp8BlockExponent(1e-30f, DType::kFP16), Fp8MinExponent(DType::kFP16));
  for (float a = 1e-20f; a < 1e4f; a *= 1.37f) {
    const int e = Fp8BlockExponent(a, DType::kBF16);
    EXPECT_LE(a, 448.f * std::ldexp(1.f, e)) << a;
    EXPECT_GT(a, 448.f * std::ldexp(1.f, e - 1)) << a;
  }
}

TEST(Fp8Row, QuantizesWithinHalfAStepAndKeepsRope) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    std::vector<uint16_t> row(kHeadDimQK), back(kHeadDimQK);
    std::vector<uint8_t> q(kFp8RowBytes);
    for (int it = 0; it < 50; ++it) {
      for (auto& x : row) x = FloatToHalf(dt, normal(rng) * std::exp(2 * normal(rng)));
      QuantizeKvRowFp8(dt, row.data(), q.data());
      DequantizeKvRowFp8(dt, q.data(), back.data());
      for (int blk = 0; blk < kFp8Blocks; ++blk) {
        float scale;
        std::memcpy(&scale, q.data() + kFp8ScaleOffset + 4 * blk, 4);
        int ex = 0;
        EXPECT_EQ(std::frexp(scale, &ex), 0.5f) << "power of two";
        for (int i = 0; i < kFp8BlockValues; ++i) {
          const int d = blk * kFp8BlockValues + i;
          const float x = HalfToFloat(dt, row[d]), y = HalfToFloat(dt, back[d]);
          // Half an e4m3 step: 2^-4 relative for normals, 2^-10 x scale for subnormals.
          EXPECT_LE(std::abs(x - y), std::abs(x) / 16 + std::ldexp(scale, -10) + std::abs(x) / 256) << d;
        }
      }
      for (int d = kHeadDimV; d < kHeadDimQK; ++d) EXPECT_EQ(back[d], row[d]);
    }
  }
}

TEST(Fp8Row, NanAndInfDoNotPoisonTheBlock) {
  const DType dt = DType::kBF16;
  std::vector<uint16_t> row(kHeadDimQK, FloatToHalf(dt, 0.5f)), back(kHeadDimQK);
  row[3] = FloatToHalf(dt, std::numeric_limits<float>::quiet_NaN());
  row[130] = FloatToHalf(dt, std::numeric_limits<float>::infinity());
  row[260] = FloatToHalf(dt, -std::numeric_limits<float>::infinity());
  std::vector<uint8_t> q(kFp8RowBytes);
  QuantizeKvRowFp8(dt, row.data(), q.data());
  DequantizeKvRowFp8(dt, q.data(), back.data());
  EXPECT_EQ(HalfToFloat(dt, back[3]), 0.f);                 // NaN -> 0
  // +-inf -> +-448 x the block's scale (2^-9 for a largest finite magnitude of 0.5).
  EXPECT_EQ(HalfToFloat(dt, back[130]), 448.f / 512);
  EXPECT_EQ(HalfToFloat(dt, back[260]), -448.f / 512);
  for (int d : {0, 4, 129, 131, 259, 261, 511}) EXPECT_EQ(HalfToFloat(dt, back[d]), 0.5f) << d;
}

// A block with no nonzero finite value has nothing to scale by, so its exponent is 0
// (scale 1), not the dtype's lower bound: +inf beside zeros reads back as 448, not as
// 448 x 2^-119 (bf16) or 448 x 2^-22 (fp16). Both quantizers (this CPU one and the GPU
// scatter, engine/cuda/scatter_rows.cu) take amax over finite values and call
// Fp8BlockExponent, which this pins for amax = 0 too.
TEST(Fp8Row, BlockWithoutNonzeroFiniteValueHasExponentZero) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    EXPECT_EQ(Fp8BlockExponent(0.f, dt), 0);
    std::vector<uint16_t> row(kHeadDimQK, FloatToHalf(dt, 0.f)), back(kHeadDimQK);
    // Block 0: zeros and +inf, -inf; block 1: zeros only; block 2: zeros and NaN;
    // block 3: zeros, -0 and +inf.
    row[5] = FloatToHalf(dt, inf);
    row[6] = FloatToHalf(dt, -inf);
    row[2 * kFp8BlockValues + 7] = FloatToHalf(dt, nan);
    row[3 * kFp8BlockValues + 1] = FloatToHalf(dt, -0.f);
    row[3 * kFp8BlockValues + 127] = FloatToHalf(dt, inf);
    std::vector<uint8_t> q(kFp8RowBytes);
    QuantizeKvRowFp8(dt, row.data(), q.data());
    for (int blk = 0; blk < kFp8Blocks; ++blk) {
      float scale;
      std::memcpy(&scale, q.data() + kFp8ScaleOffset + 4 * blk, 4);
      EXPECT_EQ(scale, 1.f) << "block " << blk << " dtype " << static_cast<int>(dt);
    }
    DequantizeKvRowFp8(dt, q.data(), back.data());
    EXPECT_EQ(HalfToFloat(dt, back[5]), 448.f);
    EXPECT_EQ(HalfToFloat(dt, back[6]), -448.f);
    EXPECT_EQ(HalfToFloat(dt, back[3 * kFp8BlockValues + 127]), 448.f);
    EXPECT_EQ(HalfToFloat(dt, back[2 * kFp8BlockValues + 7]), 0.f);  // NaN -> 0
    for (int d = 0; d < kHeadDimV; ++d) {
      if (d == 5 || d == 6 || d == 3 * kFp8BlockValues + 127) continue;
      EXPECT_EQ(HalfToFloat(dt, back[d]), 0.f) << d;
    }
  }
}

// The CPU decoder over an fp8 cache against the reference that dequantizes the same
// bytes (same tolerance as a 16-bit cache), and the quantization error against the
// unquantized reference, printed for docs/fp8-kv-cache.md.
TEST(Fp8Decode, CpuMatchesReferenceOnTheSameBytes) {
  std::mt19937_64 rng(12);
  CpuMlaDecoder dec(2);
  dec.set_min_keys_per_split(64);
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    for (bool heavy : {false, true}) {
      for (int s_q : {1, 2}) {
        testing::ProblemShape s;
        s.dtype = dt;
        s.kv_dtype = KvDType::kFp8E4M3;
        s.heavy_tailed = heavy;
        s.s_q = s_q;
        s.causal = s_q > 1;
        s.batch = 5;
        s.h_q = 16;
        s.h_kv = heavy ? 2 : 1;
        s.seqlens = {0, 1, 64, 65, 300};
        auto pr = testing::MakeProblem(s, rng);
        ASSERT_TRUE(dec.Run(pr.Params()).ok());
        std::vector<double> ref_out, ref_lse, raw_out, raw_lse;
        testing::ReferenceDecode(pr, &ref_out, &ref_lse);
        auto c = testing::Compare(pr, pr.out, pr.lse, ref_out, ref_lse);
        EXPECT_TRUE(c.ok) << testing::Describe(s) << ": " << c.first_failure;
        testing::ReferenceDecode(pr, &raw_out, &raw_lse, /*unquantized=*/true);
        double max_abs = 0, num = 0, den = 0;
        for (size_t i = 0; i < raw_out.size(); ++i) {
          max_abs = std::max(max_abs, std::abs(ref_out[i] - raw_out[i]));
          num += (ref_out[i] - raw_out[i]) * (ref_out[i] - raw_out[i]);
          den += raw_out[i] * raw_out[i];
        }
        std::printf("quantization error %s: out max abs %.3g, relative rms %.3g\n", testing::Describe(s).c_str(),
                    max_abs, std::sqrt(num / std::max(den, 1e-300)));
      }
    }
  }
}

}  // namespace
}  // namespace latentd::kernels
