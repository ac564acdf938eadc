// KvCacheManager: a free-list page allocator with reference counts, and the sequences
// that hold pages through one block table shared by every layer.
#include "engine/kv/manager.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace latentd::engine::kv {

struct Sequence {
  std::string id;
  std::vector<int32_t> block_table;  // logical page ids
  std::vector<int64_t> lengths;      // rows per layer
  absl::Time last_used;
  uint64_t serial = 0;
  std::vector<PageKey> keys;  // content keys of its first pages (CreateSequence)
  size_t published = 0;       // leading keys attached or published
  int64_t prefix_tokens = 0;  // rows per layer attached from the cache
  Sequence* lru_prev = nullptr;  // the manager's last-use list
  Sequence* lru_next = nullptr;
};

namespace {

bool IsIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         c == '.' || c == '_' || c == ':' || c == '-';
}

// Client-supplied ids go into messages escaped and shortened, so a hostile id cannot
// flood logs or inject control characters.
std::string Quote(absl::string_view id) {
  constexpr size_t kShown = 64;
  std::string s = absl::StrCat("'", absl::CHexEscape(id.substr(0, kShown)), "'");
  if (id.size() > kShown) absl::StrAppend(&s, "...");
  return s;
}

absl::Status UnknownSequence(absl::string_view field, absl::string_view id) {
  return absl::NotFoundError(absl::StrCat(field, ": unknown sequence ", Quote(id)));
}

// 128 bits from the kernel's CSPRNG: ids are capabilities (whoever knows one may
// append to and release the sequence), so they must not be predictable.
absl::StatusOr<std::string> RandomId() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t r = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(
          absl::StrCat("sequence_id: cannot read OS randomness: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(r);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

int64_t MaxLength(const std::vector<int64_t>& lengths) {
  int64_t m = 0;
  for (int64_t l : lengths) m = std::max(m, l);
  return m;
}

int64_t MinLength(const std::vector<int64_t>& lengths) {
  int64_t m = lengths.empty() ? 0 : lengths[0];
  for (int64_t l : lengths) m = std::min(m, l);
  return m;
}

absl::Status OutOfPages(int64_t need, int64_t free) {
  return absl::ResourceExhaustedError(
      absl::StrCat("kv cache: out of pages: need ", need, ", free ", free));
}

}  // namespace

absl::Status ValidateSequenceId(absl::string_view id, absl::string_view field) {
  if (id.empty() || id.size() > kMaxSequenceIdLength ||
      !std::all_of(id.begin(), id.end(), IsIdChar)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": must be 1 to ", kMaxSequenceIdLength,
        " characters of [A-Za-z0-9._:-], got ", Quote(id), " (", id.size(), " characters)"));
  }
  return absl::OkStatus();
}

KvCacheManager::KvCacheManager(const KvCacheConfig& config, KvStorage* storage)
    : config_(config), storage_(storage) {
  // Allocated once: the allocator never grows on the decode path.
  refcount_.assign(static_cast<size_t>(std::max<int64_t>(0, config_.num_pages)), 0);
  free_list_.reserve(static_cast<size_t>(config_.num_pages));
  // Highest id at the bottom so pages are handed out 0, 1, 2, ... from a fresh pool.
  for (int64_t p = config_.num_pages - 1; p >= 0; --p) {
    free_list_.push_back(static_cast<int32_t>(p));
  }
  const size_t pages = refcount_.size();
  key_of_.assign(pages, PageKey{});
  keyed_.assign(pages, 0);
  cache_prev_.assign(pages, -1);
  cache_next_.assign(pages, -1);
}

KvCacheManager::~KvCacheManager() = default;

absl::StatusOr<std::unique_ptr<KvCacheManager>> KvCacheManager::Create(
    const KvCacheConfig& config, KvStorage* storage) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  if (storage != nullptr) {
    const KvCacheConfig& sc = storage->config();
    if (!SamePool(sc, config)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "storage: shaped for ", sc.num_layers, " layers, ", sc.num_heads_kv, " heads, ",
          sc.num_pages, " pages, ", sc.bytes_per_value, " bytes per value, ",
          kernels::KvDTypeName(sc.kv_dtype, sc.dtype), "; the cache is configured for ",
          config.num_layers, ", ", config.num_heads_kv, ", ", config.num_pages, ", ",
          config.bytes_per_value, ", ", kernels::KvDTypeName(config.kv_dtype, config.dtype)));
    }
  }
  return std::make_unique<KvCacheManager>(config, storage);
}

