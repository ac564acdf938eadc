// KvCacheManager, one operation at a time: ids, appends (direct and reserved), forks with
// copy-on-write, release, truncation, capacity figures, idle listing, and every error.
#include "engine/kv/manager.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace latentd::engine::kv {
namespace {

constexpr int kLayers = 3;

// Row contents are a function of a tag, so any row can be checked without a copy kept.
std::vector<char> Rows(const KvCacheConfig& c, int n, uint32_t first_tag) {
  std::vector<char> v(n * c.row_bytes());
  for (int r = 0; r < n; ++r) {
    for (int64_t b = 0; b < c.row_bytes(); b += 4) {
      uint32_t word = (first_tag + r) * 2654435761u + static_cast<uint32_t>(b);
      std::memcpy(&v[r * c.row_bytes() + b], &word, 4);
    }
  }
  return v;
}

bool StartsWith(const absl::Status& s, absl::string_view prefix) {
  return absl::string_view(s.message()).substr(0, prefix.size()) == prefix;
}

class ManagerTest : public ::testing::Test {
 protected:
  void SetUp() override { Reset(8); }

  void Reset(int64_t pages) {
    mgr_.reset();
    config_ = KvCacheConfig{kLayers, 1, pages};
    auto st = MakeHostKvStorage(config_);
    ASSERT_TRUE(st.ok()) << st.status();
    storage_ = *std::move(st);
    mgr_ = std::make_unique<KvCacheManager>(config_, storage_.get());
  }

  Sequence* Create(absl::string_view id) {
    auto s = mgr_->CreateSequence(id);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : nullptr;
  }

  // Appends n rows tagged from `tag` to `layer`.
  absl::Status Append(Sequence* seq, int layer, int n, uint32_t tag) {
    auto rows = Rows(config_, n, tag);
    return mgr_->Append(seq, layer, rows.data(), n);
  }

  // Appends the same tagged rows to every layer.
  void AppendAll(Sequence* seq, int n, uint32_t tag) {
    for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(Append(seq, l, n, tag).ok());
  }

  // Row `token` of `layer` as stored for `seq`.
  std::vector<char> ReadRow(const Sequence* seq, int layer, int64_t token) {
    std::vector<char> row(config_.row_bytes());
    int32_t page = mgr_->BlockTable(seq)[token / kPageSize];
    EXPECT_TRUE(storage_->ReadRows(layer, page, token % kPageSize, 1, row.data()).ok());
    return row;
  }

  void ExpectRows(const Sequence* seq, int layer, int64_t from, int n, uint32_t tag) {
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(ReadRow(seq, layer, from + i), Rows(config_, 1, tag + i))
          << "layer " << layer << " token " << from + i;
    }
  }

  void ExpectConsistent() { ASSERT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency(); }

  KvCacheConfig config_;
  std::unique_ptr<KvStorage> storage_;
  std::unique_ptr<KvCacheManager> mgr_;
};

// An import: every page reserved at the start and invisible until the commit, rows
// written as stored, keys published at the commit; aborting or a taken id leaves the
// pool as it was.
TEST_F(ManagerTest, ImportReservesUpFrontAndAppearsOnlyAtCommit) {
  Sequence* src = Create("src");
  AppendAll(src, 100, 500);
  std::vector<char> stored(100 * config_.row_bytes());
  ASSERT_TRUE(mgr_->ReadStoredRows(src, 1, 0, 100, stored.data()).ok());
  EXPECT_FALSE(mgr_->ReadStoredRows(src, 1, 50, 51, stored.data()).ok());  // past the length

  const int64_t free_before = mgr_->free_pages();
  auto full = mgr_->BeginImport(std::vector<int64_t>(kLayers, 7 * kPageSize));
  EXPECT_TRUE(absl::IsResourceExhausted(full.status())) << full.status();
  EXPECT_EQ(mgr_->free_pages(), free_before);
  EXPECT_TRUE(absl::IsInvalidArgument(mgr_->BeginImport({1}).status()));

  auto pending = mgr_->BeginImport(std::vector<int64_t>(kLayers, 100));
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(mgr_->free_pages(), free_before - 2);
  EXPECT_EQ(mgr_->num_sequences(), 1);
  EXPECT_EQ(mgr_->pending_imports(), 1);
  ExpectConsistent();
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(mgr_->ReadStoredRows(src, l, 0, 100, stored.data()).ok());
    ASSERT_TRUE(mgr_->WriteImportRows(*pending, l, 0, 60, stored.data()).ok());
    ASSERT_TRUE(mgr_->WriteImportRows(*pending, l, 60, 40, stored.data() + 60 * config_.row_bytes()).ok());
  }
  EXPECT_FALSE(mgr_->WriteImportRows(*pending, 0, 99, 2, stored.data()).ok());
  // A taken id keeps it pending.
  EXPECT_TRUE(absl::IsAlreadyExists(mgr_->CommitImport(*pending, "src", {}).status()));
  EXPECT_EQ(mgr_->pending_imports(), 1);
  auto seq = mgr_->CommitImport(*pending, "copy", {PageKey{1, 2}});
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(mgr_->pending_imports(), 0);
  EXPECT_EQ(mgr_->Find("copy"), *seq);
  for (int l = 0; l < kLayers; ++l) ExpectRows(*seq, l, 0, 100, 500);
  EXPECT_TRUE(mgr_->Keyed(mgr_->BlockTable(*seq)[0]));
  EXPECT_FALSE(mgr_->Keyed(mgr_->BlockTable(*seq)[1]));
  EXPECT_EQ(mgr_->PublishedKeys(*seq).size(), 1u);
  ExpectConsistent();

  auto dropped = mgr_->BeginImport(std::vector<int64_t>(kLayers, 70));
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  mgr_->AbortImport(*dropped);
  EXPECT_EQ(mgr_->free_pages(), free_before - 2);
  EXPECT_EQ(mgr_->pending_imports(), 0);
  ExpectConsistent();
}

