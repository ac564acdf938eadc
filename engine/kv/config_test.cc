// KvCacheConfig: byte sizes, the storage page mapping and every sizing path's errors.
#include "engine/kv/config.h"

#include <limits>

#include <gtest/gtest.h>

namespace latentd::engine::kv {
namespace {

TEST(KvCacheConfig, Sizes) {
  KvCacheConfig c{/*num_layers=*/3, /*num_heads_kv=*/2, /*num_pages=*/10};
  EXPECT_EQ(c.row_bytes(), 2 * 576 * 2);
  EXPECT_EQ(c.layer_page_bytes(), 64 * 2 * 576 * 2);
  EXPECT_EQ(c.page_bytes(), 3 * c.layer_page_bytes());
  EXPECT_EQ(c.total_bytes(), 10 * c.page_bytes());
  EXPECT_EQ(c.physical_pages(), 30);
  EXPECT_EQ(c.PageOffset(2), 20);
  EXPECT_EQ(c.PhysicalPage(1, 7), 17);
  EXPECT_TRUE(c.Validate().ok());
}

TEST(KvCacheConfig, Fp8Sizes) {
  KvCacheConfig c{3, 2, 10, 2, kernels::KvDType::kFp8E4M3, kernels::DType::kBF16};
  EXPECT_EQ(c.row_bytes(), 2 * 656);
  EXPECT_EQ(c.input_row_bytes(), 2 * 576 * 2);
  EXPECT_EQ(c.token_bytes(), 3 * 2 * 656);
  EXPECT_EQ(c.layer_page_bytes(), 64 * 2 * 656);
  EXPECT_EQ(c.page_bytes(), 3 * c.layer_page_bytes());
  EXPECT_EQ(c.RowOffset(1, 2, 5), (10 + 2) * c.layer_page_bytes() + 5 * 2 * 656);
  EXPECT_TRUE(c.Validate().ok());
  // Rows stay 16-byte aligned for the kernel's vector loads.
  EXPECT_EQ(c.row_bytes() % 16, 0);

  KvCacheConfig model = c;
  model.kv_dtype = kernels::KvDType::kModel;
  EXPECT_EQ(model.row_bytes(), model.input_row_bytes());
  EXPECT_FALSE(SamePool(model, c));
  EXPECT_TRUE(SamePool(c, c));

  KvCacheConfig bad = c;
  bad.bytes_per_value = 4;
  absl::Status st = bad.Validate();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message().rfind("bytes_per_value", 0), 0u) << st;
  bad = c;
  bad.kv_dtype = static_cast<kernels::KvDType>(7);
  EXPECT_EQ(bad.Validate().message().rfind("kv_dtype", 0), 0u) << bad.Validate();
}

// The point of the format: the same bytes hold 1152 / 656 = 1.76x the tokens.
TEST(KvCacheConfig, Fp8HoldsAtLeast1Point7TimesTheTokensPerGiB) {
  constexpr int64_t kGiB = int64_t{1} << 30;
  for (int heads : {1, 2, 8}) {
    auto bf16 = KvCacheConfig::FromBudget(61, heads, 64 * kGiB);
    auto fp8 = KvCacheConfig::FromBudget(61, heads, 64 * kGiB, 2, kernels::KvDType::kFp8E4M3,
                                         kernels::DType::kBF16);
    ASSERT_TRUE(bf16.ok()) << bf16.status();
    ASSERT_TRUE(fp8.ok()) << fp8.status();
    const double tokens_bf16 = double(bf16->num_pages) * kPageSize;
    const double tokens_fp8 = double(fp8->num_pages) * kPageSize;
    EXPECT_GE(tokens_fp8, 1.7 * tokens_bf16) << heads;
    EXPECT_LE(fp8->total_bytes(), 64 * kGiB);
    EXPECT_EQ(fp8->kv_dtype, kernels::KvDType::kFp8E4M3);
  }
  auto pages = KvCacheConfig::FromPages(4, 1, 100, 2, kernels::KvDType::kFp8E4M3, kernels::DType::kFP16);
  ASSERT_TRUE(pages.ok()) << pages.status();
  EXPECT_EQ(pages->dtype, kernels::DType::kFP16);
  EXPECT_EQ(pages->row_bytes(), 656);
  auto frac = KvCacheConfig::FromMemoryFraction(1, 1, 1000 * 64 * 656, 0.5, 2,
                                                kernels::KvDType::kFp8E4M3);
  ASSERT_TRUE(frac.ok()) << frac.status();
  EXPECT_EQ(frac->num_pages, 500);
  // A budget under one fp8 page names the format.
  auto none = KvCacheConfig::FromBudget(1, 1, 64 * 656 - 1, 2, kernels::KvDType::kFp8E4M3);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("fp8_e4m3"), std::string::npos) << none.status();
}