absl::StatusOr<std::string> KvCacheManager::NewId(absl::string_view requested,
                                                  absl::string_view field) {
  if (!requested.empty()) {
    if (absl::Status s = ValidateSequenceId(requested, field); !s.ok()) return s;
    if (sequences_.contains(requested)) {
      return absl::AlreadyExistsError(
          absl::StrCat(field, ": sequence ", Quote(requested), " already exists"));
    }
    return std::string(requested);
  }
  // A collision among 2^128 values means the randomness is broken; a few tries tell
  // that apart from bad luck.
  for (int attempt = 0; attempt < 4; ++attempt) {
    absl::StatusOr<std::string> id = RandomId();
    if (!id.ok()) return id.status();
    if (!sequences_.contains(*id)) return id;
  }
  return absl::InternalError(absl::StrCat(field, ": generated ids keep colliding"));
}

absl::StatusOr<Sequence*> KvCacheManager::CreateSequence(absl::string_view id) {
  return CreateSequence(id, {});
}

absl::StatusOr<Sequence*> KvCacheManager::CreateSequence(absl::string_view id, const std::vector<PageKey>& keys) {
  if (static_cast<int64_t>(keys.size()) > config_.num_pages) {
    return absl::InvalidArgumentError(absl::StrCat("page_keys: ", keys.size(), " keys for a cache of ",
                                                   config_.num_pages, " pages"));
  }
  absl::StatusOr<std::string> new_id = NewId(id, "sequence_id");
  if (!new_id.ok()) return new_id.status();
  auto seq = std::make_unique<Sequence>();
  seq->id = *std::move(new_id);
  seq->lengths.assign(config_.num_layers, 0);
  seq->last_used = absl::Now();
  seq->serial = next_serial_++;
  seq->keys = keys;
  // Attach the leading pages the cache holds. A page whose last reference went while a
  // read was open (retiring) is not taken back: the walk ends there, as at a miss.
  for (const PageKey& key : seq->keys) {
    auto it = by_key_.find(key);
    if (it == by_key_.end()) break;
    const int32_t page = it->second;
    if (refcount_[page] == 0) {
      if (cache_prev_[page] < 0 && cache_head_ != page) break;  // retiring
      CacheUnlink(page);
    }
    ++refcount_[page];
    seq->block_table.push_back(page);
  }
  seq->published = seq->block_table.size();
  prefix_hits_ += seq->published;
  prefix_misses_ += seq->keys.size() - seq->published;
  seq->prefix_tokens = static_cast<int64_t>(seq->published) * kPageSize;
  seq->lengths.assign(config_.num_layers, seq->prefix_tokens);
  high_water_ = std::max(high_water_, config_.num_pages - free_pages());
  Sequence* raw = seq.get();
  sequences_.emplace(raw->id, std::move(seq));
  Touch(raw, raw->last_used);
  return raw;
}

int64_t KvCacheManager::PrefixTokens(const Sequence* seq) const { return seq->prefix_tokens; }

void KvCacheManager::CacheLink(int32_t page) {
  cache_prev_[page] = cache_tail_;
  cache_next_[page] = -1;
  if (cache_tail_ >= 0) {
    cache_next_[cache_tail_] = page;
  } else {
    cache_head_ = page;
  }
  cache_tail_ = page;
  ++cached_count_;
}

void KvCacheManager::CacheUnlink(int32_t page) {
  const int32_t prev = cache_prev_[page], next = cache_next_[page];
  (prev >= 0 ? cache_next_[prev] : cache_head_) = next;
  (next >= 0 ? cache_prev_[next] : cache_tail_) = prev;
  cache_prev_[page] = cache_next_[page] = -1;
  --cached_count_;
}

void KvCacheManager::Unkey(int32_t page) {
  if (!keyed_[page]) return;
  by_key_.erase(key_of_[page]);
  keyed_[page] = 0;
}

void KvCacheManager::Unreferenced(int32_t page) {
  if (keyed_[page]) {
    CacheLink(page);
  } else {
    free_list_.push_back(page);
  }
}

void KvCacheManager::PublishFull(Sequence* seq) {
  const size_t full = static_cast<size_t>(MinLength(seq->lengths) / kPageSize);
  while (seq->published < seq->keys.size() && seq->published < full) {
    const int32_t page = seq->block_table[seq->published];
    const PageKey& key = seq->keys[seq->published];
    // A key already published names rows like these; the first page keeps it.
    if (!keyed_[page] && by_key_.emplace(key, page).second) {
      key_of_[page] = key;
      keyed_[page] = 1;
    }
    ++seq->published;
  }
}

