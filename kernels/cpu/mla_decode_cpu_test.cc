// The CPU implementation against a naive double-precision reference on random shapes,
// covering every edge case the kernel must handle.
#include "kernels/cpu/mla_decode_cpu.h"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "kernels/cpu/half.h"
#include "kernels/testing/problem.h"

namespace latentd::kernels {
namespace {

using testing::Compare;
using testing::MakeProblem;
using testing::ProblemShape;

void CheckShape(const ProblemShape& shape, CpuMlaDecoder& dec, std::mt19937_64& rng) {
  auto pr = MakeProblem(shape, rng);
  ASSERT_TRUE(dec.Run(pr.Params()).ok()) << testing::Describe(shape);
  std::vector<double> ref_out, ref_lse;
  testing::ReferenceDecode(pr, &ref_out, &ref_lse);
  auto c = Compare(pr, pr.out, pr.lse, ref_out, ref_lse);
  EXPECT_TRUE(c.ok) << testing::Describe(shape) << ": " << c.first_failure;
}

TEST(HalfConversion, RoundTripsAndRounds) {
  for (float f : {0.f, 1.f, -2.5f, 65504.f, 1e-5f, 6e-8f, 3.14159f}) {
    EXPECT_NEAR(Fp16ToFloat(FloatToFp16(f)), f, std::abs(f) * 1e-3 + 6e-8) << f;
    EXPECT_NEAR(Bf16ToFloat(FloatToBf16(f)), f, std::abs(f) * 8e-3) << f;
  }
  EXPECT_EQ(FloatToFp16(1e6f), 0x7c00);  // overflow to inf
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(NAN))));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
  EXPECT_EQ(FloatToBf16(1.0f + 1.0f / 256), FloatToBf16(1.0f));  // tie rounds to even
  // Every fp16 bit pattern survives a round trip through float.
  for (uint32_t h = 0; h < 0x7c00; ++h) ASSERT_EQ(FloatToFp16(Fp16ToFloat(uint16_t(h))), h) << h;
}

TEST(CpuMlaDecode, EdgeCases) {
  std::mt19937_64 rng(1);
  CpuMlaDecoder dec(2);
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    for (bool causal : {false, true}) {
      for (int s_q : {1, 2, 4}) {
        ProblemShape s;
        s.dtype = dt;
        s.causal = causal;
        s.s_q = s_q;
        s.batch = 7;
        s.h_q = 16;
        s.seqlens = {0, 1, 2, 63, 64, 65, 140};  // 0 keys, fewer keys than queries, page edges
        CheckShape(s, dec, rng);
      }
    }
  }
}

TEST(CpuMlaDecode, HeadGroupings) {
  std::mt19937_64 rng(2);
  CpuMlaDecoder dec(2);
  const int heads[][2] = {{1, 1}, {16, 1}, {32, 2}, {6, 3}, {128, 1}, {16, 8}};
  for (const auto& hk : heads) {
    ProblemShape s;
    s.batch = 2;
    s.h_q = hk[0];
    s.h_kv = hk[1];
    s.s_q = 2;
    s.causal = true;
    s.seqlens = {100, 37};
    CheckShape(s, dec, rng);
  }
}

// Scores that keep rising along the sequence (the running max moves block after block).
TEST(CpuMlaDecode, RisingScores) {
  std::mt19937_64 rng(5);
  CpuMlaDecoder dec(2);
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    ProblemShape s;
    s.dtype = dt;
    s.batch = 3;
    s.h_q = 128;
    s.s_q = 2;
    s.causal = true;
    s.rising_keys = true;
    s.seqlens = {0, 65, 300};
    CheckShape(s, dec, rng);
  }
}

TEST(CpuMlaDecode, SplitKMatchesReference) {
  std::mt19937_64 rng(3);
  CpuMlaDecoder dec(2);
  dec.set_min_keys_per_split(64);  // force several partitions even for short sequences
  for (bool causal : {false, true}) {
    ProblemShape s;
    s.batch = 1;
    s.h_q = 16;
    s.s_q = 3;
    s.causal = causal;
    s.seqlens = {1000};
    CheckShape(s, dec, rng);
    s.seqlens = {2};  // fewer keys than a split: one partition sees nothing for some rows
    CheckShape(s, dec, rng);
  }
}

