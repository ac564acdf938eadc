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