Sequence* KvCacheManager::Find(absl::string_view id) {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : it->second.get();
}

const Sequence* KvCacheManager::Find(absl::string_view id) const {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : it->second.get();
}

int32_t KvCacheManager::AllocPage() {
  int32_t page;
  if (!free_list_.empty()) {
    page = free_list_.back();
    free_list_.pop_back();
  } else {  // callers checked free_pages(): the least recently cached page goes
    page = cache_head_;
    CacheUnlink(page);
    Unkey(page);
    ++evictions_;
  }
  refcount_[page] = 1;
  high_water_ = std::max(high_water_, config_.num_pages - free_pages());
  return page;
}

bool KvCacheManager::Unref(int32_t page) {
  if (--refcount_[page] > 0) return false;
  if (reads_opened_ > reads_closed_) {
    retiring_.push_back({reads_opened_, page});
  } else {
    Unreferenced(page);
  }
  return true;
}

uint64_t KvCacheManager::OpenRead() { return ++reads_opened_; }

void KvCacheManager::CloseRead(uint64_t read) {
  reads_closed_ = std::max(reads_closed_, read);
  size_t n = 0;
  while (n < retiring_.size() && retiring_[n].after_read <= reads_closed_) {
    Unreferenced(retiring_[n].page);
    ++n;
  }
  retiring_.erase(retiring_.begin(), retiring_.begin() + static_cast<std::ptrdiff_t>(n));
}

absl::StatusOr<Sequence*> KvCacheManager::Fork(absl::string_view id,
                                               absl::string_view new_id) {
  const Sequence* src = Find(id);
  if (src == nullptr) return UnknownSequence("sequence_id", id);
  absl::StatusOr<std::string> fork_id = NewId(new_id, "new_sequence_id");
  if (!fork_id.ok()) return fork_id.status();

  // A page is shared only when every layer has filled it: then neither sequence writes
  // into it again. The rest of the table (the tail some layer is still filling) is
  // copied.
  const size_t table_size = src->block_table.size();
  const size_t shared = static_cast<size_t>(MinLength(src->lengths) / kPageSize);
  const int64_t copies = static_cast<int64_t>(table_size - shared);
  if (copies > free_pages()) return OutOfPages(copies, free_pages());

  auto seq = std::make_unique<Sequence>();
  seq->id = *std::move(fork_id);
  seq->lengths = src->lengths;
  seq->last_used = src->last_used;
  seq->block_table.reserve(src->block_table.capacity());
  for (size_t i = 0; i < table_size; ++i) {
    const int32_t page = src->block_table[i];
    if (i < shared) {
      ++refcount_[page];
      seq->block_table.push_back(page);
      continue;
    }
    const int32_t copy = AllocPage();
    seq->block_table.push_back(copy);
    if (storage_ == nullptr) continue;
    if (absl::Status s = storage_->CopyPage(page, copy); !s.ok()) {
      for (int32_t p : seq->block_table) Unref(p);
      return s;
    }
  }
  seq->serial = next_serial_++;
  Sequence* raw = seq.get();
  sequences_.emplace(raw->id, std::move(seq));
  // Same last use as the source: right behind it keeps the list in order.
  LruInsertAfter(const_cast<Sequence*>(src), raw);
  return raw;
}

absl::StatusOr<int64_t> KvCacheManager::Release(absl::string_view id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return UnknownSequence("sequence_id", id);
  int64_t freed = 0;
  for (int32_t page : it->second->block_table) freed += Unref(page) ? 1 : 0;
  LruUnlink(it->second.get());
  sequences_.erase(it);
  return freed;
}

absl::Status KvCacheManager::CheckAppend(const Sequence* seq, int layer, int n) const {
  if (seq == nullptr) return absl::InvalidArgumentError("sequence: null");
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: ", layer, " is out of range [0, ", config_.num_layers, ")"));
  }
  if (n <= 0) return absl::InvalidArgumentError(absl::StrCat("n: must be positive, got ", n));
  // An append no amount of freeing could satisfy is a bad request, not a full cache.
  const int64_t new_length = seq->lengths[layer] + n;
  if (PagesForTokens(new_length) > config_.num_pages) {
    return absl::InvalidArgumentError(absl::StrCat(
        "n: ", n, " rows would make layer ", layer, " ", new_length,
        " tokens long; the whole cache holds ", config_.num_pages * kPageSize));
  }
  return absl::OkStatus();
}