TEST(CpuMlaDecode, RandomShapes) {
  std::mt19937_64 rng(4);
  CpuMlaDecoder dec(0);
  std::uniform_int_distribution<int> len(0, 700);
  for (int trial = 0; trial < 12; ++trial) {
    ProblemShape s;
    s.dtype = trial % 2 ? DType::kFP16 : DType::kBF16;
    s.batch = 1 + trial % 4;
    s.h_kv = 1 + trial % 2;
    s.h_q = s.h_kv * (1 << (trial % 5));
    s.s_q = 1 + trial % 3;
    s.causal = trial % 3 == 0;
    for (int b = 0; b < s.batch; ++b) s.seqlens.push_back(len(rng));
    CheckShape(s, dec, rng);
  }
}

// The portable variant of the inner loops (hosts without AVX2/FMA) computes the same.
TEST(CpuMlaDecode, PortableCodeMatchesReference) {
  CpuMlaDecoder::ForceGenericCodeForTesting(true);
  EXPECT_FALSE(CpuMlaDecoder::UsesAvx2());
  std::mt19937_64 rng(8);
  CpuMlaDecoder dec(2);
  dec.set_min_keys_per_split(64);
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    ProblemShape s;
    s.dtype = dt;
    s.batch = 3;
    s.h_q = 6;
    s.s_q = 2;
    s.causal = true;
    s.seqlens = {0, 70, 300};
    CheckShape(s, dec, rng);
  }
  CpuMlaDecoder::ForceGenericCodeForTesting(false);
}

TEST(CpuMlaDecode, StridedViews) {
  // q and out as views into wider buffers: the decoder must honour the strides.
  std::mt19937_64 rng(5);
  ProblemShape s;
  s.batch = 3;
  s.h_q = 8;
  s.seqlens = {70, 0, 129};
  auto pr = MakeProblem(s, rng);
  auto p = pr.Params();
  const int pad = 64;
  std::vector<uint16_t> wide_q(size_t(s.batch) * s.h_q * (kHeadDimQK + pad), 0xffff);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.h_q; ++h)
      std::copy_n(pr.q.data() + (size_t(b) * s.h_q + h) * kHeadDimQK, kHeadDimQK,
                  wide_q.data() + (size_t(b) * s.h_q + h) * (kHeadDimQK + pad));
  std::vector<uint16_t> wide_out(size_t(s.batch) * s.h_q * (kHeadDimV + pad), 0x7fff);
  p.q = wide_q.data();
  p.q_head_stride = kHeadDimQK + pad;
  p.q_seq_stride = p.q_batch_stride = int64_t(s.h_q) * (kHeadDimQK + pad);
  p.out = wide_out.data();
  p.out_head_stride = kHeadDimV + pad;
  p.out_seq_stride = p.out_batch_stride = int64_t(s.h_q) * (kHeadDimV + pad);
  CpuMlaDecoder dec(2);
  ASSERT_TRUE(dec.Run(p).ok());
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.h_q; ++h)
      std::copy_n(wide_out.data() + (size_t(b) * s.h_q + h) * (kHeadDimV + pad), kHeadDimV,
                  pr.out.data() + (size_t(b) * s.h_q + h) * kHeadDimV);
  std::vector<double> ref_out, ref_lse;
  testing::ReferenceDecode(pr, &ref_out, &ref_lse);
  auto c = Compare(pr, pr.out, pr.lse, ref_out, ref_lse);
  EXPECT_TRUE(c.ok) << c.first_failure;
  // Padding between rows is untouched.
  EXPECT_EQ(wide_out[kHeadDimV], 0x7fff);
}

TEST(CpuMlaDecode, RejectsBadInput) {
  std::mt19937_64 rng(6);
  ProblemShape s;
  s.batch = 2;
  s.seqlens = {64, 10};
  auto pr = MakeProblem(s, rng);
  CpuMlaDecoder dec(1);
  auto p = pr.Params();
  p.h_q = 15;
  p.h_kv = 2;
  auto st = dec.Run(p);
  EXPECT_EQ(st.code, Code::kInvalidArgument);
  EXPECT_NE(st.message.find("h_q"), std::string::npos) << st.message;

  p = pr.Params();
  pr.block_table[0] = pr.num_pages;  // out of range page
  st = dec.Run(p);
  EXPECT_EQ(st.code, Code::kInvalidArgument);
  EXPECT_NE(st.message.find("block_table[0][0]"), std::string::npos) << st.message;

  pr.block_table[0] = 0;
  p = pr.Params();
  pr.seqlens[1] = 65;  // more keys than the block table row holds (1 page)
  st = dec.Run(p);
  EXPECT_EQ(st.code, Code::kInvalidArgument);
  EXPECT_NE(st.message.find("seqlens[1]"), std::string::npos) << st.message;
}

}  // namespace
}  // namespace latentd::kernels
