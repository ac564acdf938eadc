// Thousands of random create / append / reserve / truncate / fork / release operations
// on a small pool, checked against a shadow model after every one: bookkeeping stays
// consistent, no page leaks or is freed twice, out-of-pages failures happen exactly when
// the pages needed exceed the free ones and change nothing, every row reads back as
// written, through forks and copy-on-write, and (with reads open) no page freed under
// an open read is handed out before that read closes.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "engine/kv/manager.h"
#include "engine/kv/storage.h"

namespace latentd::engine::kv {
namespace {

// Row contents are a function of a tag that is unique per written row.
void FillRow(const KvCacheConfig& c, uint32_t tag, char* out) {
  for (int64_t b = 0; b < c.row_bytes(); b += 4) {
    uint32_t word = tag * 2654435761u ^ static_cast<uint32_t>(b * 40503u);
    std::memcpy(out + b, &word, 4);
  }
}

class PropertyRun {
 public:
  // with_reads: also open and close reads (KvCacheManager::OpenRead) at random.
  PropertyRun(const KvCacheConfig& config, uint64_t seed, bool with_reads = false)
      : config_(config), rng_(seed), with_reads_(with_reads) {
    auto st = MakeHostKvStorage(config_);
    EXPECT_TRUE(st.ok()) << st.status();
    storage_ = *std::move(st);
    mgr_ = std::make_unique<KvCacheManager>(config_, storage_.get());
    row_.resize(config_.row_bytes());
    expect_.resize(config_.row_bytes());
    prev_refs_.assign(config_.num_pages, 0);
    freed_under_.assign(config_.num_pages, 0);
  }

  void Run(int ops) {
    for (op_ = 0; op_ < ops; ++op_) {
      Step();
      if (::testing::Test::HasFatalFailure() || ::testing::Test::HasFailure()) return;
      CheckBookkeeping();
      CheckReuse();
      if (op_ % 25 == 0) VerifyAllRows();
    }
    VerifyAllRows();
    std::printf("%d ops: %lld forks, %lld copy-on-write pages, %lld out-of-pages, high water %lld/%lld\n",
                ops, static_cast<long long>(forks_), static_cast<long long>(cow_copies_),
                static_cast<long long>(out_of_pages_),
                static_cast<long long>(mgr_->GetStats().high_water_pages),
                static_cast<long long>(config_.num_pages));
    // Releasing everything returns every page.
    while (!model_.empty()) {
      const std::string id = model_.begin()->first;
      ASSERT_TRUE(mgr_->Release(id).ok());
      Forget(id);
      CheckBookkeeping();
    }
    while (!open_reads_.empty()) CloseReadOp();
    const auto stats = mgr_->GetStats();
    EXPECT_EQ(stats.free_pages, config_.num_pages);
    EXPECT_EQ(stats.used_pages, 0);
    EXPECT_EQ(stats.sequences, 0);
    EXPECT_GT(stats.high_water_pages, config_.num_pages / 2);  // the pool was exercised
    EXPECT_GT(out_of_pages_, 0);
    EXPECT_GT(cow_copies_, 0);
    EXPECT_GT(forks_, 0);
    if (with_reads_) {
      EXPECT_GT(reads_, 0);
      EXPECT_GT(retired_, 0);  // some pages were freed under an open read
    }
  }

 private:
  using Rows = std::vector<std::vector<uint32_t>>;  // per layer, per token: the row's tag

  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  // Picked by creation order, not map order: generated ids are random, and the run
  // must replay the same way from its seed.
  std::string PickSequence() { return ids_[Uniform(0, static_cast<int>(ids_.size()) - 1)]; }

  void Forget(const std::string& id) {
    model_.erase(id);
    ids_.erase(std::find(ids_.begin(), ids_.end(), id));
  }

  // Mostly decode-sized appends, sometimes prefill-sized ones.
  int PickRows() {
    const int r = Uniform(0, 99);
    if (r < 60) return Uniform(1, 4);
    if (r < 90) return Uniform(5, 70);
    return Uniform(71, 300);
  }

