// The host KvStorage: the [L * pages, 64, h_kv, 576] layout, row writes and reads,
// whole-page copies across layers, argument errors, and the fp8 format's quantizing
// writes.
#include "engine/kv/storage.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cpu/half.h"
#include "kernels/kv_fp8.h"

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

// LATENTD_KV_POISON: 1 fills a new pool with 0xff, uninit leaves a device pool unwritten
// (a host pool zeroed), anything else zeroes it.
TEST(HostKvStorage, PoisonFromTheEnvironment) {
  KvCacheConfig c{1, 1, 2};
  const char* before = std::getenv("LATENTD_KV_POISON");
  const std::string saved = before != nullptr ? before : "";
  ASSERT_EQ(setenv("LATENTD_KV_POISON", "1", 1), 0);
  EXPECT_EQ(PoolFillByte(), std::optional<uint8_t>(0xff));
  {
    auto s = MakeHostKvStorage(c);
    ASSERT_TRUE(s.ok()) << s.status();
    const auto* base = static_cast<const unsigned char*>((*s)->base());
    for (int64_t i = 0; i < c.total_bytes(); ++i) ASSERT_EQ(base[i], 0xff) << i;
  }
  ASSERT_EQ(setenv("LATENTD_KV_POISON", "uninit", 1), 0);
  EXPECT_EQ(PoolFillByte(), std::nullopt);
  {
    auto s = MakeHostKvStorage(c);
    ASSERT_TRUE(s.ok()) << s.status();
    const char* base = static_cast<const char*>((*s)->base());
    for (int64_t i = 0; i < c.total_bytes(); ++i) ASSERT_EQ(base[i], 0) << i;
  }
  ASSERT_EQ(setenv("LATENTD_KV_POISON", "0", 1), 0);
  EXPECT_EQ(PoolFillByte(), std::optional<uint8_t>(0));
  ASSERT_EQ(unsetenv("LATENTD_KV_POISON"), 0);
  EXPECT_EQ(PoolFillByte(), std::optional<uint8_t>(0));
  if (before != nullptr) setenv("LATENTD_KV_POISON", saved.c_str(), 1);
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

// n tokens' rows of 16-bit values as a client sends them: normal-ish values with a few
// outliers, zeros, and (when `specials`) NaN and infinities.
std::vector<uint16_t> InputRows(const KvCacheConfig& c, int n, uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> v(static_cast<size_t>(n * c.input_row_bytes() / 2));
  for (size_t i = 0; i < v.size(); ++i) {
    float x = normal(rng) * (i % 97 == 0 ? 300.f : 1.f);
    if (i % 131 == 5) x = 0.f;
    if (specials && i % 211 == 7) x = std::numeric_limits<float>::quiet_NaN();
    if (specials && i % 223 == 11) x = (i & 1) ? -INFINITY : INFINITY;
    v[i] = kernels::FloatToHalf(c.dtype, x);
  }
  return v;
}

std::vector<uint8_t> Quantized(const KvCacheConfig& c, const std::vector<uint16_t>& in) {
  std::vector<uint8_t> out(in.size() / kHeadDim * kernels::kFp8RowBytes);
  for (size_t r = 0; r < in.size() / kHeadDim; ++r)
    kernels::QuantizeKvRowFp8(c.dtype, in.data() + r * kHeadDim, out.data() + r * kernels::kFp8RowBytes);
  return out;
}

TEST(HostKvStorage, Fp8WritesQuantizedRowsAndReadsStoredBytes) {
  for (kernels::DType dtype : {kernels::DType::kBF16, kernels::DType::kFP16}) {
    auto c = KvCacheConfig::FromPages(2, 2, 3, 2, kernels::KvDType::kFp8E4M3, dtype);
    ASSERT_TRUE(c.ok()) << c.status();
    auto s = MakeHostKvStorage(*c);
    ASSERT_TRUE(s.ok()) << s.status();
    KvStorage& st = **s;
    const auto in = InputRows(*c, 7, 3 + static_cast<int>(dtype), /*specials=*/true);
    const auto want = Quantized(*c, in);
    ASSERT_EQ(static_cast<int64_t>(want.size()), 7 * c->row_bytes());
    ASSERT_TRUE(st.WriteRows(1, 2, 30, 7, in.data()).ok());
    std::vector<uint8_t> back(want.size());
    ASSERT_TRUE(st.ReadRows(1, 2, 30, 7, back.data()).ok());
    EXPECT_EQ(back, want) << kernels::DTypeName(dtype);
    // At the documented place of the tensor, and nothing written around it.
    const auto* base = static_cast<const uint8_t*>(st.base());
    EXPECT_EQ(std::memcmp(base + c->RowOffset(1, 2, 30), want.data(), want.size()), 0);
    EXPECT_EQ(base[c->RowOffset(1, 2, 30) - 1], 0);
    EXPECT_EQ(base[c->RowOffset(1, 2, 37)], 0);
    // Dequantized, the rows are close to what was sent where it was finite.
    std::vector<uint16_t> deq(kHeadDim);
    for (int r = 0; r < 7 * 2; ++r) {
      kernels::DequantizeKvRowFp8(dtype, back.data() + r * kernels::kFp8RowBytes, deq.data());
      for (int d = kernels::kHeadDimV; d < kHeadDim; ++d) ASSERT_EQ(deq[d], in[r * kHeadDim + d]) << "rope " << d;
    }
  }
}

// An import's rows: stored bytes written unchanged (no second quantization), and the
// same argument checks as WriteRows.
TEST(HostKvStorage, WriteStoredRowsCopiesStoredBytesUnchanged) {
  auto c = KvCacheConfig::FromPages(2, 1, 3, 2, kernels::KvDType::kFp8E4M3, kernels::DType::kBF16);
  ASSERT_TRUE(c.ok()) << c.status();
  auto s = MakeHostKvStorage(*c);
  ASSERT_TRUE(s.ok()) << s.status();
  KvStorage& st = **s;
  const auto in = InputRows(*c, 5, 11, /*specials=*/true);
  ASSERT_TRUE(st.WriteRows(0, 0, 3, 5, in.data()).ok());
  std::vector<uint8_t> stored(5 * c->row_bytes());
  ASSERT_TRUE(st.ReadRows(0, 0, 3, 5, stored.data()).ok());
  ASSERT_TRUE(st.WriteStoredRows(1, 2, 60, 4, stored.data()).ok());
  std::vector<uint8_t> back(4 * c->row_bytes());
  ASSERT_TRUE(st.ReadRows(1, 2, 60, 4, back.data()).ok());
  EXPECT_TRUE(std::equal(back.begin(), back.end(), stored.begin()));
  EXPECT_FALSE(st.WriteStoredRows(1, 2, 61, 4, stored.data()).ok());  // past the page
  EXPECT_FALSE(st.WriteStoredRows(2, 0, 0, 1, stored.data()).ok());   // no layer 2
  EXPECT_FALSE(st.WriteStoredRows(0, 0, 0, 1, nullptr).ok());
}

TEST(HostKvStorage, Fp8CopyPageCopiesStoredPages) {
  auto c = KvCacheConfig::FromPages(3, 1, 4, 2, kernels::KvDType::kFp8E4M3, kernels::DType::kBF16);
  ASSERT_TRUE(c.ok());
  auto s = MakeHostKvStorage(*c);
  ASSERT_TRUE(s.ok());
  KvStorage& st = **s;
  std::vector<std::vector<uint8_t>> want;
  for (int layer = 0; layer < 3; ++layer) {
    const auto in = InputRows(*c, 64, 100 + layer, false);
    want.push_back(Quantized(*c, in));
    ASSERT_TRUE(st.WriteRows(layer, 1, 0, 64, in.data()).ok());
  }
  ASSERT_TRUE(st.CopyPage(1, 3).ok());
  for (int layer = 0; layer < 3; ++layer) {
    std::vector<uint8_t> back(64 * c->row_bytes());
    ASSERT_TRUE(st.ReadRows(layer, 3, 0, 64, back.data()).ok());
    EXPECT_EQ(back, want[layer]) << layer;
    ASSERT_TRUE(st.ReadRows(layer, 2, 0, 64, back.data()).ok());
    EXPECT_EQ(back, std::vector<uint8_t>(back.size(), 0)) << layer;
  }
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
