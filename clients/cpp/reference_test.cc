// Reference::Diagnose: a result computed over the rows with one row zeroed, one left out
// or one page zeroed, or merged without one split-K partition, is traced back to that
// row, page or key range with a remainder near the output's rounding; the correct result
// leaves nothing out of tolerance.
#include "clients/cpp/reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>

#include "kernels/cpu/half.h"
#include "kernels/params.h"

namespace latentd::client {
namespace {

constexpr int kHq = 16;
constexpr int64_t kEnd = 200;  // four pages, the last partly filled
constexpr int64_t kRow = kernels::kHeadDimQK * 2;  // bytes per row, h_kv 1

v1::ServerInfo Info() {
  v1::ServerInfo info;
  info.set_dtype(v1::BF16);
  info.set_num_heads_q(kHq);
  info.set_num_heads_kv(1);
  info.set_num_layers(1);
  info.set_softmax_scale(static_cast<float>(1.0 / std::sqrt(192.0)));
  return info;
}

class DiagnoseTest : public ::testing::Test {
 protected:
  DiagnoseTest() : ref_(Info(), 1), rng_(7) {
    rows_ = RandomHalves(rng_, kEnd * kRow / 2, kernels::DType::kBF16);
    q_ = RandomHalves(rng_, kHq * kernels::kHeadDimQK, kernels::DType::kBF16);
    ref_.Append("real", 0, rows_);
  }

  // The output of a decode over `rows` (whatever they are) for the real query.
  std::string OutputOver(const std::string& rows) {
    const std::string id = "variant" + std::to_string(variants_++);
    ref_.Append(id, 0, rows);
    std::string out, lse;
    EXPECT_TRUE(ref_.Expected(id, 0, static_cast<int64_t>(rows.size() / kRow), q_, 1, true, &out, &lse).ok());
    return out;
  }

  Reference::Diagnosis Diagnose(const std::string& got) {
    auto d = ref_.Diagnose("real", 0, kEnd, q_, 1, true, got);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? *d : Reference::Diagnosis{};
  }