  // Pages an append of n rows to `layer` must take from the free list.
  int64_t PagesNeeded(const Sequence* seq, int layer, int n) {
    const auto& table = mgr_->BlockTable(seq);
    const int64_t len = mgr_->Length(seq, layer);
    const int64_t end = PagesForTokens(len + n);
    const int64_t present = static_cast<int64_t>(table.size());
    int64_t need = std::max<int64_t>(0, end - present);
    for (int64_t i = len / kPageSize; i < std::min(end, present); ++i) {
      if (mgr_->RefCount(table[i]) > 1) ++need;
    }
    return need;
  }

  struct Snapshot {
    std::vector<int32_t> table;
    std::vector<int64_t> lengths;
    std::vector<int32_t> refs;
    int64_t free_pages;
    std::vector<char> bytes;
  };
  Snapshot Take(const Sequence* seq) {
    Snapshot s{mgr_->BlockTable(seq), mgr_->Lengths(seq), {}, mgr_->free_pages(), {}};
    for (int32_t p = 0; p < config_.num_pages; ++p) s.refs.push_back(mgr_->RefCount(p));
    const char* base = static_cast<const char*>(storage_->base());
    s.bytes.assign(base, base + config_.total_bytes());
    return s;
  }
  void ExpectUnchanged(const Sequence* seq, const Snapshot& s) {
    EXPECT_EQ(mgr_->BlockTable(seq), s.table) << "op " << op_;
    EXPECT_EQ(mgr_->Lengths(seq), s.lengths) << "op " << op_;
    EXPECT_EQ(mgr_->free_pages(), s.free_pages) << "op " << op_;
    for (int32_t p = 0; p < config_.num_pages; ++p) {
      EXPECT_EQ(mgr_->RefCount(p), s.refs[p]) << "op " << op_ << " page " << p;
    }
    EXPECT_EQ(std::memcmp(storage_->base(), s.bytes.data(), s.bytes.size()), 0) << "op " << op_;
  }

  void Step() {
    if (with_reads_ && Uniform(0, 99) < 10) {
      if (open_reads_.size() < 3 && (open_reads_.empty() || Uniform(0, 1))) return OpenReadOp();
      if (!open_reads_.empty()) return CloseReadOp();
    }
    const int r = Uniform(0, 99);
    if (model_.empty() || r < 8) return Create();
    // Release more eagerly when the pool runs low, so it keeps cycling.
    if (mgr_->free_pages() < config_.num_pages / 4 && r < 40) return ReleaseOp();
    if (r < 25) return AppendOp();
    if (r < 45) return AppendEveryLayerOp();
    if (r < 70) return ReserveOp();
    if (r < 76) return TruncateOp();
    if (r < 88) return ForkOp();
    return ReleaseOp();
  }

  void Create() {
    std::string id = Uniform(0, 1) ? absl::StrCat("s", next_id_++) : "";
    auto s = mgr_->CreateSequence(id);
    ASSERT_TRUE(s.ok()) << s.status();
    model_[mgr_->Id(*s)] = Rows(config_.num_layers);
    ids_.push_back(mgr_->Id(*s));
    if (!id.empty()) {
      EXPECT_EQ(mgr_->CreateSequence(id).status().code(), absl::StatusCode::kAlreadyExists);
    }
  }

  // A model step: the same number of rows for every layer in turn, which keeps layers
  // level so forks share full pages (and later truncations write into them).
  void AppendEveryLayerOp() {
    const std::string id = PickSequence();
    const int n = PickRows();
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      AppendOp(id, layer, n);
      if (::testing::Test::HasFailure()) return;
    }
  }

  void AppendOp() {
    AppendOp(PickSequence(), Uniform(0, config_.num_layers - 1), PickRows());
  }