// An import with page keys attaches the leading pages the prefix cache holds (live or
// cached) by reference, skips their rows, and refuses mismatched keys at the commit.
TEST_F(ManagerTest, ImportAttachesCachedPrefixPages) {
  const std::vector<PageKey> keys = {{1, 1}, {2, 2}, {3, 3}};
  auto owner = mgr_->CreateSequence("owner", {keys[0], keys[1]});
  ASSERT_TRUE(owner.ok());
  AppendAll(*owner, 2 * kPageSize, 100);  // publishes keys 0 and 1
  std::vector<char> stored(3 * kPageSize * config_.row_bytes());
  ASSERT_TRUE(mgr_->ReadStoredRows(*owner, 0, 0, 2 * kPageSize, stored.data()).ok());
  ASSERT_TRUE(mgr_->Release("owner").ok());  // its two pages stay cached
  EXPECT_EQ(mgr_->GetStats().cached_pages, 2);
  const int64_t free_before = mgr_->free_pages();

  EXPECT_TRUE(absl::IsInvalidArgument(mgr_->BeginImport(std::vector<int64_t>(kLayers, 100), keys).status()))
      << "3 keys for 1 full page";
  auto pending = mgr_->BeginImport(std::vector<int64_t>(kLayers, 3 * kPageSize + 5), keys);
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ(mgr_->PrefixTokens(*pending), 2 * kPageSize);
  EXPECT_EQ(mgr_->free_pages(), free_before - 4);  // 2 cached pages attached, 2 fresh
  EXPECT_EQ(mgr_->GetStats().cached_pages, 0);
  // Rows for the attached pages are skipped: writing others there changes nothing.
  auto junk = Rows(config_, 3 * kPageSize + 5, 900);
  for (int l = 0; l < kLayers; ++l)
    ASSERT_TRUE(mgr_->WriteImportRows(*pending, l, 0, 3 * kPageSize + 5, junk.data()).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(mgr_->CommitImport(*pending, "copy", {keys[1]}).status()));
  auto seq = mgr_->CommitImport(*pending, "copy", keys);
  ASSERT_TRUE(seq.ok()) << seq.status();
  for (int l = 0; l < kLayers; ++l) {
    ExpectRows(*seq, l, 0, 2 * kPageSize, 100);
    ExpectRows(*seq, l, 2 * kPageSize, kPageSize + 5, 900 + 2 * kPageSize);
  }
  EXPECT_EQ(mgr_->PublishedKeys(*seq).size(), 3u);
  ExpectConsistent();
  // A second import shares all three pages with the first (live now).
  auto second = mgr_->BeginImport(std::vector<int64_t>(kLayers, 3 * kPageSize), keys);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(mgr_->PrefixTokens(*second), 3 * kPageSize);
  mgr_->AbortImport(*second);
  EXPECT_EQ(mgr_->RefCount(mgr_->BlockTable(*seq)[0]), 1);
  ExpectConsistent();
  // Aborting an attaching import puts cached pages back in the cache.
  ASSERT_TRUE(mgr_->Release("copy").ok());
  const int64_t cached = mgr_->GetStats().cached_pages;
  auto third = mgr_->BeginImport(std::vector<int64_t>(kLayers, 2 * kPageSize), {keys[0], keys[1]});
  ASSERT_TRUE(third.ok());
  mgr_->AbortImport(*third);
  EXPECT_EQ(mgr_->GetStats().cached_pages, cached);
  ExpectConsistent();
}

TEST_F(ManagerTest, CreateWithClientId) {
  Sequence* s = Create("beam-1:a.b_c");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(mgr_->Id(s), "beam-1:a.b_c");
  EXPECT_EQ(mgr_->Find("beam-1:a.b_c"), s);
  EXPECT_EQ(mgr_->PagesOf(s), 0);
  EXPECT_TRUE(mgr_->BlockTable(s).empty());
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(mgr_->Length(s, l), 0);
  EXPECT_EQ(mgr_->GetStats().sequences, 1);
  ExpectConsistent();
}

TEST_F(ManagerTest, GeneratedIdsAreLongRandomHexAndDistinct) {
  std::set<std::string> ids;
  for (int i = 0; i < 200; ++i) {
    Sequence* s = Create("");
    ASSERT_NE(s, nullptr);
    const std::string& id = mgr_->Id(s);
    EXPECT_EQ(id.size(), 32u);
    EXPECT_EQ(id.find_first_not_of("0123456789abcdef"), std::string::npos) << id;
    EXPECT_EQ(mgr_->Find(id), s);
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), 200u);
}

TEST_F(ManagerTest, TakenIdIsAlreadyExists) {
  Create("x");
  auto again = mgr_->CreateSequence("x");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(StartsWith(again.status(), "sequence_id: ")) << again.status();
  EXPECT_EQ(mgr_->GetStats().sequences, 1);
}

TEST_F(ManagerTest, MalformedIdsAreInvalid) {
  const std::string too_long(kMaxSequenceIdLength + 1, 'a');
  for (absl::string_view bad : {absl::string_view("a b"), absl::string_view("a/b"),
                                absl::string_view("\n"), absl::string_view("caf\xc3\xa9"),
                                absl::string_view("a\0b", 3), absl::string_view(too_long)}) {
    auto s = mgr_->CreateSequence(bad);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(StartsWith(s.status(), "sequence_id: ")) << s.status();
    // The message escapes and shortens what it echoes.
    EXPECT_EQ(s.status().message().find('\n'), std::string::npos);
    EXPECT_LT(s.status().message().size(), 250u);
  }
  EXPECT_TRUE(mgr_->CreateSequence(std::string(kMaxSequenceIdLength, 'a')).ok());
  EXPECT_TRUE(ValidateSequenceId("Az09._:-").ok());
  EXPECT_EQ(mgr_->GetStats().sequences, 1);
}

TEST_F(ManagerTest, FindUnknownIsNull) {
  EXPECT_EQ(mgr_->Find("nope"), nullptr);
  const KvCacheManager& cm = *mgr_;
  EXPECT_EQ(cm.Find("nope"), nullptr);
}

TEST_F(ManagerTest, AppendFillsPagesAndReadsBack) {
  Sequence* s = Create("s");
  ASSERT_TRUE(Append(s, 0, 100, 1000).ok());  // two pages, both allocated for all layers
  EXPECT_EQ(mgr_->Length(s, 0), 100);
  EXPECT_EQ(mgr_->Length(s, 1), 0);
  EXPECT_EQ(mgr_->PagesOf(s), 2);
  EXPECT_EQ(mgr_->BlockTable(s), (std::vector<int32_t>{0, 1}));
  ExpectRows(s, 0, 0, 100, 1000);

  // Layer 1 catches up inside the pages layer 0 already holds: no new page.
  ASSERT_TRUE(Append(s, 1, 70, 2000).ok());
  EXPECT_EQ(mgr_->PagesOf(s), 2);
  ExpectRows(s, 1, 0, 70, 2000);
  ExpectRows(s, 0, 0, 100, 1000);

  // Small appends across a page edge.
  ASSERT_TRUE(Append(s, 0, 28, 1100).ok());
  ASSERT_TRUE(Append(s, 0, 1, 1128).ok());
  EXPECT_EQ(mgr_->Length(s, 0), 129);
  EXPECT_EQ(mgr_->PagesOf(s), 3);
  ExpectRows(s, 0, 0, 129, 1000);
  EXPECT_EQ(mgr_->Lengths(s), (std::vector<int64_t>{129, 70, 0}));
  ExpectConsistent();
}