  Reference ref_;
  std::mt19937_64 rng_;
  std::string rows_, q_;
  int variants_ = 0;
};

TEST_F(DiagnoseTest, CorrectResultHasNothingOutOfTolerance) {
  const Reference::Diagnosis d = Diagnose(OutputOver(rows_));
  EXPECT_EQ(d.off, 0);
  EXPECT_EQ(d.not_finite, 0);
  EXPECT_LT(d.max_error, 8e-4);  // the tolerance's floor
  EXPECT_EQ(d.values, kHq * kernels::kHeadDimV);
}

TEST_F(DiagnoseTest, NamesTheRowReadAsZeros) {
  for (int64_t k : {int64_t{0}, int64_t{137}, kEnd - 1}) {
    std::string rows = rows_;
    std::fill(rows.begin() + k * kRow, rows.begin() + (k + 1) * kRow, '\0');
    const std::string got = OutputOver(rows);
    const Reference::Diagnosis d = Diagnose(got);
    EXPECT_EQ(d.zeroed_row, k);
    // What is left is the output's rounding (an ulp of bf16 at ~0.1: 4.9e-4), below the
    // tolerance's floor and far below what the result is off by.
    EXPECT_LT(d.zeroed_row_error, 8e-4) << d.ToString(kEnd, 1);
    EXPECT_GT(d.max_error, 5 * d.zeroed_row_error) << d.ToString(kEnd, 1);
  }
  std::string rows = rows_;
  std::fill(rows.begin() + (kEnd - 1) * kRow, rows.end(), '\0');
  EXPECT_NE(Diagnose(OutputOver(rows)).ToString(kEnd, 1).find("key row 199 (page 3 row 7, a row of this step) read "
                                                              "as zeros"),
            std::string::npos);
}

// A merge that took one 64-column chunk of one row from another call's partials: the
// diagnosis names that (token, head) alone and the chunk's dims, not the whole row.
TEST_F(DiagnoseTest, NamesTheColumnChunkOfAnOffRow) {
  std::string got = OutputOver(rows_);
  const std::string other = OutputOver(RandomHalves(rng_, kEnd * kRow / 2, kernels::DType::kBF16));
  constexpr int kHead = 3, kFirst = 128, kCols = 64;
  const size_t at = (size_t(kHead) * kernels::kHeadDimV + kFirst) * 2;
  got.replace(at, kCols * 2, other, at, kCols * 2);
  const Reference::Diagnosis d = Diagnose(got);
  ASSERT_EQ(d.off_heads.size(), 1u);
  EXPECT_EQ(d.off_heads[0], std::make_pair(0, kHead));
  ASSERT_EQ(d.off_dims.size(), 1u);
  EXPECT_GT(d.off_dims[0].values, kCols / 2);  // two random outputs rarely agree within tolerance
  EXPECT_LE(d.off_dims[0].values, kCols);
  EXPECT_GE(d.off_dims[0].first, kFirst);
  EXPECT_LE(d.off_dims[0].last, kFirst + kCols - 1);
  EXPECT_GE(d.off_dims[0].last - d.off_dims[0].first + 1, d.off_dims[0].values);
  EXPECT_NE(d.ToString(kEnd, 1).find(" in dims "), std::string::npos) << d.ToString(kEnd, 1);
}

TEST_F(DiagnoseTest, NamesTheRowLeftOut) {
  const int64_t k = 64;  // the first row of page 1
  std::string rows = rows_.substr(0, k * kRow) + rows_.substr((k + 1) * kRow);
  const Reference::Diagnosis d = Diagnose(OutputOver(rows));
  EXPECT_EQ(d.missing_row, k);
  EXPECT_LT(d.missing_row_error, 8e-4) << d.ToString(kEnd, 1);
}

TEST_F(DiagnoseTest, NamesTheRowCountedTwice) {
  const int64_t k = 31;
  std::string rows = rows_.substr(0, (k + 1) * kRow) + rows_.substr(k * kRow);
  const Reference::Diagnosis d = Diagnose(OutputOver(rows));
  EXPECT_EQ(d.doubled_row, k);
  EXPECT_LT(d.doubled_row_error, 8e-4) << d.ToString(kEnd, 1);
}

TEST_F(DiagnoseTest, NamesOneZeroKeyTooMany) {
  const Reference::Diagnosis d = Diagnose(OutputOver(rows_ + std::string(kRow, '\0')));
  EXPECT_LT(d.extra_zero_key_error, 8e-4) << d.ToString(kEnd, 1);
  EXPECT_GT(d.max_error, 2 * d.extra_zero_key_error) << d.ToString(kEnd, 1);
}

TEST_F(DiagnoseTest, NamesThePageReadAsZeros) {
  std::string rows = rows_;
  std::fill(rows.begin() + 128 * kRow, rows.begin() + 192 * kRow, '\0');
  const Reference::Diagnosis d = Diagnose(OutputOver(rows));
  EXPECT_GT(d.off, 0);
  EXPECT_EQ(d.zeroed_page, 2);
  EXPECT_LT(d.zeroed_page_error, 8e-4) << d.ToString(kEnd, 1);
}

// Two query tokens, causal: the step's last row is seen by its second token only, and
// the diagnosis keeps the first token's view without it.
TEST_F(DiagnoseTest, CausalStepsSeeOnlyTheirOwnKeys) {
  const std::string q2 = RandomHalves(rng_, 2 * kHq * kernels::kHeadDimQK, kernels::DType::kBF16);
  std::string rows = rows_;
  std::fill(rows.end() - kRow, rows.end(), '\0');
  ref_.Append("causal", 0, rows);
  std::string got, lse;
  ASSERT_TRUE(ref_.Expected("causal", 0, kEnd, q2, 2, true, &got, &lse).ok());
  auto d = ref_.Diagnose("real", 0, kEnd, q2, 2, true, got);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->zeroed_row, kEnd - 1);
  EXPECT_LT(d->zeroed_row_error, 8e-4) << d->ToString(kEnd, 2);
  EXPECT_FALSE(d->off_heads.empty()) << d->ToString(kEnd, 2);
  for (const auto& [token, head] : d->off_heads) EXPECT_EQ(token, 1) << "token 0 does not see the last row";
}

TEST_F(DiagnoseTest, CountsNotFiniteValues) {
  std::string got = OutputOver(rows_);
  got[2 * 600] = '\xff';  // value 600 (head 1): 0xffff, a NaN in bf16
  got[2 * 600 + 1] = '\xff';
  const Reference::Diagnosis d = Diagnose(got);
  EXPECT_EQ(d.not_finite, 1);
  ASSERT_EQ(d.off_heads.size(), 1u);
  EXPECT_EQ(d.off_heads[0], std::make_pair(0, 1));
  EXPECT_NE(d.ToString(kEnd, 1).find("not finite"), std::string::npos);
}

// A split-K merge that lost partition [64, 128) (64-key partitions) in one row (head 3):
// that head is the output over the other keys, renormalised; the others are right.
TEST_F(DiagnoseTest, NamesThePartitionLeftOutOfTheMerge) {
  std::string got = OutputOver(rows_);
  const std::string without = OutputOver(rows_.substr(0, 64 * kRow) + rows_.substr(128 * kRow));
  const size_t head = 2 * kernels::kHeadDimV;  // bytes per head of out
  got.replace(3 * head, head, without, 3 * head, head);
  const Reference::Diagnosis d = Diagnose(got);
  ASSERT_EQ(d.off_heads.size(), 1u) << d.ToString(kEnd, 1);
  EXPECT_EQ(d.range_left_out.begin, 64) << d.ToString(kEnd, 1);
  EXPECT_EQ(d.range_left_out.end, 128) << d.ToString(kEnd, 1);
  EXPECT_EQ(d.range_left_out.rows, 1);
  EXPECT_LT(d.range_left_out.error, 8e-4) << d.ToString(kEnd, 1);
  EXPECT_GT(d.max_error, 5 * d.range_left_out.error) << d.ToString(kEnd, 1);
  EXPECT_NE(d.ToString(kEnd, 1).find("keys [64, 128) left out of the split-K merge in 1 (token, head) rows"),
            std::string::npos)
      << d.ToString(kEnd, 1);
}

// A merge that read partition [96, 128)'s output before its stores were visible (zeros)
// but its lse after: heads 5 and 9 are out_all - out_range * exp(lse_range - lse_all).
TEST_F(DiagnoseTest, NamesThePartitionWhoseValuesWereLost) {
  std::string all, all_lse, part, part_lse;
  ASSERT_TRUE(ref_.Expected("real", 0, kEnd, q_, 1, true, &all, &all_lse).ok());
  ref_.Append("range", 0, rows_.substr(96 * kRow, 32 * kRow));
  ASSERT_TRUE(ref_.Expected("range", 0, 32, q_, 1, true, &part, &part_lse).ok());
  const auto dt = kernels::DType::kBF16;
  auto* g = reinterpret_cast<uint16_t*>(all.data());
  const auto* pr = reinterpret_cast<const uint16_t*>(part.data());
  const auto* la = reinterpret_cast<const float*>(all_lse.data());
  const auto* lr = reinterpret_cast<const float*>(part_lse.data());
  for (int h : {5, 9}) {
    const double f = std::exp(double(lr[h]) - la[h]);
    for (int d = 0; d < kernels::kHeadDimV; ++d) {
      uint16_t& v = g[h * kernels::kHeadDimV + d];
      v = kernels::FloatToHalf(dt, float(kernels::HalfToFloat(dt, v) -
                                         f * kernels::HalfToFloat(dt, pr[h * kernels::kHeadDimV + d])));
    }
  }
  const Reference::Diagnosis d = Diagnose(all);
  ASSERT_EQ(d.off_heads.size(), 2u) << d.ToString(kEnd, 1);
  EXPECT_EQ(d.range_values_lost.begin, 96) << d.ToString(kEnd, 1);
  EXPECT_EQ(d.range_values_lost.end, 128) << d.ToString(kEnd, 1);
  EXPECT_EQ(d.range_values_lost.rows, 2);
  // Three bf16 roundings (two outputs and the difference) stay near one ulp.
  EXPECT_LT(d.range_values_lost.error, 1e-3) << d.ToString(kEnd, 1);
  EXPECT_GT(d.max_error, 5 * d.range_values_lost.error) << d.ToString(kEnd, 1);
}

TEST_F(DiagnoseTest, RefusesWhatDoesNotFit) {
  EXPECT_FALSE(ref_.Diagnose("real", 0, kEnd, q_, 1, true, "short").ok());
  EXPECT_FALSE(ref_.Diagnose("real", 0, kEnd + 1, q_, 1, true, std::string(kHq * 1024, '\0')).ok());
  EXPECT_FALSE(ref_.Diagnose("nobody", 0, kEnd, q_, 1, true, std::string(kHq * 1024, '\0')).ok());
}

}  // namespace
}  // namespace latentd::client
