// The KvCacheManager shadow model: every operation is checked against the model, and a
// failed check records where and why instead of aborting, so a gtest and a fuzzer can
// each report it their own way.
#include "engine/kv/testing/manager_model.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace latentd::engine::kv::testing {
namespace {

// Row contents are a function of a tag that is unique per written row.
void FillRow(const KvCacheConfig& c, uint32_t tag, char* out) {
  for (int64_t b = 0; b < c.row_bytes(); b += 4) {
    uint32_t word = tag * 2654435761u ^ static_cast<uint32_t>(b * 40503u);
    std::memcpy(out + b, &word, 4);
  }
}

// Lets `return Voidify() & FailureStream(...) << ...` type-check in a void function.
struct Voidify {
  void operator&(const ManagerModel::FailureStream&) {}
};

}  // namespace

// A failed check records the first failure and returns from the (void) operation.
#define MODEL_CHECK(cond)                   \
  if (cond) {                               \
  } else                                    \
    return Voidify() & ManagerModel::FailureStream(this, __FILE__, __LINE__, #cond)
#define MODEL_CHECK_EQ(a, b) \
  MODEL_CHECK((a) == (b)) << "(" << (a) << " vs " << (b) << ") "
#define MODEL_CHECK_LE(a, b) \
  MODEL_CHECK((a) <= (b)) << "(" << (a) << " vs " << (b) << ") "
// Runs a sub-operation and stops the caller when it failed.
#define MODEL_RETURN_IF_FAILED(expr) \
  do {                               \
    expr;                            \
    if (failed()) return;            \
  } while (0)

ManagerModel::FailureStream::FailureStream(ManagerModel* model, const char* file, int line,
                                           const char* cond)
    : model_(model) {
  os_ << file << ":" << line << ": check failed: " << cond << " ";
}

ManagerModel::FailureStream::~FailureStream() {
  if (model_->failure_.empty()) model_->failure_ = os_.str();
}

ManagerModel::ManagerModel(const KvCacheConfig& config, ChoiceSource choose,
                           ModelOptions options)
    : config_(config), choose_(std::move(choose)), options_(options) {
  auto st = MakeHostKvStorage(config_);
  if (!st.ok()) {
    failure_ = absl::StrCat("MakeHostKvStorage: ", st.status().ToString());
    return;
  }
  storage_ = *std::move(st);
  mgr_ = std::make_unique<KvCacheManager>(config_, storage_.get());
  row_.resize(config_.row_bytes());
  expect_.resize(config_.row_bytes());
  prev_refs_.assign(config_.num_pages, 0);
  freed_under_.assign(config_.num_pages, 0);
  base_ = absl::Now() + absl::Hours(1);
}

bool ManagerModel::Step() {
  if (failed()) return false;
  DoStep();
  if (!failed()) CheckBookkeeping();
  if (!failed()) CheckReuse();
  ++counts_.ops;
  if (!failed() && options_.verify_all_every > 0 && counts_.ops % options_.verify_all_every == 1) {
    VerifyAll();
  }
  counts_.high_water_pages = mgr_->GetStats().high_water_pages;
  return !failed();
}

bool ManagerModel::VerifyAll() {
  for (const auto& entry : model_) {
    if (failed()) break;
    VerifySequence(entry.first);
  }
  return !failed();
}

bool ManagerModel::ReleaseAll() {
  [&] {
    // Releasing everything returns every page.
    while (!model_.empty()) {
      const std::string id = model_.begin()->first;
      MODEL_CHECK(mgr_->Release(id).ok()) << id;
      Forget(id);
      MODEL_RETURN_IF_FAILED(CheckBookkeeping());
    }
    while (!open_reads_.empty()) CloseReadOp();
    const auto stats = mgr_->GetStats();
    MODEL_CHECK_EQ(stats.free_pages, config_.num_pages);
    MODEL_CHECK_EQ(stats.used_pages, 0);
    MODEL_CHECK_EQ(stats.sequences, 0);
  }();
  return !failed();
}

// Picked by creation order, not map order: generated ids are random, and the run must
// replay the same way from its choices.
std::string ManagerModel::PickSequence() {
  return ids_[Uniform(0, static_cast<int>(ids_.size()) - 1)];
}

void ManagerModel::Forget(const std::string& id) {
  model_.erase(id);
  last_used_.erase(id);
  ids_.erase(std::find(ids_.begin(), ids_.end(), id));
}

// Mostly decode-sized appends, sometimes prefill-sized ones.
int ManagerModel::PickRows() {
  const int r = Uniform(0, 99);
  if (r < 60) return Uniform(1, 4);
  if (r < 90) return Uniform(5, 70);
  return Uniform(71, 300);
}

// Pages an append of n rows to `layer` must take from the free list.
int64_t ManagerModel::PagesNeeded(const Sequence* seq, int layer, int n) {
  const auto& table = mgr_->BlockTable(seq);
  const int64_t len = mgr_->Length(seq, layer);
  const int64_t end = PagesForTokens(len + n);
  const int64_t present = static_cast<int64_t>(table.size());
  int64_t need = std::max<int64_t>(0, end - present);
  for (int64_t i = len / kPageSize; i < std::min(end, present); ++i) {
    if (mgr_->RefCount(table[i]) > 1 || mgr_->Keyed(table[i])) ++need;
  }
  return need;
}

ManagerModel::Snapshot ManagerModel::Take(const Sequence* seq, bool with_bytes) {
  Snapshot s{mgr_->BlockTable(seq), mgr_->Lengths(seq), {}, mgr_->free_pages(), {}};
  for (int32_t p = 0; p < config_.num_pages; ++p) s.refs.push_back(mgr_->RefCount(p));
  if (with_bytes) {
    const char* base = static_cast<const char*>(storage_->base());
    s.bytes.assign(base, base + config_.total_bytes());
  }
  return s;
}

void ManagerModel::ExpectUnchanged(const Sequence* seq, const Snapshot& s) {
  MODEL_CHECK(mgr_->BlockTable(seq) == s.table) << "block table changed";
  MODEL_CHECK(mgr_->Lengths(seq) == s.lengths) << "lengths changed";
  MODEL_CHECK_EQ(mgr_->free_pages(), s.free_pages);
  for (int32_t p = 0; p < config_.num_pages; ++p) {
    MODEL_CHECK_EQ(mgr_->RefCount(p), s.refs[p]) << "page " << p;
  }
  if (!s.bytes.empty()) {
    MODEL_CHECK(std::memcmp(storage_->base(), s.bytes.data(), s.bytes.size()) == 0)
        << "storage bytes changed";
  }
}

void ManagerModel::DoStep() {
  if (options_.with_reads && Uniform(0, 99) < 10) {
    if (open_reads_.size() < 3 && (open_reads_.empty() || Uniform(0, 1))) return OpenReadOp();
    if (!open_reads_.empty()) return CloseReadOp();
  }
  if (options_.with_touch && !model_.empty() && Uniform(0, 99) < 5) return TouchOp();
  const int r = Uniform(0, 99);
  if (model_.empty() || r < 8) return r % 3 == 0 ? KeyedCreate() : Create();
  // Release more eagerly when the pool runs low, so it keeps cycling.
  if (mgr_->free_pages() < config_.num_pages / 4 && r < 40) return ReleaseOp();
  if (r < 25) return AppendOp();
  if (r < 45) return AppendEveryLayerOp();
  if (r < 70) return ReserveOp();
  if (r < 76) return TruncateOp();
  if (r < 88) return ForkOp();
  return ReleaseOp();
}

void ManagerModel::Create() {
  std::string id = Uniform(0, 1) ? absl::StrCat("s", next_id_++) : "";
  auto s = mgr_->CreateSequence(id);
  MODEL_CHECK(s.ok()) << s.status();
  model_[mgr_->Id(*s)] = Rows(config_.num_layers);
  last_used_[mgr_->Id(*s)] = mgr_->LastUsed(*s);
  ids_.push_back(mgr_->Id(*s));
  if (!id.empty()) {
    MODEL_CHECK(mgr_->CreateSequence(id).status().code() == absl::StatusCode::kAlreadyExists);
  }
}

namespace {

// Row tags of prompt family f: the same rows for every sequence of the family, apart from
// the counter's tags (which stay below 2^31).
uint32_t FamilyTag(int family, int layer, int64_t token) {
  return 0x80000000u | static_cast<uint32_t>(family) << 24 | static_cast<uint32_t>(layer) << 16 |
         static_cast<uint32_t>(token);
}

}  // namespace

void ManagerModel::KeyedCreate() {
  const int family = Uniform(0, 2);
  const int pages = Uniform(1, std::min<int>(3, config_.num_pages));
  std::vector<PageKey> keys;
  for (int i = 0; i < pages; ++i) keys.push_back(PageKey{static_cast<uint64_t>(family) + 1, static_cast<uint64_t>(i)});
  auto s = mgr_->CreateSequence(absl::StrCat("k", next_id_++), keys);
  MODEL_CHECK(s.ok()) << s.status();
  const std::string id = mgr_->Id(*s);
  const int64_t present = mgr_->PrefixTokens(*s);
  MODEL_CHECK(present % kPageSize == 0 && present <= pages * kPageSize) << present;
  Rows rows(config_.num_layers);
  for (int l = 0; l < config_.num_layers; ++l) {
    MODEL_CHECK_EQ(mgr_->Length(*s, l), present);
    for (int64_t t = 0; t < present; ++t) rows[l].push_back(FamilyTag(family, l, t));
  }
  model_[id] = rows;
  last_used_[id] = mgr_->LastUsed(*s);
  ids_.push_back(id);
  ++counts_.keyed_creates;
  counts_.prefix_hit_pages += present / kPageSize;
  // The attached rows are the family's: a page attached under another's key would differ.
  MODEL_RETURN_IF_FAILED(VerifySequence(id));
  const int n = static_cast<int>(pages * kPageSize - present);
  if (n == 0) return;
  std::vector<char> buf(n * config_.row_bytes());
  for (int l = 0; l < config_.num_layers; ++l) {
    std::vector<uint32_t> tags;
    for (int i = 0; i < n; ++i) {
      tags.push_back(FamilyTag(family, l, present + i));
      FillRow(config_, tags.back(), &buf[i * config_.row_bytes()]);
    }
    const int64_t need = PagesNeeded(*s, l, n);
    const int64_t free_before = mgr_->free_pages();
    absl::Status st = mgr_->Append(*s, l, buf.data(), n);
    if (need > free_before) {
      MODEL_CHECK(st.code() == absl::StatusCode::kResourceExhausted) << st;
      ++counts_.out_of_pages;
      MODEL_CHECK(mgr_->Release(id).ok()) << id;
      Forget(id);
      return;
    }
    MODEL_CHECK(st.ok()) << st;
    auto& model = model_[id][l];
    model.insert(model.end(), tags.begin(), tags.end());
  }
  VerifySequence(id);
}

// A model step: the same number of rows for every layer in turn, which keeps layers
// level so forks share full pages (and later truncations write into them).
void ManagerModel::AppendEveryLayerOp() {
  const std::string id = PickSequence();
  const int n = PickRows();
  for (int layer = 0; layer < config_.num_layers; ++layer) {
    MODEL_RETURN_IF_FAILED(AppendOp(id, layer, n));
  }
}

void ManagerModel::AppendOp() {
  // Argument evaluation order is unspecified: draw the choices in a fixed order.
  const std::string id = PickSequence();
  const int layer = Uniform(0, config_.num_layers - 1);
  AppendOp(id, layer, PickRows());
}

void ManagerModel::AppendOp(const std::string& id, int layer, int n) {
  Sequence* seq = mgr_->Find(id);
  MODEL_CHECK(seq != nullptr) << id;
  if (PagesForTokens(mgr_->Length(seq, layer) + n) > config_.num_pages) return;
  std::vector<char> rows(n * config_.row_bytes());
  std::vector<uint32_t> tags;
  for (int i = 0; i < n; ++i) {
    tags.push_back(next_tag_++);
    FillRow(config_, tags.back(), &rows[i * config_.row_bytes()]);
  }
  const int64_t need = PagesNeeded(seq, layer, n);
  CountCopies(seq, layer, n);
  // Only an append expected to fail compares the bytes afterwards.
  Snapshot before = Take(seq, options_.compare_bytes && need > mgr_->free_pages());
  absl::Status st = mgr_->Append(seq, layer, rows.data(), n);
  if (need > before.free_pages) {
    MODEL_CHECK(st.code() == absl::StatusCode::kResourceExhausted) << st;
    MODEL_CHECK(st.message() == absl::StrCat("kv cache: out of pages: need ", need, ", free ",
                                             before.free_pages))
        << st;
    MODEL_RETURN_IF_FAILED(ExpectUnchanged(seq, before));
    ++counts_.out_of_pages;
    return;
  }
  MODEL_CHECK(st.ok()) << st;
  auto& model = model_[id][layer];
  model.insert(model.end(), tags.begin(), tags.end());
  VerifySequence(id);
}

void ManagerModel::ReserveOp() {
  const std::string id = PickSequence();
  Sequence* seq = mgr_->Find(id);
  const int layer = Uniform(0, config_.num_layers - 1);
  const int n = PickRows();
  if (PagesForTokens(mgr_->Length(seq, layer) + n) > config_.num_pages) return;
  const int64_t need = PagesNeeded(seq, layer, n);
  CountCopies(seq, layer, n);
  const int64_t old_len = mgr_->Length(seq, layer);
  // Only an append expected to fail compares the bytes afterwards.
  Snapshot before = Take(seq, options_.compare_bytes && need > mgr_->free_pages());
  std::vector<AppendSlot> slots(KvCacheManager::MaxAppendSlots(n));
  int num = 0;
  absl::Status st = mgr_->ReserveAppend(seq, layer, n, slots.data(), &num);
  if (need > before.free_pages) {
    MODEL_CHECK(st.code() == absl::StatusCode::kResourceExhausted) << st;
    MODEL_RETURN_IF_FAILED(ExpectUnchanged(seq, before));
    ++counts_.out_of_pages;
    return;
  }
  MODEL_CHECK(st.ok()) << st;
  MODEL_CHECK_EQ(mgr_->Length(seq, layer), old_len + n);
  MODEL_CHECK_LE(num, KvCacheManager::MaxAppendSlots(n));
  if (Uniform(0, 4) == 0) {
    // The step failed after reserving: undo.
    mgr_->TruncateLayer(seq, layer, old_len);
    MODEL_CHECK_EQ(mgr_->PagesOf(seq), static_cast<int64_t>(before.table.size()));
    VerifySequence(id);
    return;
  }
  // The backend's scatter: write each run where the slots say.
  int64_t pos = old_len;
  auto& model = model_[id][layer];
  for (int i = 0; i < num; ++i) {
    const AppendSlot& s = slots[i];
    MODEL_CHECK_EQ(s.page, mgr_->BlockTable(seq)[pos / kPageSize]);
    MODEL_CHECK_EQ(s.row, pos % kPageSize);
    std::vector<char> rows(s.n * config_.row_bytes());
    for (int j = 0; j < s.n; ++j) {
      model.push_back(next_tag_++);
      FillRow(config_, model.back(), &rows[j * config_.row_bytes()]);
    }
    MODEL_CHECK(storage_->WriteRows(layer, s.page, s.row, s.n, rows.data()).ok());
    pos += s.n;
  }
  MODEL_CHECK_EQ(pos, old_len + n);
  VerifySequence(id);
}

void ManagerModel::TruncateOp() {
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

void ManagerModel::ForkOp() {
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
    MODEL_CHECK(f.status().code() == absl::StatusCode::kResourceExhausted) << f.status();
    MODEL_CHECK_EQ(mgr_->free_pages(), free_before);
    if (!new_id.empty()) {
      MODEL_CHECK(mgr_->Find(new_id) == nullptr) << new_id;
    }
    ++counts_.out_of_pages;
    return;
  }
  MODEL_CHECK(f.ok()) << f.status();
  MODEL_CHECK_EQ(mgr_->free_pages(), free_before - copies);
  const std::string fork_id = mgr_->Id(*f);
  model_[fork_id] = model_[id];
  last_used_[fork_id] = last_used_[id];
  ids_.push_back(fork_id);
  ++counts_.forks;
  MODEL_RETURN_IF_FAILED(VerifySequence(fork_id));
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

void ManagerModel::OpenReadOp() {
  open_reads_.push_back(mgr_->OpenRead());
  ++counts_.reads;
}

void ManagerModel::CloseReadOp() {
  mgr_->CloseRead(open_reads_.front());
  closed_upto_ = open_reads_.front();
  open_reads_.pop_front();
}

// Touches one sequence, then checks which ones an idle scan at some cutoff returns.
void ManagerModel::TouchOp() {
  const std::string id = PickSequence();
  const absl::Time now = base_ + absl::Seconds(Uniform(0, 20));
  mgr_->Touch(mgr_->Find(id), now);
  last_used_[id] = now;
  const absl::Time cutoff = base_ + absl::Seconds(Uniform(0, 21));
  std::vector<std::string> idle = mgr_->IdleSequences(cutoff);
  std::sort(idle.begin(), idle.end());
  std::vector<std::string> want;
  for (const auto& [sid, t] : last_used_) {
    MODEL_CHECK(mgr_->LastUsed(mgr_->Find(sid)) == t) << sid;
    if (t < cutoff) want.push_back(sid);
  }
  // The manager's contract (manager.h): touches more out of order than its short walk
  // back keep touch order, so an idle sequence behind a newer one is found late, never
  // early. Every sequence it reports must be idle; it may report fewer.
  MODEL_CHECK(std::includes(want.begin(), want.end(), idle.begin(), idle.end()))
      << idle.size() << " idle, not all of them idle by the model's " << want.size();
}

// Pages that went free in the last operation remember the newest open read; a page
// taken again must not be remembered by a read still open.
void ManagerModel::CheckReuse() {
  for (int32_t p = 0; p < config_.num_pages; ++p) {
    const int32_t refs = mgr_->RefCount(p);
    if (prev_refs_[p] > 0 && refs == 0) {
      freed_under_[p] = open_reads_.empty() ? 0 : open_reads_.back();
      if (!open_reads_.empty()) ++counts_.retired;
    }
    if (prev_refs_[p] == 0 && refs > 0) {
      MODEL_CHECK_LE(freed_under_[p], closed_upto_)
          << "page " << p << " reused while read " << freed_under_[p] << " is open";
    }
    prev_refs_[p] = refs;
  }
}

void ManagerModel::ReleaseOp() {
  const std::string id = PickSequence();
  const int64_t free_before = mgr_->free_pages() + mgr_->retiring_pages();
  auto freed = mgr_->Release(id);
  MODEL_CHECK(freed.ok()) << freed.status();
  MODEL_CHECK_EQ(mgr_->free_pages() + mgr_->retiring_pages(), free_before + *freed);
  MODEL_CHECK(mgr_->Find(id) == nullptr) << id;
  MODEL_CHECK(mgr_->Release(id).status().code() == absl::StatusCode::kNotFound);
  Forget(id);
}

void ManagerModel::CountCopies(const Sequence* seq, int layer, int n) {
  const auto& table = mgr_->BlockTable(seq);
  const int64_t len = mgr_->Length(seq, layer);
  const int64_t end = std::min<int64_t>(PagesForTokens(len + n), table.size());
  for (int64_t i = len / kPageSize; i < end; ++i) {
    if (mgr_->RefCount(table[i]) > 1 || mgr_->Keyed(table[i])) ++counts_.cow_copies;
  }
}

void ManagerModel::CheckBookkeeping() {
  absl::Status c = mgr_->CheckConsistency();
  MODEL_CHECK(c.ok()) << c;
  const auto stats = mgr_->GetStats();
  MODEL_CHECK_EQ(stats.sequences, static_cast<int64_t>(model_.size()));
  MODEL_CHECK_EQ(stats.used_pages + stats.free_pages + stats.retiring_pages, stats.total_pages);
  if (open_reads_.empty()) MODEL_CHECK_EQ(stats.retiring_pages, 0);
  MODEL_CHECK_LE(stats.used_pages, stats.high_water_pages);
  for (const auto& [id, rows] : model_) {
    const Sequence* seq = mgr_->Find(id);
    MODEL_CHECK(seq != nullptr) << id;
    for (int l = 0; l < config_.num_layers; ++l) {
      MODEL_CHECK_EQ(mgr_->Length(seq, l), static_cast<int64_t>(rows[l].size()))
          << id << " layer " << l;
    }
  }
}

void ManagerModel::VerifySequence(const std::string& id) {
  const Sequence* seq = mgr_->Find(id);
  MODEL_CHECK(seq != nullptr) << id;
  const auto& table = mgr_->BlockTable(seq);
  const Rows& rows = model_[id];
  for (int l = 0; l < config_.num_layers; ++l) {
    for (size_t t = 0; t < rows[l].size(); ++t) {
      MODEL_CHECK(storage_->ReadRows(l, table[t / kPageSize], t % kPageSize, 1, row_.data()).ok());
      FillRow(config_, rows[l][t], expect_.data());
      MODEL_CHECK(std::memcmp(row_.data(), expect_.data(), row_.size()) == 0)
          << "sequence " << id << " layer " << l << " token " << t;
    }
  }
}

}  // namespace latentd::engine::kv::testing