  void AppendOp(const std::string& id, int layer, int n) {
    Sequence* seq = mgr_->Find(id);
    ASSERT_NE(seq, nullptr);
    if (PagesForTokens(mgr_->Length(seq, layer) + n) > config_.num_pages) return;
    std::vector<char> rows(n * config_.row_bytes());
    std::vector<uint32_t> tags;
    for (int i = 0; i < n; ++i) {
      tags.push_back(next_tag_++);
      FillRow(config_, tags.back(), &rows[i * config_.row_bytes()]);
    }
    const int64_t need = PagesNeeded(seq, layer, n);
    CountCopies(seq, layer, n);
    Snapshot before = Take(seq);
    absl::Status st = mgr_->Append(seq, layer, rows.data(), n);
    if (need > before.free_pages) {
      ASSERT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << "op " << op_ << ": " << st;
      EXPECT_EQ(st.message(), absl::StrCat("kv cache: out of pages: need ", need, ", free ",
                                           before.free_pages));
      ExpectUnchanged(seq, before);
      ++out_of_pages_;
      return;
    }
    ASSERT_TRUE(st.ok()) << "op " << op_ << ": " << st;
    auto& model = model_[id][layer];
    model.insert(model.end(), tags.begin(), tags.end());
    VerifySequence(id);
  }

  void ReserveOp() {
    const std::string id = PickSequence();
    Sequence* seq = mgr_->Find(id);
    const int layer = Uniform(0, config_.num_layers - 1);
    const int n = PickRows();
    if (PagesForTokens(mgr_->Length(seq, layer) + n) > config_.num_pages) return;
    const int64_t need = PagesNeeded(seq, layer, n);
    CountCopies(seq, layer, n);
    const int64_t old_len = mgr_->Length(seq, layer);
    Snapshot before = Take(seq);
    std::vector<AppendSlot> slots(KvCacheManager::MaxAppendSlots(n));
    int num = 0;
    absl::Status st = mgr_->ReserveAppend(seq, layer, n, slots.data(), &num);
    if (need > before.free_pages) {
      ASSERT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << "op " << op_ << ": " << st;
      ExpectUnchanged(seq, before);
      ++out_of_pages_;
      return;
    }
    ASSERT_TRUE(st.ok()) << "op " << op_ << ": " << st;
    ASSERT_EQ(mgr_->Length(seq, layer), old_len + n);
    ASSERT_LE(num, KvCacheManager::MaxAppendSlots(n));
    if (Uniform(0, 4) == 0) {
      // The step failed after reserving: undo.
      mgr_->TruncateLayer(seq, layer, old_len);
      EXPECT_EQ(mgr_->PagesOf(seq), static_cast<int64_t>(before.table.size()));
      VerifySequence(id);
      return;
    }
    // The backend's scatter: write each run where the slots say.
    int64_t pos = old_len;
    auto& model = model_[id][layer];
    for (int i = 0; i < num; ++i) {
      const AppendSlot& s = slots[i];
      ASSERT_EQ(s.page, mgr_->BlockTable(seq)[pos / kPageSize]) << "op " << op_;
      ASSERT_EQ(s.row, pos % kPageSize) << "op " << op_;
      std::vector<char> rows(s.n * config_.row_bytes());
      for (int j = 0; j < s.n; ++j) {
        model.push_back(next_tag_++);
        FillRow(config_, model.back(), &rows[j * config_.row_bytes()]);
      }
      ASSERT_TRUE(storage_->WriteRows(layer, s.page, s.row, s.n, rows.data()).ok());
      pos += s.n;
    }
    ASSERT_EQ(pos, old_len + n);
    VerifySequence(id);
  }

  void TruncateOp() {
    const std::string id = PickSequence();
    Sequence* seq = mgr_->Find(id);
    const int layer = Uniform(0, config_.num_layers - 1);
    const int64_t len = mgr_->Length(seq, layer);
    // Mostly a short rewind, which lands in pages a fork often shares.
    const int64_t to = Uniform(0, 3) == 0 ? Uniform(0, static_cast<int>(len))
                                          : std::max<int64_t>(0, len - Uniform(0, 70));
    mgr_->TruncateLayer(seq, layer, to);
    model_[id][layer].resize(to);
    VerifySequence(id);
  }