TEST_F(ManagerTest, AppendErrors) {
  Sequence* s = Create("s");
  auto rows = Rows(config_, 1, 0);
  absl::Status st = mgr_->Append(s, -1, rows.data(), 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(StartsWith(st, "layer: ")) << st;
  st = mgr_->Append(s, kLayers, rows.data(), 1);
  EXPECT_TRUE(StartsWith(st, "layer: ")) << st;
  for (int n : {0, -3}) {
    st = mgr_->Append(s, 0, rows.data(), n);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(StartsWith(st, "n: ")) << st;
  }
  // More than the whole cache could ever hold: a bad request, not a full cache.
  std::vector<char> big((8 * 64 + 1) * config_.row_bytes());
  st = mgr_->Append(s, 0, big.data(), 8 * 64 + 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(StartsWith(st, "n: ")) << st;
  st = mgr_->Append(s, 0, nullptr, 1);
  EXPECT_TRUE(StartsWith(st, "rows: ")) << st;
  st = mgr_->Append(nullptr, 0, rows.data(), 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mgr_->Length(s, 0), 0);
  EXPECT_EQ(mgr_->GetStats().free_pages, 8);
  // Exactly the whole cache is fine.
  EXPECT_TRUE(mgr_->Append(s, 0, big.data(), 8 * 64).ok());
  EXPECT_EQ(mgr_->GetStats().free_pages, 0);
  ExpectConsistent();
}

TEST_F(ManagerTest, AppendWithoutStorageIsFailedPrecondition) {
  KvCacheManager bare(config_, nullptr);
  auto s = bare.CreateSequence("s");
  ASSERT_TRUE(s.ok());
  auto rows = Rows(config_, 1, 0);
  EXPECT_EQ(bare.Append(*s, 0, rows.data(), 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(bare.CheckConsistency().ok());
}

TEST_F(ManagerTest, OutOfPagesChangesNothing) {
  Sequence* a = Create("a");
  Sequence* b = Create("b");
  AppendAll(a, 64 * 5 + 10, 1);  // 6 pages
  ASSERT_TRUE(Append(b, 0, 60, 5000).ok());  // 1 page, 1 free left
  ASSERT_EQ(mgr_->GetStats().free_pages, 1);

  const auto table = mgr_->BlockTable(b);
  const auto lengths = mgr_->Lengths(b);
  const auto bytes = std::vector<char>(static_cast<char*>(storage_->base()),
                                       static_cast<char*>(storage_->base()) +
                                           config_.total_bytes());
  std::vector<int32_t> refs;
  for (int p = 0; p < 8; ++p) refs.push_back(mgr_->RefCount(p));

  // Needs 2 more pages (rows 60..189), 1 free.
  absl::Status st = Append(b, 0, 130, 7000);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(st.message(), "kv cache: out of pages: need 2, free 1");

  AppendSlot slots[KvCacheManager::MaxAppendSlots(130)];
  int num_slots = -1;
  st = mgr_->ReserveAppend(b, 0, 130, slots, &num_slots);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(num_slots, -1);

  EXPECT_EQ(mgr_->BlockTable(b), table);
  EXPECT_EQ(mgr_->Lengths(b), lengths);
  EXPECT_EQ(mgr_->GetStats().free_pages, 1);
  for (int p = 0; p < 8; ++p) EXPECT_EQ(mgr_->RefCount(p), refs[p]) << p;
  EXPECT_EQ(std::memcmp(storage_->base(), bytes.data(), bytes.size()), 0);
  ExpectConsistent();

  // What does fit still works.
  EXPECT_TRUE(Append(b, 0, 68, 7000).ok());
  EXPECT_EQ(mgr_->GetStats().free_pages, 0);
  ExpectRows(b, 0, 0, 60, 5000);
  ExpectRows(b, 0, 60, 68, 7000);
}

TEST_F(ManagerTest, ReserveAppendReturnsRunsInOrder) {
  Sequence* s = Create("s");
  AppendSlot slots[KvCacheManager::MaxAppendSlots(200)];
  int num = 0;
  ASSERT_TRUE(mgr_->ReserveAppend(s, 1, 10, slots, &num).ok());
  ASSERT_EQ(num, 1);
  EXPECT_EQ(slots[0].page, mgr_->BlockTable(s)[0]);
  EXPECT_EQ(slots[0].row, 0);
  EXPECT_EQ(slots[0].n, 10);
  EXPECT_EQ(mgr_->Length(s, 1), 10);

  // 10 + 200 = rows 10..209: 54 in page 0, 64 in page 1, 64 in page 2, 18 in page 3.
  ASSERT_TRUE(mgr_->ReserveAppend(s, 1, 200, slots, &num).ok());
  ASSERT_EQ(num, 4);
  EXPECT_LE(num, KvCacheManager::MaxAppendSlots(200));
  const auto& table = mgr_->BlockTable(s);
  ASSERT_EQ(table.size(), 4u);
  const int want_row[] = {10, 0, 0, 0}, want_n[] = {54, 64, 64, 18};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(slots[i].page, table[i]) << i;
    EXPECT_EQ(slots[i].row, want_row[i]) << i;
    EXPECT_EQ(slots[i].n, want_n[i]) << i;
  }
  EXPECT_EQ(mgr_->Length(s, 1), 210);
  EXPECT_EQ(mgr_->Length(s, 0), 0);
  ExpectConsistent();

  // Errors match Append's.
  EXPECT_TRUE(StartsWith(mgr_->ReserveAppend(s, 3, 1, slots, &num), "layer: "));
  EXPECT_TRUE(StartsWith(mgr_->ReserveAppend(s, 0, 0, slots, &num), "n: "));
  EXPECT_TRUE(StartsWith(mgr_->ReserveAppend(s, 0, 1, nullptr, &num), "slots: "));
  EXPECT_TRUE(StartsWith(mgr_->ReserveAppend(s, 0, 1, slots, nullptr), "slots: "));
}

TEST(MaxAppendSlots, IsTight) {
  EXPECT_EQ(KvCacheManager::MaxAppendSlots(1), 1);
  EXPECT_EQ(KvCacheManager::MaxAppendSlots(2), 2);
  EXPECT_EQ(KvCacheManager::MaxAppendSlots(64), 2);
  EXPECT_EQ(KvCacheManager::MaxAppendSlots(65), 2);
  EXPECT_EQ(KvCacheManager::MaxAppendSlots(66), 3);
  EXPECT_EQ(KvCacheManager::MaxAppendSlots(130), 4);
  EXPECT_EQ(KvCacheManager::MaxAppendSlots(193), 4);
  EXPECT_EQ(KvCacheManager::MaxAppendSlots(194), 5);
  for (int n = 1; n < 1000; ++n) {
    EXPECT_LE(KvCacheManager::MaxAppendSlots(n), (n + 63) / 64 + 1) << n;
  }
}

TEST_F(ManagerTest, MaxAppendSlotsBoundsEveryAlignment) {
  Sequence* s = Create("s");
  AppendSlot slots[KvCacheManager::MaxAppendSlots(130)];
  for (int start = 0; start < 64; ++start) {
    for (int n : {1, 2, 63, 64, 65, 66, 128, 130}) {
      mgr_->TruncateLayer(s, 0, 0);
      int num = 0;
      if (start > 0) {
        ASSERT_TRUE(mgr_->ReserveAppend(s, 0, start, slots, &num).ok());
      }
      ASSERT_TRUE(mgr_->ReserveAppend(s, 0, n, slots, &num).ok());
      EXPECT_LE(num, KvCacheManager::MaxAppendSlots(n)) << start << " " << n;
      // Starting on a page's last row is the worst case, and reaches the bound.
      if (start == 63) {
        EXPECT_EQ(num, KvCacheManager::MaxAppendSlots(n)) << n;
      }
      int total = 0;
      for (int i = 0; i < num; ++i) total += slots[i].n;
      EXPECT_EQ(total, n);
      EXPECT_EQ(slots[0].row, start);
    }
  }
  ExpectConsistent();
}

TEST_F(ManagerTest, TruncateLayerUndoesAReservation) {
  Sequence* s = Create("s");
  AppendAll(s, 60, 1);
  ASSERT_EQ(mgr_->GetStats().free_pages, 7);
  AppendSlot slots[KvCacheManager::MaxAppendSlots(8)];
  int num = 0;
  ASSERT_TRUE(mgr_->ReserveAppend(s, 2, 8, slots, &num).ok());  // crosses into page 1
  EXPECT_EQ(num, 2);
  EXPECT_EQ(mgr_->GetStats().free_pages, 6);
  mgr_->TruncateLayer(s, 2, 60);  // the step failed
  EXPECT_EQ(mgr_->Length(s, 2), 60);
  EXPECT_EQ(mgr_->PagesOf(s), 1);
  EXPECT_EQ(mgr_->GetStats().free_pages, 7);
  ExpectConsistent();

  // A page another layer still needs stays.
  ASSERT_TRUE(Append(s, 0, 10, 100).ok());
  ASSERT_TRUE(mgr_->ReserveAppend(s, 2, 8, slots, &num).ok());
  mgr_->TruncateLayer(s, 2, 60);
  EXPECT_EQ(mgr_->PagesOf(s), 2);
  // Clamped: cannot grow, cannot go negative; bad layers and null are ignored.
  mgr_->TruncateLayer(s, 2, 1000);
  EXPECT_EQ(mgr_->Length(s, 2), 60);
  mgr_->TruncateLayer(s, 2, -5);
  EXPECT_EQ(mgr_->Length(s, 2), 0);
  mgr_->TruncateLayer(s, 7, 0);
  mgr_->TruncateLayer(nullptr, 0, 0);
  ExpectConsistent();
}

TEST_F(ManagerTest, ForkSharesFullPagesAndCopiesThePartlyFilledOne) {
  Sequence* a = Create("a");
  AppendAll(a, 64 * 2 + 5, 10);  // pages 0, 1 full; page 2 partly filled
  auto f = mgr_->Fork("a", "b");
  ASSERT_TRUE(f.ok()) << f.status();
  Sequence* b = *f;
  const auto& ta = mgr_->BlockTable(a);
  const auto& tb = mgr_->BlockTable(b);
  ASSERT_EQ(tb.size(), 3u);
  EXPECT_EQ(tb[0], ta[0]);
  EXPECT_EQ(tb[1], ta[1]);
  EXPECT_NE(tb[2], ta[2]);
  EXPECT_EQ(mgr_->RefCount(ta[0]), 2);
  EXPECT_EQ(mgr_->RefCount(ta[2]), 1);
  EXPECT_EQ(mgr_->RefCount(tb[2]), 1);
  EXPECT_EQ(mgr_->Lengths(b), mgr_->Lengths(a));
  EXPECT_EQ(mgr_->GetStats().used_pages, 4);
  for (int l = 0; l < kLayers; ++l) ExpectRows(b, l, 0, 133, 10);

  // The two diverge without touching each other's rows.
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(Append(a, l, 3, 500).ok());
    ASSERT_TRUE(Append(b, l, 3, 900).ok());
  }
  EXPECT_EQ(mgr_->GetStats().used_pages, 4);
  for (int l = 0; l < kLayers; ++l) {
    ExpectRows(a, l, 0, 133, 10);
    ExpectRows(a, l, 133, 3, 500);
    ExpectRows(b, l, 0, 133, 10);
    ExpectRows(b, l, 133, 3, 900);
  }
  ExpectConsistent();
}

TEST_F(ManagerTest, ForkCopiesPagesSomeLayerHasNotFilled) {
  Sequence* a = Create("a");
  ASSERT_TRUE(Append(a, 0, 150, 1).ok());  // layer 0 is ahead: pages 0..2
  ASSERT_TRUE(Append(a, 1, 70, 2).ok());
  ASSERT_TRUE(Append(a, 2, 64, 3).ok());   // every layer has filled page 0 only
  auto b = mgr_->Fork("a", "");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(mgr_->Id(*b).size(), 32u);
  EXPECT_EQ(mgr_->BlockTable(*b)[0], mgr_->BlockTable(a)[0]);
  EXPECT_NE(mgr_->BlockTable(*b)[1], mgr_->BlockTable(a)[1]);
  EXPECT_NE(mgr_->BlockTable(*b)[2], mgr_->BlockTable(a)[2]);
  EXPECT_EQ(mgr_->GetStats().used_pages, 5);
  // Layer 2 of the fork writes into page 1 which it owns alone.
  ASSERT_TRUE(Append(*b, 2, 10, 77).ok());
  ExpectRows(a, 0, 0, 150, 1);
  ExpectRows(a, 1, 0, 70, 2);
  ExpectRows(a, 2, 0, 64, 3);
  ExpectRows(*b, 0, 0, 150, 1);
  ExpectRows(*b, 1, 0, 70, 2);
  ExpectRows(*b, 2, 0, 64, 3);
  ExpectRows(*b, 2, 64, 10, 77);
  EXPECT_EQ(mgr_->Length(a, 2), 64);
  ExpectConsistent();
}

TEST_F(ManagerTest, ForkErrors) {
  Sequence* a = Create("a");
  Create("b");
  auto f = mgr_->Fork("zz", "c");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(StartsWith(f.status(), "sequence_id: ")) << f.status();
  f = mgr_->Fork("a", "b");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(StartsWith(f.status(), "new_sequence_id: ")) << f.status();
  f = mgr_->Fork("a", "bad id");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(StartsWith(f.status(), "new_sequence_id: ")) << f.status();

  // Out of pages for the copy: nothing changes.
  AppendAll(a, 64 * 7 + 1, 0);  // all 8 pages
  const auto before = mgr_->GetStats();
  f = mgr_->Fork("a", "c");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(f.status().message(), "kv cache: out of pages: need 1, free 0");
  EXPECT_EQ(mgr_->Find("c"), nullptr);
  EXPECT_EQ(mgr_->GetStats().free_pages, before.free_pages);
  EXPECT_EQ(mgr_->GetStats().sequences, before.sequences);
  for (int32_t p : mgr_->BlockTable(a)) EXPECT_EQ(mgr_->RefCount(p), 1);
  ExpectConsistent();

  // With every page full there is nothing to copy, so a fork needs no free page.
  mgr_->TruncateLayer(a, 0, 64 * 7);
  mgr_->TruncateLayer(a, 1, 64 * 7);
  mgr_->TruncateLayer(a, 2, 64 * 7);
  ASSERT_EQ(mgr_->GetStats().free_pages, 1);
  AppendAll(a, 64, 0);
  ASSERT_EQ(mgr_->GetStats().free_pages, 0);
  EXPECT_TRUE(mgr_->Fork("a", "c").ok());
  ExpectConsistent();
}

TEST_F(ManagerTest, CopyOnWriteWhenWritingIntoASharedPage) {
  Sequence* a = Create("a");
  AppendAll(a, 128, 40);  // two full pages, shared by a fork
  auto b = mgr_->Fork("a", "b");
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(mgr_->GetStats().used_pages, 2);
  // Rewinding a layer into shared page 1 and writing there must copy the page first.
  mgr_->TruncateLayer(a, 1, 100);
  const int32_t shared = mgr_->BlockTable(a)[1];
  ASSERT_EQ(mgr_->RefCount(shared), 2);
  ASSERT_TRUE(Append(a, 1, 10, 6000).ok());
  EXPECT_NE(mgr_->BlockTable(a)[1], shared);
  EXPECT_EQ(mgr_->RefCount(shared), 1);
  EXPECT_EQ(mgr_->BlockTable(*b)[1], shared);
  EXPECT_EQ(mgr_->GetStats().used_pages, 3);
  // The copy carried every layer; the fork still sees the original rows.
  ExpectRows(a, 0, 0, 128, 40);
  ExpectRows(a, 1, 0, 100, 40);
  ExpectRows(a, 1, 100, 10, 6000);
  ExpectRows(a, 2, 0, 128, 40);
  for (int l = 0; l < kLayers; ++l) ExpectRows(*b, l, 0, 128, 40);
  ExpectConsistent();

  // Reserved appends copy too, and the slots point at the copy.
  mgr_->TruncateLayer(*b, 0, 10);
  const int32_t page0 = mgr_->BlockTable(*b)[0];
  AppendSlot slots[KvCacheManager::MaxAppendSlots(1)];
  int num = 0;
  ASSERT_TRUE(mgr_->ReserveAppend(*b, 0, 1, slots, &num).ok());
  ASSERT_EQ(num, 1);
  EXPECT_NE(slots[0].page, page0);
  EXPECT_EQ(slots[0].page, mgr_->BlockTable(*b)[0]);
  EXPECT_EQ(slots[0].row, 10);
  EXPECT_EQ(mgr_->RefCount(page0), 1);
  ExpectConsistent();
}

TEST_F(ManagerTest, CopyOnWriteCountsTowardsOutOfPages) {
  Sequence* a = Create("a");
  AppendAll(a, 64 * 4, 1);
  ASSERT_TRUE(mgr_->Fork("a", "b").ok());
  Sequence* c = Create("c");
  AppendAll(c, 64 * 4, 2);  // pool full, pages of a shared with b
  ASSERT_EQ(mgr_->GetStats().free_pages, 0);
  mgr_->TruncateLayer(a, 0, 10);
  absl::Status st = Append(a, 0, 1, 3);
  EXPECT_EQ(st.message(), "kv cache: out of pages: need 1, free 0");
  EXPECT_EQ(mgr_->Length(a, 0), 10);
  EXPECT_EQ(mgr_->RefCount(mgr_->BlockTable(a)[0]), 2);
  ExpectConsistent();
}

TEST_F(ManagerTest, ReleaseFreesOnlyUnsharedPages) {
  Sequence* a = Create("a");
  AppendAll(a, 64 * 3 + 1, 1);  // 4 pages, 3 full
  ASSERT_TRUE(mgr_->Fork("a", "b").ok());
  ASSERT_TRUE(mgr_->Fork("b", "c").ok());
  EXPECT_EQ(mgr_->GetStats().used_pages, 6);
  auto freed = mgr_->Release("a");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 1);  // its own tail page
  EXPECT_EQ(mgr_->Find("a"), nullptr);
  freed = mgr_->Release("c");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 1);
  ExpectConsistent();
  freed = mgr_->Release("b");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 4);
  EXPECT_EQ(mgr_->GetStats().free_pages, 8);
  EXPECT_EQ(mgr_->GetStats().sequences, 0);
  ExpectConsistent();

  auto unknown = mgr_->Release("a");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(StartsWith(unknown.status(), "sequence_id: ")) << unknown.status();
  // A released id can be used again.
  EXPECT_NE(Create("a"), nullptr);
}