absl::Status KvCacheManager::PreparePages(Sequence* seq, int layer, int n) {
  const int64_t length = seq->lengths[layer];
  const int64_t first = length / kPageSize;               // first page written
  const int64_t end = PagesForTokens(length + n);         // one past the last
  const int64_t present = static_cast<int64_t>(seq->block_table.size());

  // Count everything first so running out changes nothing.
  int64_t need = std::max<int64_t>(0, end - present);
  for (int64_t i = first; i < std::min(end, present); ++i) {
    if (refcount_[seq->block_table[i]] > 1 || keyed_[seq->block_table[i]]) ++need;
  }
  if (need > free_pages()) return OutOfPages(need, free_pages());

  // Copy-on-write. A copy leaves the sequence's contents as they were, so one that
  // succeeded before a later storage failure needs no undoing.
  for (int64_t i = first; i < std::min(end, present); ++i) {
    const int32_t old_page = seq->block_table[i];
    if (refcount_[old_page] == 1 && !keyed_[old_page]) continue;  // a published page stays as its key says
    const int32_t copy = AllocPage();
    if (storage_ != nullptr) {
      if (absl::Status s = storage_->CopyPage(old_page, copy); !s.ok()) {
        Unref(copy);
        return s;
      }
    }
    seq->block_table[i] = copy;
    Unref(old_page);
  }
  if (end > present) {
    // Grow geometrically so a long decode reallocates the table O(log n) times.
    if (static_cast<size_t>(end) > seq->block_table.capacity()) {
      seq->block_table.reserve(std::max<size_t>(static_cast<size_t>(end),
                                                2 * seq->block_table.capacity()));
    }
    for (int64_t i = present; i < end; ++i) seq->block_table.push_back(AllocPage());
  }
  return absl::OkStatus();
}

void KvCacheManager::TrimTable(Sequence* seq) {
  const size_t needed = static_cast<size_t>(PagesForTokens(MaxLength(seq->lengths)));
  while (seq->block_table.size() > needed) {
    Unref(seq->block_table.back());
    seq->block_table.pop_back();
  }
}

absl::Status KvCacheManager::Append(Sequence* seq, int layer, const void* rows, int n) {
  if (absl::Status s = CheckAppend(seq, layer, n); !s.ok()) return s;
  if (rows == nullptr) return absl::InvalidArgumentError("rows: null");
  if (storage_ == nullptr) {
    return absl::FailedPreconditionError("kv cache: Append needs a storage");
  }
  if (absl::Status s = PreparePages(seq, layer, n); !s.ok()) return s;

  const char* src = static_cast<const char*>(rows);
  int64_t pos = seq->lengths[layer];
  int left = n;
  while (left > 0) {
    const int row = static_cast<int>(pos % kPageSize);
    const int run = std::min(left, kPageSize - row);
    const int32_t page = seq->block_table[pos / kPageSize];
    if (absl::Status s = storage_->WriteRows(layer, page, row, run, src); !s.ok()) {
      TrimTable(seq);  // gives back the pages this append added
      return s;
    }
    src += run * config_.input_row_bytes();  // the storage quantizes fp8 rows as it writes
    pos += run;
    left -= run;
  }
  seq->lengths[layer] = pos;
  PublishFull(seq);
  return absl::OkStatus();
}

absl::Status KvCacheManager::ReserveAppend(Sequence* seq, int layer, int n,
                                           AppendSlot* slots, int* num_slots) {
  if (absl::Status s = CheckAppend(seq, layer, n); !s.ok()) return s;
  if (slots == nullptr || num_slots == nullptr) {
    return absl::InvalidArgumentError("slots: null");
  }
  if (absl::Status s = PreparePages(seq, layer, n); !s.ok()) return s;

  int64_t pos = seq->lengths[layer];
  int left = n;
  int count = 0;
  while (left > 0) {
    const int row = static_cast<int>(pos % kPageSize);
    const int run = std::min(left, kPageSize - row);
    slots[count++] = AppendSlot{seq->block_table[pos / kPageSize], row, run};
    pos += run;
    left -= run;
  }
  seq->lengths[layer] = pos;
  *num_slots = count;
  return absl::OkStatus();
}