  void ForkOp() {
    const std::string id = PickSequence();
    const Sequence* src = mgr_->Find(id);
    int64_t min_len = mgr_->Length(src, 0);
    for (int l = 1; l < config_.num_layers; ++l) {
      min_len = std::min(min_len, mgr_->Length(src, l));
    }
    const int64_t copies = mgr_->PagesOf(src) - min_len / kPageSize;
    const int64_t free_before = mgr_->free_pages();
    std::string new_id = Uniform(0, 1) ? absl::StrCat("f", next_id_++) : "";
    auto f = mgr_->Fork(id, new_id);
    if (copies > free_before) {
      ASSERT_EQ(f.status().code(), absl::StatusCode::kResourceExhausted) << "op " << op_;
      EXPECT_EQ(mgr_->free_pages(), free_before);
      if (!new_id.empty()) {
        EXPECT_EQ(mgr_->Find(new_id), nullptr);
      }
      ++out_of_pages_;
      return;
    }
    ASSERT_TRUE(f.ok()) << "op " << op_ << ": " << f.status();
    EXPECT_EQ(mgr_->free_pages(), free_before - copies);
    model_[mgr_->Id(*f)] = model_[id];
    ids_.push_back(mgr_->Id(*f));
    ++forks_;
    const std::string fork_id = mgr_->Id(*f);
    VerifySequence(fork_id);
    if (Uniform(0, 2) == 0) {
      // Beam-search style rewind of one side, then a write into what may be a shared
      // page: copy-on-write.
      const std::string side = Uniform(0, 1) ? fork_id : id;
      const int layer = Uniform(0, config_.num_layers - 1);
      Sequence* seq = mgr_->Find(side);
      const int64_t to = std::max<int64_t>(0, mgr_->Length(seq, layer) - Uniform(1, 70));
      mgr_->TruncateLayer(seq, layer, to);
      model_[side][layer].resize(to);
      AppendOp(side, layer, Uniform(1, 8));
    }
  }

  void OpenReadOp() {
    open_reads_.push_back(mgr_->OpenRead());
    ++reads_;
  }

  void CloseReadOp() {
    mgr_->CloseRead(open_reads_.front());
    closed_upto_ = open_reads_.front();
    open_reads_.pop_front();
  }

  // Pages that went free in the last operation remember the newest open read; a page
  // taken again must not be remembered by a read still open.
  void CheckReuse() {
    for (int32_t p = 0; p < config_.num_pages; ++p) {
      const int32_t refs = mgr_->RefCount(p);
      if (prev_refs_[p] > 0 && refs == 0) {
        freed_under_[p] = open_reads_.empty() ? 0 : open_reads_.back();
        if (!open_reads_.empty()) ++retired_;
      }
      if (prev_refs_[p] == 0 && refs > 0) {
        ASSERT_LE(freed_under_[p], closed_upto_)
            << "op " << op_ << ": page " << p << " reused while read " << freed_under_[p] << " is open";
      }
      prev_refs_[p] = refs;
    }
  }

  void ReleaseOp() {
    const std::string id = PickSequence();
    const int64_t free_before = mgr_->free_pages() + mgr_->retiring_pages();
    auto freed = mgr_->Release(id);
    ASSERT_TRUE(freed.ok()) << freed.status();
    EXPECT_EQ(mgr_->free_pages() + mgr_->retiring_pages(), free_before + *freed);
    EXPECT_EQ(mgr_->Find(id), nullptr);
    EXPECT_EQ(mgr_->Release(id).status().code(), absl::StatusCode::kNotFound);
    Forget(id);
  }