TEST_F(ManagerTest, PagesFreedDuringAReadWaitForItToClose) {
  Sequence* a = Create("a");
  AppendAll(a, 64 * 3, 1);  // 3 pages
  Sequence* b = Create("b");
  AppendAll(b, 64 * 2, 100);  // 2 pages
  // Read 1 covers a and b (a batch computing on their pages); then a goes away.
  const uint64_t r1 = mgr_->OpenRead();
  const std::vector<int32_t> a_pages = mgr_->BlockTable(a);
  auto freed = mgr_->Release("a");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 3);
  EXPECT_EQ(mgr_->GetStats().free_pages, 3);
  EXPECT_EQ(mgr_->GetStats().retiring_pages, 3);
  EXPECT_EQ(mgr_->GetStats().used_pages, 2);
  ExpectConsistent();
  // Nothing allocated now may land on a's pages: c gets the 3 free ones, then runs out.
  Sequence* c = Create("c");
  AppendAll(c, 64 * 3, 200);
  for (int32_t page : mgr_->BlockTable(c)) {
    EXPECT_EQ(std::count(a_pages.begin(), a_pages.end(), page), 0) << "page " << page;
  }
  EXPECT_EQ(Append(c, 0, 64, 300).code(), absl::StatusCode::kResourceExhausted);
  ExpectRows(b, 1, 0, 64 * 2, 100);
  // Read 2 opens later (the next batch), and b is released while both are open.
  const uint64_t r2 = mgr_->OpenRead();
  ASSERT_TRUE(mgr_->Release("b").ok());
  EXPECT_EQ(mgr_->GetStats().retiring_pages, 5);
  ExpectConsistent();
  // Closing read 1 frees a's pages only: b's may still be read by read 2.
  mgr_->CloseRead(r1);
  EXPECT_EQ(mgr_->GetStats().free_pages, 3);
  EXPECT_EQ(mgr_->GetStats().retiring_pages, 2);
  ExpectConsistent();
  mgr_->CloseRead(r2);
  EXPECT_EQ(mgr_->GetStats().free_pages, 5);
  EXPECT_EQ(mgr_->GetStats().retiring_pages, 0);
  ExpectConsistent();
  // With no read open, a release frees at once.
  ASSERT_TRUE(mgr_->Release("c").ok());
  EXPECT_EQ(mgr_->GetStats().free_pages, 8);
  ExpectConsistent();
}