absl::Status KvCacheManager::ReadStoredRows(const Sequence* seq, int layer, int64_t first_row, int64_t n,
                                            void* dst, bool synchronize) const {
  if (seq == nullptr) return absl::InvalidArgumentError("sequence: null");
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: ", layer, " is out of range [0, ", config_.num_layers, ")"));
  }
  if (first_row < 0 || n < 0 || first_row + n > seq->lengths[layer]) {
    return absl::InvalidArgumentError(absl::StrCat("rows: [", first_row, ", ", first_row + n,
                                                   ") are not below layer ", layer, "'s length ",
                                                   seq->lengths[layer]));
  }
  if (storage_ == nullptr) return absl::FailedPreconditionError("kv cache: reading rows needs a storage");
  char* out = static_cast<char*>(dst);
  for (int64_t pos = first_row, end = first_row + n; pos < end;) {
    const int row = static_cast<int>(pos % kPageSize);
    const int run = static_cast<int>(std::min<int64_t>(end - pos, kPageSize - row));
    if (absl::Status s = storage_->ReadRowsAsync(layer, seq->block_table[pos / kPageSize], row, run, out); !s.ok()) {
      return s;
    }
    out += run * config_.row_bytes();
    pos += run;
  }
  return synchronize ? storage_->SynchronizeReads() : absl::OkStatus();
}

std::vector<PageKey> KvCacheManager::PublishedKeys(const Sequence* seq) const {
  std::vector<PageKey> keys;
  const size_t full = static_cast<size_t>(MinLength(seq->lengths) / kPageSize);
  for (size_t i = 0; i < full && i < seq->block_table.size() && keyed_[seq->block_table[i]]; ++i) {
    keys.push_back(key_of_[seq->block_table[i]]);
  }
  return keys;
}

absl::StatusOr<Sequence*> KvCacheManager::BeginImport(const std::vector<int64_t>& lengths,
                                                      const std::vector<PageKey>& keys) {
  if (lengths.size() != static_cast<size_t>(config_.num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("lengths: expected ", config_.num_layers, " layers, got ", lengths.size()));
  }
  for (size_t l = 0; l < lengths.size(); ++l) {
    if (lengths[l] < 0 || PagesForTokens(lengths[l]) > config_.num_pages) {
      return absl::InvalidArgumentError(absl::StrCat("lengths[", l, "]: expected 0 to ",
                                                     config_.num_pages * kPageSize, " rows, got ", lengths[l]));
    }
  }
  const int64_t full = MinLength(lengths) / kPageSize;
  if (static_cast<int64_t>(keys.size()) > full) {
    return absl::InvalidArgumentError(absl::StrCat("page_keys: ", keys.size(), " keys for ", full,
                                                   " pages full in every layer"));
  }
  // The leading pages the cache holds are attached, as CreateSequence does; counted
  // first, so a refusal changes nothing (attaching a cached page takes it off the
  // free count).
  int64_t attach = 0, attach_cached = 0;
  for (const PageKey& key : keys) {
    auto it = by_key_.find(key);
    if (it == by_key_.end()) break;
    const int32_t page = it->second;
    if (refcount_[page] == 0) {
      if (cache_prev_[page] < 0 && cache_head_ != page) break;  // retiring
      ++attach_cached;
    }
    ++attach;
  }
  const int64_t total = PagesForTokens(MaxLength(lengths));
  const int64_t need = total - attach;
  if (need > free_pages() - attach_cached) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "lengths: the sequence needs ", need, " pages, the kv cache has ", free_pages() - attach_cached, " free",
        attach > 0 ? absl::StrCat(" (", attach, " more pages found in the prefix cache)") : ""));
  }
  auto seq = std::make_unique<Sequence>();
  seq->lengths = lengths;
  seq->keys = keys;
  seq->block_table.reserve(static_cast<size_t>(total));
  for (int64_t i = 0; i < attach; ++i) {
    const int32_t page = by_key_.find(keys[i])->second;
    if (refcount_[page] == 0) CacheUnlink(page);
    ++refcount_[page];
    seq->block_table.push_back(page);
  }
  seq->published = static_cast<size_t>(attach);
  seq->prefix_tokens = attach * kPageSize;
  prefix_hits_ += static_cast<uint64_t>(attach);
  for (int64_t i = attach; i < total; ++i) seq->block_table.push_back(AllocPage());
  high_water_ = std::max(high_water_, config_.num_pages - free_pages());
  Sequence* raw = seq.get();
  pending_.emplace(raw, std::move(seq));
  return raw;
}