  void CountCopies(const Sequence* seq, int layer, int n) {
    const auto& table = mgr_->BlockTable(seq);
    const int64_t len = mgr_->Length(seq, layer);
    const int64_t end = std::min<int64_t>(PagesForTokens(len + n), table.size());
    for (int64_t i = len / kPageSize; i < end; ++i) {
      if (mgr_->RefCount(table[i]) > 1) ++cow_copies_;
    }
  }

  void CheckBookkeeping() {
    absl::Status c = mgr_->CheckConsistency();
    ASSERT_TRUE(c.ok()) << "op " << op_ << ": " << c;
    const auto stats = mgr_->GetStats();
    ASSERT_EQ(stats.sequences, static_cast<int64_t>(model_.size()));
    ASSERT_EQ(stats.used_pages + stats.free_pages + stats.retiring_pages, stats.total_pages);
    if (open_reads_.empty()) ASSERT_EQ(stats.retiring_pages, 0) << "op " << op_;
    ASSERT_LE(stats.used_pages, stats.high_water_pages);
    for (const auto& [id, rows] : model_) {
      const Sequence* seq = mgr_->Find(id);
      ASSERT_NE(seq, nullptr) << id;
      for (int l = 0; l < config_.num_layers; ++l) {
        ASSERT_EQ(mgr_->Length(seq, l), static_cast<int64_t>(rows[l].size()))
            << "op " << op_ << " " << id << " layer " << l;
      }
    }
  }

  void VerifySequence(const std::string& id) {
    const Sequence* seq = mgr_->Find(id);
    ASSERT_NE(seq, nullptr);
    const auto& table = mgr_->BlockTable(seq);
    const Rows& rows = model_[id];
    for (int l = 0; l < config_.num_layers; ++l) {
      for (size_t t = 0; t < rows[l].size(); ++t) {
        ASSERT_TRUE(storage_->ReadRows(l, table[t / kPageSize], t % kPageSize, 1, row_.data())
                        .ok());
        FillRow(config_, rows[l][t], expect_.data());
        ASSERT_EQ(std::memcmp(row_.data(), expect_.data(), row_.size()), 0)
            << "op " << op_ << " sequence " << id << " layer " << l << " token " << t;
      }
    }
  }

  void VerifyAllRows() {
    for (const auto& entry : model_) {
      VerifySequence(entry.first);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }

  const KvCacheConfig config_;
  std::mt19937_64 rng_;
  std::unique_ptr<KvStorage> storage_;
  std::unique_ptr<KvCacheManager> mgr_;
  std::map<std::string, Rows> model_;
  std::vector<std::string> ids_;
  std::vector<char> row_, expect_;
  uint32_t next_tag_ = 1;
  int next_id_ = 0;
  int op_ = 0;
  int64_t out_of_pages_ = 0, cow_copies_ = 0, forks_ = 0;
  // Reads: open ones oldest first, the newest closed, and per page the newest read open
  // when it was last freed (0: none).
  const bool with_reads_;
  std::deque<uint64_t> open_reads_;
  uint64_t closed_upto_ = 0;
  std::vector<int32_t> prev_refs_;
  std::vector<uint64_t> freed_under_;
  int64_t reads_ = 0, retired_ = 0;
};

TEST(KvCacheManagerProperty, RandomOperationsMatchTheModel) {
  for (uint64_t seed : {1, 2, 3, 4}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    PropertyRun run(KvCacheConfig{3, 1, 24}, seed);
    run.Run(4000);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(KvCacheManagerProperty, PagesFreedUnderOpenReadsWaitForThem) {
  for (uint64_t seed : {21, 22}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    PropertyRun run(KvCacheConfig{3, 1, 24}, seed, /*with_reads=*/true);
    run.Run(4000);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(KvCacheManagerProperty, OneLayerAndTwoHeads) {
  for (uint64_t seed : {11, 12}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    PropertyRun run(KvCacheConfig{1, 2, 12}, seed);
    run.Run(3000);
    if (::testing::Test::HasFailure()) return;
  }
}

}  // namespace
}  // namespace latentd::engine::kv