TEST_F(ManagerTest, StatsAndHighWaterMark) {
  auto s0 = mgr_->GetStats();
  EXPECT_EQ(s0.total_pages, 8);
  EXPECT_EQ(s0.free_pages, 8);
  EXPECT_EQ(s0.used_pages, 0);
  EXPECT_EQ(s0.high_water_pages, 0);
  EXPECT_EQ(s0.sequences, 0);

  Sequence* a = Create("a");
  Sequence* b = Create("b");
  ASSERT_TRUE(Append(a, 0, 64 * 3, 0).ok());
  ASSERT_TRUE(Append(b, 2, 64 * 2, 0).ok());
  auto s1 = mgr_->GetStats();
  EXPECT_EQ(s1.used_pages, 5);
  EXPECT_EQ(s1.free_pages, 3);
  EXPECT_EQ(s1.high_water_pages, 5);
  EXPECT_EQ(s1.sequences, 2);
  EXPECT_EQ(mgr_->PagesOf(a), 3);
  EXPECT_EQ(mgr_->PagesOf(b), 2);

  ASSERT_TRUE(mgr_->Release("a").ok());
  auto s2 = mgr_->GetStats();
  EXPECT_EQ(s2.used_pages, 2);
  EXPECT_EQ(s2.high_water_pages, 5);  // a mark, not a gauge
  ASSERT_TRUE(Append(b, 2, 64, 0).ok());
  EXPECT_EQ(mgr_->GetStats().high_water_pages, 5);
}