absl::Status KvCacheManager::WriteImportRows(Sequence* pending, int layer, int64_t first_row, int64_t n,
                                             const void* rows) {
  if (!pending_.contains(pending)) return absl::InvalidArgumentError("sequence: not a pending import");
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: ", layer, " is out of range [0, ", config_.num_layers, ")"));
  }
  if (first_row < 0 || n < 0 || first_row + n > pending->lengths[layer]) {
    return absl::InvalidArgumentError(absl::StrCat("rows: [", first_row, ", ", first_row + n,
                                                   ") are not below layer ", layer, "'s length ",
                                                   pending->lengths[layer]));
  }
  if (n > 0 && rows == nullptr) return absl::InvalidArgumentError("rows: null");
  if (storage_ == nullptr) return absl::FailedPreconditionError("kv cache: writing rows needs a storage");
  const char* src = static_cast<const char*>(rows);
  for (int64_t pos = first_row, end = first_row + n; pos < end;) {
    const int row = static_cast<int>(pos % kPageSize);
    const int run = static_cast<int>(std::min<int64_t>(end - pos, kPageSize - row));
    if (pos < pending->prefix_tokens) {  // an attached page: its key says it holds these rows
      src += run * config_.row_bytes();
      pos += run;
      continue;
    }
    // The other pages are the pending sequence's own (reserved fresh, unkeyed): no copy-on-write.
    if (absl::Status s = storage_->WriteStoredRows(layer, pending->block_table[pos / kPageSize], row, run, src);
        !s.ok()) {
      return s;
    }
    src += run * config_.row_bytes();
    pos += run;
  }
  return absl::OkStatus();
}

absl::StatusOr<Sequence*> KvCacheManager::CommitImport(Sequence* pending, absl::string_view id,
                                                       const std::vector<PageKey>& keys, uint64_t serial) {
  auto it = pending_.find(pending);
  if (it == pending_.end()) return absl::InvalidArgumentError("sequence: not a pending import");
  if (keys.size() > pending->block_table.size()) {
    return absl::InvalidArgumentError(absl::StrCat("page_keys: ", keys.size(), " keys for a sequence of ",
                                                   pending->block_table.size(), " pages"));
  }
  if (pending->published > 0 &&
      (keys.size() < pending->published || !std::equal(keys.begin(), keys.begin() + pending->published,
                                                       pending->keys.begin()))) {
    return absl::InvalidArgumentError("page_keys: expected the keys BeginImport attached pages by");
  }
  absl::StatusOr<std::string> new_id = NewId(id, "sequence_id");
  if (!new_id.ok()) return new_id.status();
  std::unique_ptr<Sequence> seq = std::move(it->second);
  pending_.erase(it);
  seq->id = *std::move(new_id);
  seq->last_used = absl::Now();
  seq->serial = serial != 0 ? serial : next_serial_++;
  seq->keys = keys;  // published (the attached ones) and prefix_tokens stay BeginImport's
  PublishFull(seq.get());
  Sequence* raw = seq.get();
  sequences_.emplace(raw->id, std::move(seq));
  Touch(raw, raw->last_used);
  return raw;
}

void KvCacheManager::AbortImport(Sequence* pending) {
  auto it = pending_.find(pending);
  if (it == pending_.end()) return;
  for (int32_t page : it->second->block_table) Unref(page);
  pending_.erase(it);
}

void KvCacheManager::TruncateLayer(Sequence* seq, int layer, int64_t new_length) {
  if (seq == nullptr || layer < 0 || layer >= config_.num_layers) return;
  int64_t& length = seq->lengths[layer];
  length = std::clamp<int64_t>(new_length, 0, length);
  TrimTable(seq);
}

const std::vector<int32_t>& KvCacheManager::BlockTable(const Sequence* seq) const {
  return seq->block_table;
}

int64_t KvCacheManager::Length(const Sequence* seq, int layer) const {
  if (layer < 0 || layer >= config_.num_layers) return 0;
  return seq->lengths[layer];
}

const std::vector<int64_t>& KvCacheManager::Lengths(const Sequence* seq) const {
  return seq->lengths;
}

const std::string& KvCacheManager::Id(const Sequence* seq) const { return seq->id; }

int64_t KvCacheManager::PagesOf(const Sequence* seq) const {
  return static_cast<int64_t>(seq->block_table.size());
}

absl::Time KvCacheManager::LastUsed(const Sequence* seq) const { return seq->last_used; }

void KvCacheManager::LruUnlink(Sequence* seq) {
  if (seq->lru_prev != nullptr) seq->lru_prev->lru_next = seq->lru_next; else if (lru_head_ == seq) lru_head_ = seq->lru_next;
  if (seq->lru_next != nullptr) seq->lru_next->lru_prev = seq->lru_prev; else if (lru_tail_ == seq) lru_tail_ = seq->lru_prev;
  seq->lru_prev = seq->lru_next = nullptr;
}

