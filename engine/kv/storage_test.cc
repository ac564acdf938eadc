// The host KvStorage: the [L * pages, 64, h_kv, 576] layout, row writes and reads,
// whole-page copies across layers, and argument errors.
#include "engine/kv/storage.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

namespace latentd::engine::kv {
namespace {

std::vector<char> Rows(const KvCacheConfig& c, int n, char seed) {
  std::vector<char> v(n * c.row_bytes());
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<char>(seed + i * 7);
  return v;
}

TEST(HostKvStorage, StartsZeroedWithTheDocumentedLayout) {
  KvCacheConfig c{2, 2, 3};
  auto s = MakeHostKvStorage(c);
  ASSERT_TRUE(s.ok()) << s.status();
  KvStorage& st = **s;
  EXPECT_EQ(st.config().num_pages, 3);
  const char* base = static_cast<const char*>(st.base());
  for (int64_t i = 0; i < c.total_bytes(); ++i) ASSERT_EQ(base[i], 0) << i;

  auto rows = Rows(c, 2, 5);
  ASSERT_TRUE(st.WriteRows(1, 2, 10, 2, rows.data()).ok());
  // Storage page of (layer 1, logical page 2) is 1 * 3 + 2 = 5.
  const char* at = base + 5 * c.layer_page_bytes() + 10 * c.row_bytes();
  EXPECT_EQ(std::memcmp(at, rows.data(), rows.size()), 0);

  std::vector<char> back(rows.size());
  ASSERT_TRUE(st.ReadRows(1, 2, 10, 2, back.data()).ok());
  EXPECT_EQ(back, rows);
  EXPECT_TRUE(st.Synchronize().ok());
}

TEST(HostKvStorage, CopyPageCopiesEveryLayerAndNothingElse) {
  KvCacheConfig c{3, 1, 4};
  auto s = MakeHostKvStorage(c);
  ASSERT_TRUE(s.ok());
  KvStorage& st = **s;
  for (int layer = 0; layer < 3; ++layer) {
    auto rows = Rows(c, 64, static_cast<char>(layer * 31 + 1));
    ASSERT_TRUE(st.WriteRows(layer, 1, 0, 64, rows.data()).ok());
  }
  ASSERT_TRUE(st.CopyPage(1, 3).ok());
  for (int layer = 0; layer < 3; ++layer) {
    std::vector<char> back(64 * c.row_bytes());
    ASSERT_TRUE(st.ReadRows(layer, 3, 0, 64, back.data()).ok());
    EXPECT_EQ(back, Rows(c, 64, static_cast<char>(layer * 31 + 1))) << layer;
    ASSERT_TRUE(st.ReadRows(layer, 2, 0, 64, back.data()).ok());
    EXPECT_EQ(back, std::vector<char>(back.size(), 0)) << layer;
  }
  EXPECT_TRUE(st.CopyPage(2, 2).ok());
}

TEST(HostKvStorage, RejectsBadArguments) {
  KvCacheConfig c{2, 1, 4};
  auto s = MakeHostKvStorage(c);
  ASSERT_TRUE(s.ok());
  KvStorage& st = **s;
  auto rows = Rows(c, 64, 1);
  struct Case {
    int layer, page, row, n;
    const char* field;
  };
  for (const Case& k : {Case{-1, 0, 0, 1, "layer"}, Case{2, 0, 0, 1, "layer"},
                        Case{0, -1, 0, 1, "page"}, Case{0, 4, 0, 1, "page"},
                        Case{0, 0, -1, 1, "row"}, Case{0, 0, 64, 1, "row"},
                        Case{0, 0, 60, 5, "n"}, Case{0, 0, 0, -1, "n"}}) {
    absl::Status w = st.WriteRows(k.layer, k.page, k.row, k.n, rows.data());
    EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument) << k.field;
    EXPECT_EQ(w.message().rfind(k.field, 0), 0u) << w;
    absl::Status r = st.ReadRows(k.layer, k.page, k.row, k.n, rows.data());
    EXPECT_EQ(r.code(), absl::StatusCode::kInvalidArgument) << k.field;
  }
  EXPECT_EQ(st.WriteRows(0, 0, 0, 1, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(st.WriteRows(0, 0, 0, 0, nullptr).ok());  // nothing to copy
  EXPECT_EQ(st.CopyPage(-1, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.CopyPage(0, 4).code(), absl::StatusCode::kInvalidArgument);
}

TEST(HostKvStorage, RejectsInvalidConfig) {
  auto s = MakeHostKvStorage(KvCacheConfig{0, 1, 1});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PhysicalMemoryBytes, IsPositive) {
  auto b = PhysicalMemoryBytes();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_GT(*b, 0);
}

}  // namespace
}  // namespace latentd::engine::kv