TEST_F(ManagerTest, IdleSequencesAndTouch) {
  const absl::Time t0 = absl::FromUnixSeconds(1'000'000);
  Sequence* a = Create("a");
  Sequence* b = Create("b");
  Sequence* c = Create("c");
  EXPECT_LE(absl::Now() - mgr_->LastUsed(a), absl::Minutes(1));  // stamped on creation
  mgr_->Touch(a, t0);
  mgr_->Touch(b, t0 + absl::Seconds(10));
  mgr_->Touch(c, t0 + absl::Seconds(20));
  EXPECT_EQ(mgr_->LastUsed(b), t0 + absl::Seconds(10));
  EXPECT_TRUE(mgr_->IdleSequences(t0).empty());
  EXPECT_EQ(mgr_->IdleSequences(t0 + absl::Seconds(15)), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(mgr_->IdleSequences(t0 + absl::Seconds(21)),
            (std::vector<std::string>{"a", "b", "c"}));
  // A fork inherits its source's last use.
  auto f = mgr_->Fork("a", "f");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(mgr_->LastUsed(*f), t0);
  ASSERT_TRUE(mgr_->Release("a").ok());
  EXPECT_EQ(mgr_->IdleSequences(t0 + absl::Seconds(5)), (std::vector<std::string>{"f"}));
}

// The idle list is kept in order of last use, so a sweep visits only what it releases,
// oldest first, and stops at the first sequence still in use.
TEST_F(ManagerTest, ReleaseIdleIsBoundedAndOldestFirst) {
  const absl::Time t0 = absl::FromUnixSeconds(2'000'000);
  std::vector<Sequence*> seqs;
  for (int i = 0; i < 10; ++i) seqs.push_back(Create("s" + std::to_string(i)));
  // Touched newest-first, so list order differs from creation and id order.
  for (int i = 9; i >= 0; --i) mgr_->Touch(seqs[i], t0 + absl::Seconds(10 - i));
  ASSERT_TRUE(Append(seqs[9], 0, 70, 1).ok());  // two pages to give back
  EXPECT_EQ(mgr_->IdleSequences(t0 + absl::Seconds(4), 2), (std::vector<std::string>{"s9", "s8"}));
  const int64_t free_before = mgr_->free_pages();
  EXPECT_EQ(mgr_->ReleaseIdle(t0 + absl::Seconds(4), 2), 2);  // the bound
  EXPECT_EQ(mgr_->free_pages(), free_before + 2);
  EXPECT_EQ(mgr_->Find("s9"), nullptr);
  EXPECT_EQ(mgr_->ReleaseIdle(t0 + absl::Seconds(4), 100), 1);  // s7; s6 was used at t0+4
  EXPECT_EQ(mgr_->GetStats().sequences, 7);
  // A touch slightly out of order (callers read the clock before their lock) still
  // lands in order: s0, used at t0+5.5, goes before the sequences used later.
  mgr_->Touch(seqs[5], t0 + absl::Seconds(20));
  mgr_->Touch(seqs[0], t0 + absl::Seconds(5) + absl::Milliseconds(500));
  EXPECT_EQ(mgr_->IdleSequences(t0 + absl::Seconds(7)), (std::vector<std::string>{"s6", "s0", "s4"}));
  // A fork goes next to its source (same last use).
  auto f = mgr_->Fork("s6", "f6");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(mgr_->IdleSequences(t0 + absl::Seconds(5)), (std::vector<std::string>{"s6", "f6"}));
  EXPECT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency();
  EXPECT_EQ(mgr_->ReleaseIdle(t0 + absl::Hours(1), 1000), 8);
  EXPECT_EQ(mgr_->GetStats().sequences, 0);
  EXPECT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency();
}

TEST_F(ManagerTest, SerialsAndSharedPages) {
  Sequence* a = Create("a");
  const uint64_t first = mgr_->Serial(a);
  ASSERT_TRUE(Append(a, 0, 130, 1).ok());
  for (int l = 1; l < kLayers; ++l) ASSERT_TRUE(Append(a, l, 130, 1).ok());
  EXPECT_EQ(mgr_->SharedPagesOf(a), 0);
  auto f = mgr_->Fork("a", "f");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(mgr_->SharedPagesOf(a), 2);
  EXPECT_EQ(mgr_->SharedPagesOf(*f), 2);
  EXPECT_NE(mgr_->Serial(*f), first);
  ASSERT_TRUE(mgr_->Release("a").ok());
  EXPECT_EQ(mgr_->SharedPagesOf(*f), 0);
  EXPECT_NE(mgr_->Serial(Create("a")), first);  // same id, another sequence
}

TEST_F(ManagerTest, BookkeepingWithoutStorage) {
  KvCacheManager bare(config_, nullptr);
  auto a = bare.CreateSequence("a");
  ASSERT_TRUE(a.ok());
  AppendSlot slots[KvCacheManager::MaxAppendSlots(100)];
  int num = 0;
  ASSERT_TRUE(bare.ReserveAppend(*a, 0, 100, slots, &num).ok());
  auto b = bare.Fork("a", "b");  // copies are skipped, pages still allocated
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(bare.GetStats().used_pages, 4);  // nothing full across layers: both copied
  EXPECT_TRUE(bare.CheckConsistency().ok()) << bare.CheckConsistency();
  ASSERT_TRUE(bare.Release("a").ok());
  ASSERT_TRUE(bare.Release("b").ok());
  EXPECT_EQ(bare.GetStats().free_pages, 8);
}

// Host storage that fails the k-th write or copy from now on, as a device fault would.
class FaultyStorage final : public KvStorage {
 public:
  explicit FaultyStorage(std::unique_ptr<KvStorage> inner) : inner_(std::move(inner)) {}
  void FailWriteAfter(int ok_calls) { writes_left_ = ok_calls; }
  void FailCopyAfter(int ok_calls) { copies_left_ = ok_calls; }

  const KvCacheConfig& config() const override { return inner_->config(); }
  void* base() override { return inner_->base(); }
  absl::Status WriteRows(int layer, int32_t page, int row, int n, const void* src) override {
    if (writes_left_ >= 0 && writes_left_-- == 0) return absl::InternalError("injected write");
    return inner_->WriteRows(layer, page, row, n, src);
  }
  absl::Status ReadRows(int layer, int32_t page, int row, int n, void* dst) override {
    return inner_->ReadRows(layer, page, row, n, dst);
  }
  absl::Status WriteStoredRows(int layer, int32_t page, int row, int n, const void* src) override {
    if (writes_left_ >= 0 && writes_left_-- == 0) return absl::InternalError("injected write");
    return inner_->WriteStoredRows(layer, page, row, n, src);
  }
  absl::Status CopyPage(int32_t src_page, int32_t dst_page) override {
    if (copies_left_ >= 0 && copies_left_-- == 0) return absl::InternalError("injected copy");
    return inner_->CopyPage(src_page, dst_page);
  }

 private:
  std::unique_ptr<KvStorage> inner_;
  int writes_left_ = -1, copies_left_ = -1;
};

class StorageFailureTest : public ManagerTest {
 protected:
  void SetUp() override {
    config_ = KvCacheConfig{kLayers, 1, 8};
    auto st = MakeHostKvStorage(config_);
    ASSERT_TRUE(st.ok());
    auto faulty = std::make_unique<FaultyStorage>(*std::move(st));
    faulty_ = faulty.get();
    storage_ = std::move(faulty);
    mgr_ = std::make_unique<KvCacheManager>(config_, storage_.get());
  }
  FaultyStorage* faulty_ = nullptr;
};

TEST_F(StorageFailureTest, FailedWriteGivesBackNewPagesAndKeepsTheLength) {
  Sequence* s = Create("s");
  AppendAll(s, 10, 1);
  faulty_->FailWriteAfter(1);  // the second run of the next append fails
  absl::Status st = Append(s, 0, 150, 100);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(mgr_->Length(s, 0), 10);
  EXPECT_EQ(mgr_->PagesOf(s), 1);
  EXPECT_EQ(mgr_->GetStats().free_pages, 7);
  ExpectConsistent();
  ExpectRows(s, 0, 0, 10, 1);
}

TEST_F(StorageFailureTest, FailedForkCopyLeavesNoFork) {
  Sequence* a = Create("a");
  AppendAll(a, 64 * 2 + 3, 1);  // two shared pages, one copied
  faulty_->FailCopyAfter(0);
  auto f = mgr_->Fork("a", "b");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(mgr_->Find("b"), nullptr);
  EXPECT_EQ(mgr_->GetStats().free_pages, 5);
  for (int32_t p : mgr_->BlockTable(a)) EXPECT_EQ(mgr_->RefCount(p), 1);
  ExpectConsistent();
}

TEST_F(StorageFailureTest, FailedCopyOnWriteKeepsTheSharedPage) {
  Sequence* a = Create("a");
  AppendAll(a, 64, 1);
  ASSERT_TRUE(mgr_->Fork("a", "b").ok());
  mgr_->TruncateLayer(a, 0, 32);
  const auto table = mgr_->BlockTable(a);
  faulty_->FailCopyAfter(0);
  AppendSlot slots[KvCacheManager::MaxAppendSlots(1)];
  int num = 0;
  EXPECT_EQ(mgr_->ReserveAppend(a, 0, 1, slots, &num).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(mgr_->BlockTable(a), table);
  EXPECT_EQ(mgr_->Length(a, 0), 32);
  EXPECT_EQ(mgr_->RefCount(table[0]), 2);
  EXPECT_EQ(mgr_->GetStats().free_pages, 7);
  ExpectConsistent();
}

TEST_F(ManagerTest, CreateChecksConfigAndStorage) {
  auto ok = KvCacheManager::Create(config_, storage_.get());
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->GetStats().total_pages, 8);
  EXPECT_TRUE(KvCacheManager::Create(config_, nullptr).ok());
  auto bad = KvCacheManager::Create(KvCacheConfig{0, 1, 8}, nullptr);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  KvCacheConfig other = config_;
  other.num_pages = 9;
  auto mismatch = KvCacheManager::Create(other, storage_.get());
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(StartsWith(mismatch.status(), "storage: ")) << mismatch.status();
}

TEST_F(ManagerTest, BlockTableGrowthIsAmortised) {
  Reset(1024);
  Sequence* s = Create("s");
  AppendSlot slots[KvCacheManager::MaxAppendSlots(1)];
  int num = 0;
  int reallocations = 0;
  const int32_t* data = nullptr;
  for (int t = 0; t < 1024 * 64; ++t) {
    ASSERT_TRUE(mgr_->ReserveAppend(s, 0, 1, slots, &num).ok());
    if (mgr_->BlockTable(s).data() != data) {
      data = mgr_->BlockTable(s).data();
      ++reallocations;
    }
  }
  EXPECT_LE(reallocations, 12);
  ExpectConsistent();
}


// ---------------------------------------------------------------------------------
// Prefix cache.

std::vector<PageKey> Keys(std::initializer_list<uint64_t> ids) {
  std::vector<PageKey> keys;
  for (uint64_t id : ids) keys.push_back(PageKey{id * 0x9e3779b97f4a7c15ull, ~id});
  return keys;
}

class PrefixCacheTest : public ManagerTest {
 protected:
  Sequence* CreateWith(absl::string_view id, const std::vector<PageKey>& keys) {
    auto s = mgr_->CreateSequence(id, keys);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : nullptr;
  }
};

TEST_F(PrefixCacheTest, FullPagesAreAttachedByReference) {
  Sequence* a = CreateWith("a", Keys({1, 2, 3}));
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(mgr_->PrefixTokens(a), 0);
  AppendAll(a, 3 * kPageSize + 5, 100);  // three full pages and a partial one
  const std::vector<int32_t> a_table = mgr_->BlockTable(a);

  Sequence* b = CreateWith("b", Keys({1, 2, 9, 3}));  // the third key differs
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(mgr_->PrefixTokens(b), 2 * kPageSize);
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(mgr_->Length(b, l), 2 * kPageSize);
  ASSERT_EQ(mgr_->BlockTable(b).size(), 2u);
  EXPECT_EQ(mgr_->BlockTable(b)[0], a_table[0]);
  EXPECT_EQ(mgr_->BlockTable(b)[1], a_table[1]);
  EXPECT_EQ(mgr_->RefCount(a_table[0]), 2);
  for (int l = 0; l < kLayers; ++l) ExpectRows(b, l, 0, 2 * kPageSize, 100);
  const auto st = mgr_->GetStats();
  EXPECT_EQ(st.prefix_hits, 2u);
  // a's three keys missed; of b's, 9 missed and 3 after it was not looked at.
  EXPECT_EQ(st.prefix_misses, 3u + 2u);
  EXPECT_EQ(st.keyed_pages, 3);
  EXPECT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency();

  // b goes on with rows of its own: its third page is new, a's stays as it was.
  AppendAll(b, 10, 900);
  EXPECT_NE(mgr_->BlockTable(b)[2], a_table[2]);
  for (int l = 0; l < kLayers; ++l) {
    ExpectRows(a, l, 2 * kPageSize, kPageSize + 5, 100 + 2 * kPageSize);
    ExpectRows(b, l, 2 * kPageSize, 10, 900);
  }
  EXPECT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency();
}

TEST_F(PrefixCacheTest, KeysArePublishedOnlyOnceEveryLayerFilledThePage) {
  Sequence* a = CreateWith("a", Keys({1}));
  ASSERT_TRUE(Append(a, 0, kPageSize, 1).ok());
  ASSERT_TRUE(Append(a, 1, kPageSize, 1).ok());
  EXPECT_EQ(mgr_->PrefixTokens(CreateWith("b", Keys({1}))), 0);  // layer 2 is still empty
  ASSERT_TRUE(Append(a, 2, kPageSize - 1, 1).ok());
  EXPECT_EQ(mgr_->PrefixTokens(CreateWith("c", Keys({1}))), 0);  // one row short
  ASSERT_TRUE(Append(a, 2, 1, 1 + kPageSize - 1).ok());
  EXPECT_EQ(mgr_->PrefixTokens(CreateWith("d", Keys({1}))), kPageSize);
  EXPECT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency();
}

TEST_F(PrefixCacheTest, ReservedRowsAreNeverPublished) {
  Sequence* a = CreateWith("a", Keys({1}));
  std::vector<AppendSlot> slots(KvCacheManager::MaxAppendSlots(kPageSize));
  int n = 0;
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(mgr_->ReserveAppend(a, l, kPageSize, slots.data(), &n).ok());
  EXPECT_EQ(mgr_->PrefixTokens(CreateWith("b", Keys({1}))), 0);
  EXPECT_EQ(mgr_->GetStats().keyed_pages, 0);
}

TEST_F(PrefixCacheTest, ReleasedPagesStayCachedAndCountAsFree) {
  Sequence* a = CreateWith("a", Keys({1, 2}));
  AppendAll(a, 2 * kPageSize + 3, 7);
  const std::vector<int32_t> table = mgr_->BlockTable(a);
  ASSERT_TRUE(mgr_->Release("a").ok());
  auto st = mgr_->GetStats();
  EXPECT_EQ(st.cached_pages, 2);   // the partial third page is free, keyless
  EXPECT_EQ(st.free_pages, config_.num_pages);
  EXPECT_EQ(st.used_pages, 0);
  EXPECT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency();

  Sequence* b = CreateWith("b", Keys({1, 2}));
  EXPECT_EQ(mgr_->PrefixTokens(b), 2 * kPageSize);
  EXPECT_EQ(mgr_->BlockTable(b), std::vector<int32_t>(table.begin(), table.begin() + 2));
  for (int l = 0; l < kLayers; ++l) ExpectRows(b, l, 0, 2 * kPageSize, 7);
  EXPECT_EQ(mgr_->GetStats().cached_pages, 0);
  EXPECT_EQ(mgr_->RefCount(table[0]), 1);
  EXPECT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency();
}

TEST_F(PrefixCacheTest, CachedPagesAreEvictedLeastRecentlyCachedFirst) {
  Reset(4);
  for (uint64_t k = 1; k <= 3; ++k) {
    const std::string id = absl::StrCat("s", k);
    Sequence* s = CreateWith(id, Keys({k}));
    AppendAll(s, kPageSize, static_cast<uint32_t>(k * 1000));
    ASSERT_TRUE(mgr_->Release(id).ok());
  }
  EXPECT_EQ(mgr_->GetStats().cached_pages, 3);
  // Two pages of new rows: the free page, then the oldest cached one (key 1).
  Sequence* big = CreateWith("big", {});
  AppendAll(big, 2 * kPageSize, 5);
  auto st = mgr_->GetStats();
  EXPECT_EQ(st.evictions, 1u);
  EXPECT_EQ(st.cached_pages, 2);
  EXPECT_EQ(mgr_->PrefixTokens(CreateWith("x1", Keys({1}))), 0);
  Sequence* x2 = CreateWith("x2", Keys({2}));
  EXPECT_EQ(mgr_->PrefixTokens(x2), kPageSize);
  for (int l = 0; l < kLayers; ++l) ExpectRows(x2, l, 0, kPageSize, 2000);
  // A full pool with only cached pages left still appends (evicting key 3), and an
  // append beyond that is out of pages and changes nothing.
  AppendAll(big, kPageSize, 9);
  EXPECT_EQ(mgr_->GetStats().evictions, 2u);
  EXPECT_TRUE(absl::IsResourceExhausted(Append(big, 0, 1, 1)));
  EXPECT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency();
}

TEST_F(PrefixCacheTest, WritingIntoAnAttachedPageCopiesItFirst) {
  Sequence* a = CreateWith("a", Keys({1, 2}));
  AppendAll(a, 2 * kPageSize, 50);
  ASSERT_TRUE(mgr_->Release("a").ok());
  Sequence* b = CreateWith("b", Keys({1, 2}));
  const int32_t second = mgr_->BlockTable(b)[1];
  // b is the page's only holder, but the page is published: b's rewrite of its tail
  // goes to a copy, and the cached rows stay what the key says.
  for (int l = 0; l < kLayers; ++l) mgr_->TruncateLayer(b, l, kPageSize + 10);
  AppendAll(b, 5, 777);
  EXPECT_NE(mgr_->BlockTable(b)[1], second);
  for (int l = 0; l < kLayers; ++l) {
    ExpectRows(b, l, kPageSize, 10, 50 + kPageSize);
    ExpectRows(b, l, kPageSize + 10, 5, 777);
  }
  EXPECT_EQ(mgr_->GetStats().cached_pages, 1);
  Sequence* c = CreateWith("c", Keys({1, 2}));
  EXPECT_EQ(mgr_->BlockTable(c)[1], second);
  for (int l = 0; l < kLayers; ++l) ExpectRows(c, l, 0, 2 * kPageSize, 50);
  EXPECT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency();
}

TEST_F(PrefixCacheTest, PagesFreedDuringAReadAreNotAttachedUntilItCloses) {
  Sequence* a = CreateWith("a", Keys({1}));
  AppendAll(a, kPageSize, 3);
  const uint64_t read = mgr_->OpenRead();
  ASSERT_TRUE(mgr_->Release("a").ok());
  EXPECT_EQ(mgr_->PrefixTokens(CreateWith("b", Keys({1}))), 0);  // retiring
  EXPECT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency();
  mgr_->CloseRead(read);
  EXPECT_EQ(mgr_->GetStats().cached_pages, 1);
  EXPECT_EQ(mgr_->PrefixTokens(CreateWith("c", Keys({1}))), kPageSize);
  EXPECT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency();
}

TEST_F(PrefixCacheTest, AKeyFilledTwiceKeepsItsFirstPage) {
  Sequence* a = CreateWith("a", Keys({1}));
  Sequence* b = CreateWith("b", Keys({1}));  // nothing published yet: b fills its own
  AppendAll(a, kPageSize, 1);
  AppendAll(b, kPageSize, 1);
  EXPECT_EQ(mgr_->GetStats().keyed_pages, 1);
  Sequence* c = CreateWith("c", Keys({1}));
  EXPECT_EQ(mgr_->BlockTable(c)[0], mgr_->BlockTable(a)[0]);
  ASSERT_TRUE(mgr_->Release("b").ok());  // b's keyless page is simply free
  EXPECT_EQ(mgr_->GetStats().cached_pages, 0);
  EXPECT_TRUE(mgr_->CheckConsistency().ok()) << mgr_->CheckConsistency();
}

TEST_F(PrefixCacheTest, TooManyKeysIsInvalidAndCreatesNothing) {
  std::vector<PageKey> keys(config_.num_pages + 1);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = PageKey{i, i};
  auto s = mgr_->CreateSequence("a", keys);
  ASSERT_TRUE(absl::IsInvalidArgument(s.status()));
  EXPECT_TRUE(StartsWith(s.status(), "page_keys:")) << s.status();
  EXPECT_EQ(mgr_->Find("a"), nullptr);
}

}  // namespace
}  // namespace latentd::engine::kv