void KvCacheManager::LruInsertAfter(Sequence* pos, Sequence* seq) {
  seq->lru_prev = pos;
  seq->lru_next = pos != nullptr ? pos->lru_next : lru_head_;
  if (seq->lru_prev != nullptr) seq->lru_prev->lru_next = seq; else lru_head_ = seq;
  if (seq->lru_next != nullptr) seq->lru_next->lru_prev = seq; else lru_tail_ = seq;
}

void KvCacheManager::Touch(Sequence* seq, absl::Time now) {
  seq->last_used = now;
  LruUnlink(seq);
  // Callers read the clock before taking their lock, so touches arrive slightly out of
  // order; a short walk back absorbs that without making a clock step cost O(n).
  constexpr int kMaxWalkBack = 8;
  Sequence* pos = lru_tail_;
  for (int i = 0; i < kMaxWalkBack && pos != nullptr && pos->last_used > now; ++i) pos = pos->lru_prev;
  if (pos != nullptr && pos->last_used > now) pos = lru_tail_;  // gave up: by touch order
  LruInsertAfter(pos, seq);
}

std::vector<std::string> KvCacheManager::IdleSequences(absl::Time cutoff, size_t max) const {
  std::vector<std::string> ids;
  for (const Sequence* s = lru_head_; s != nullptr && s->last_used < cutoff && ids.size() < max; s = s->lru_next)
    ids.push_back(s->id);
  return ids;
}

int KvCacheManager::ReleaseIdle(absl::Time cutoff, int max) {
  int released = 0;
  while (released < max && lru_head_ != nullptr && lru_head_->last_used < cutoff) {
    auto it = sequences_.find(lru_head_->id);
    for (int32_t page : it->second->block_table) Unref(page);
    LruUnlink(it->second.get());
    sequences_.erase(it);
    ++released;
  }
  return released;
}

uint64_t KvCacheManager::Serial(const Sequence* seq) const { return seq->serial; }

int64_t KvCacheManager::SharedPagesOf(const Sequence* seq) const {
  int64_t shared = 0;
  for (int32_t page : seq->block_table) shared += refcount_[page] > 1 ? 1 : 0;
  return shared;
}

KvCacheManager::Stats KvCacheManager::GetStats() const {
  Stats s;
  s.total_pages = config_.num_pages;
  s.free_pages = free_pages();
  s.retiring_pages = retiring_pages();
  s.used_pages = s.total_pages - s.free_pages - s.retiring_pages;
  s.cached_pages = cached_count_;
  s.keyed_pages = static_cast<int64_t>(by_key_.size());
  s.prefix_hits = prefix_hits_;
  s.prefix_misses = prefix_misses_;
  s.evictions = evictions_;
  s.high_water_pages = high_water_;
  s.sequences = static_cast<int64_t>(sequences_.size());
  return s;
}

int32_t KvCacheManager::RefCount(int32_t page) const {
  if (page < 0 || page >= config_.num_pages) return 0;
  return refcount_[page];
}