TEST(KvCacheConfig, PagesForTokens) {
  EXPECT_EQ(PagesForTokens(0), 0);
  EXPECT_EQ(PagesForTokens(1), 1);
  EXPECT_EQ(PagesForTokens(64), 1);
  EXPECT_EQ(PagesForTokens(65), 2);
}

TEST(KvCacheConfig, FromPages) {
  auto c = KvCacheConfig::FromPages(4, 1, 100);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_pages, 100);
  EXPECT_EQ(c->bytes_per_value, 2);
}

TEST(KvCacheConfig, RejectsBadFields) {
  struct Case {
    int layers, heads;
    int64_t pages;
    int bpv;
    const char* field;
  };
  for (const Case& c : {Case{0, 1, 1, 2, "num_layers"}, Case{-1, 1, 1, 2, "num_layers"},
                        Case{1, 0, 1, 2, "num_heads_kv"}, Case{1, 2000, 1, 2, "num_heads_kv"},
                        Case{1, 1, 0, 2, "num_pages"}, Case{1, 1, 1, 3, "bytes_per_value"},
                        Case{2, 1, int64_t{1} << 30, 2, "num_pages"}}) {
    auto r = KvCacheConfig::FromPages(c.layers, c.heads, c.pages, c.bpv);
    ASSERT_FALSE(r.ok()) << c.field;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message().rfind(c.field, 0), 0u) << r.status();
  }
}

TEST(KvCacheConfig, FromBudget) {
  KvCacheConfig shape{2, 1, 0};
  auto c = KvCacheConfig::FromBudget(2, 1, 5 * shape.page_bytes() + shape.page_bytes() - 1);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_pages, 5);  // rounds down
  EXPECT_LE(c->total_bytes(), 6 * shape.page_bytes() - 1);

  auto none = KvCacheConfig::FromBudget(2, 1, shape.page_bytes() - 1);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(none.status().message().rfind("kv_bytes", 0), 0u) << none.status();
  EXPECT_FALSE(KvCacheConfig::FromBudget(2, 1, -5).ok());
  EXPECT_FALSE(KvCacheConfig::FromBudget(0, 1, int64_t{1} << 40).ok());

  // A huge budget is capped at what int32 page ids address.
  auto capped = KvCacheConfig::FromBudget(1, 1, std::numeric_limits<int64_t>::max());
  ASSERT_TRUE(capped.ok()) << capped.status();
  EXPECT_EQ(capped->num_pages, std::numeric_limits<int32_t>::max());
  EXPECT_TRUE(capped->Validate().ok());
}

TEST(KvCacheConfig, FromMemoryFraction) {
  KvCacheConfig shape{1, 1, 0};
  auto c = KvCacheConfig::FromMemoryFraction(1, 1, 100 * shape.page_bytes(), 0.5);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_pages, 50);
  for (double bad : {0.0, -0.1, 1.5}) {
    auto r = KvCacheConfig::FromMemoryFraction(1, 1, 100 * shape.page_bytes(), bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().message().rfind("kv_memory_fraction", 0), 0u) << r.status();
  }
  EXPECT_FALSE(KvCacheConfig::FromMemoryFraction(1, 1, -1, 0.5).ok());
  EXPECT_FALSE(KvCacheConfig::FromMemoryFraction(1, 1, shape.page_bytes(), 0.5).ok());
}

}  // namespace
}  // namespace latentd::engine::kv