absl::Status KvCacheManager::CheckConsistency() const {
  std::vector<int32_t> refs(refcount_.size(), 0);
  for (const auto& [id, seq] : sequences_) {
    if (seq->id != id) {
      return absl::InternalError(absl::StrCat("sequence ", Quote(id), " is keyed wrongly"));
    }
    if (seq->lengths.size() != static_cast<size_t>(config_.num_layers)) {
      return absl::InternalError(absl::StrCat("sequence ", Quote(id), " has ",
                                              seq->lengths.size(), " layer lengths"));
    }
    for (int64_t l : seq->lengths) {
      if (l < 0) return absl::InternalError(absl::StrCat("sequence ", Quote(id), ": length ", l));
    }
    const int64_t want = PagesForTokens(MaxLength(seq->lengths));
    if (static_cast<int64_t>(seq->block_table.size()) != want) {
      return absl::InternalError(absl::StrCat("sequence ", Quote(id), " holds ",
                                              seq->block_table.size(), " pages, needs ", want));
    }
    for (int32_t page : seq->block_table) {
      if (page < 0 || page >= config_.num_pages) {
        return absl::InternalError(
            absl::StrCat("sequence ", Quote(id), " holds out-of-range page ", page));
      }
      ++refs[page];
    }
  }
  for (const auto& [ptr, seq] : pending_) {
    if (seq->block_table.size() != static_cast<size_t>(PagesForTokens(MaxLength(seq->lengths)))) {
      return absl::InternalError(absl::StrCat("a pending import holds ", seq->block_table.size(), " pages"));
    }
    for (int32_t page : seq->block_table) {
      if (page < 0 || page >= config_.num_pages) {
        return absl::InternalError(absl::StrCat("a pending import holds out-of-range page ", page));
      }
      ++refs[page];
    }
  }
  size_t listed = 0;
  for (const Sequence* s = lru_head_; s != nullptr; s = s->lru_next) {
    if (++listed > sequences_.size() || Find(s->id) != s ||
        (s->lru_next == nullptr ? lru_tail_ != s : s->lru_next->lru_prev != s)) {
      return absl::InternalError(absl::StrCat("last-use list is broken at sequence ", Quote(s->id)));
    }
  }
  if (listed != sequences_.size()) {
    return absl::InternalError(
        absl::StrCat("last-use list holds ", listed, " of ", sequences_.size(), " sequences"));
  }
  int64_t used = 0;
  for (size_t p = 0; p < refs.size(); ++p) {
    if (refs[p] != refcount_[p]) {
      return absl::InternalError(absl::StrCat("page ", p, ": refcount ", refcount_[p],
                                              " but ", refs[p], " table references"));
    }
    if (refs[p] > 0) ++used;
  }
  std::vector<bool> on_free_list(refcount_.size(), false);
  for (int32_t page : free_list_) {
    if (page < 0 || page >= config_.num_pages) {
      return absl::InternalError(absl::StrCat("free list holds out-of-range page ", page));
    }
    if (on_free_list[page]) {
      return absl::InternalError(absl::StrCat("page ", page, " is on the free list twice"));
    }
    if (refcount_[page] != 0) {
      return absl::InternalError(
          absl::StrCat("page ", page, " is on the free list with refcount ", refcount_[page]));
    }
    on_free_list[page] = true;
  }
  int64_t cached = 0;
  for (int32_t p = cache_head_, prev = -1; p >= 0; prev = p, p = cache_next_[p]) {
    if (++cached > cached_count_ || cache_prev_[p] != prev || on_free_list[p] || refcount_[p] != 0 || !keyed_[p]) {
      return absl::InternalError(absl::StrCat("cached page ", p, " is listed wrongly (free, referenced or keyless)"));
    }
    if (cache_next_[p] < 0 && cache_tail_ != p) return absl::InternalError("cached pages' list has a wrong tail");
    on_free_list[p] = true;
  }
  if (cached != cached_count_) {
    return absl::InternalError(absl::StrCat("cached pages' list holds ", cached, " of ", cached_count_));
  }
  int64_t keyed = 0;
  for (size_t p = 0; p < keyed_.size(); ++p) {
    if (!keyed_[p]) continue;
    ++keyed;
    auto it = by_key_.find(key_of_[p]);
    if (it == by_key_.end() || it->second != static_cast<int32_t>(p)) {
      return absl::InternalError(absl::StrCat("page ", p, " has a key the cache does not map to it"));
    }
  }
  if (keyed != static_cast<int64_t>(by_key_.size())) {
    return absl::InternalError(absl::StrCat(by_key_.size(), " keys for ", keyed, " keyed pages"));
  }
  uint64_t last = 0;
  for (const Retiring& r : retiring_) {
    if (r.page < 0 || r.page >= config_.num_pages || on_free_list[r.page] || refcount_[r.page] != 0) {
      return absl::InternalError(absl::StrCat("retiring page ", r.page, " is out of range, free or referenced"));
    }
    if (r.after_read < last || r.after_read <= reads_closed_ || r.after_read > reads_opened_) {
      return absl::InternalError(absl::StrCat("retiring page ", r.page, " waits for read ", r.after_read,
                                              " (closed up to ", reads_closed_, ", opened ", reads_opened_, ")"));
    }
    last = r.after_read;
    on_free_list[r.page] = true;
  }
  if (used + free_pages() + retiring_pages() != config_.num_pages) {  // free_pages() counts the cached
    return absl::InternalError(absl::StrCat(used, " used + ", free_pages(), " free + ", retiring_pages(),
                                            " retiring pages != ", config_.num_pages, " total"));
  }
  if (high_water_ < used || high_water_ > config_.num_pages) {
    return absl::InternalError(
        absl::StrCat("high water ", high_water_, " outside [", used, ", ", config_.num_pages, "]"));
  }
  return absl::OkStatus();
}

}  // namespace latentd::engine::kv
