// Sequences and the pages they own: per-layer lengths, one block table shared by the
// layers, reference-counted pages with copy-on-write forks, all-or-nothing appends, and
// the prefix cache (full pages named by a client's content key, reused by reference).
// Bookkeeping only (bytes go through KvStorage); not thread-safe: the engine serialises.
#pragma once

#include <cstdint>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/kv/config.h"
#include "engine/kv/storage.h"

namespace latentd::engine::kv {

// One sequence's state. Opaque: read it through KvCacheManager. The pointer stays valid
// until the sequence is released.
struct Sequence;

// A contiguous run of rows inside one logical page.
struct AppendSlot {
  int32_t page = 0;  // logical page id (add config.PageOffset(layer) for the storage page)
  int row = 0;       // first row in the page
  int n = 0;         // rows
};

// A full page's content key: 128 bits of a hash chain over the page's token ids and its
// predecessors' (computed by clients; the server only compares keys). 128 bits so that
// two different prefixes never meet by chance.
struct PageKey {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool operator==(const PageKey& o) const { return hi == o.hi && lo == o.lo; }
  template <typename H>
  friend H AbslHashValue(H h, const PageKey& k) {
    return H::combine(std::move(h), k.hi, k.lo);
  }
};

// Sequence ids: 1 to 128 characters of [A-Za-z0-9._:-].
inline constexpr int kMaxSequenceIdLength = 128;
absl::Status ValidateSequenceId(absl::string_view id, absl::string_view field = "sequence_id");

class KvCacheManager {
 public:
  // `storage` may be null for pure bookkeeping: page copies are then skipped and Append
  // fails with FAILED_PRECONDITION. `config` must be valid (KvCacheConfig::Validate) and
  // match the storage's.
  KvCacheManager(const KvCacheConfig& config, KvStorage* storage);
  // The checked way to build one: INVALID_ARGUMENT for a bad config or a storage of
  // another shape.
  static absl::StatusOr<std::unique_ptr<KvCacheManager>> Create(const KvCacheConfig& config,
                                                                KvStorage* storage);
  ~KvCacheManager();
  KvCacheManager(const KvCacheManager&) = delete;
  KvCacheManager& operator=(const KvCacheManager&) = delete;

  const KvCacheConfig& config() const { return config_; }
  KvStorage* storage() const { return storage_; }

  // "" makes an unguessable id (128 random bits from the OS, as 32 hex digits).
  // ALREADY_EXISTS for a taken id, INVALID_ARGUMENT for a malformed one. Holds no pages
  // until the first append.
  absl::StatusOr<Sequence*> CreateSequence(absl::string_view id);
  // The same, with the content keys of the prefix's full pages, in order. Every leading
  // page whose key the cache holds (a live sequence's, or an unreferenced cached one) is
  // attached by reference and all layers start that many pages long
  // (PrefixTokens); the rest of the keys name the pages this sequence fills next, and
  // each is published once every layer has filled its page through Append (rows that
  // ReserveAppend hands to a backend are never published: they may be unwritten). At
  // most config().num_pages keys (INVALID_ARGUMENT, field "page_keys", otherwise).
  absl::StatusOr<Sequence*> CreateSequence(absl::string_view id, const std::vector<PageKey>& keys);
  // Rows per layer that CreateSequence found in the cache (a multiple of 64).
  int64_t PrefixTokens(const Sequence* seq) const;
  // nullptr if unknown.
  Sequence* Find(absl::string_view id);
  const Sequence* Find(absl::string_view id) const;
  // A new sequence with the same lengths and rows. Pages that every layer has filled
  // are shared; the others (the partly filled tail) are copied, so neither sequence
  // ever writes into a shared page. NOT_FOUND for an unknown id; new_id as in
  // CreateSequence (field "new_sequence_id"); RESOURCE_EXHAUSTED when the copies do not
  // fit, changing nothing. The copies are issued now (on the storage's stream): rows
  // reserved by ReserveAppend but not yet written are copied as they are at that point,
  // so fork a sequence only when its reserved rows have been written (or enqueued
  // earlier on the same stream).
  absl::StatusOr<Sequence*> Fork(absl::string_view id, absl::string_view new_id);
  // Drops the sequence; returns the pages actually freed (those no fork still holds).
  absl::StatusOr<int64_t> Release(absl::string_view id);

  // Appends n rows (n * input_row_bytes of host memory) to one layer, through the storage.
  // All or nothing: RESOURCE_EXHAUSTED ("kv cache: out of pages: need X, free Y") and
  // no change when pages run out. A shared page about to be written is copied first.
  absl::Status Append(Sequence* seq, int layer, const void* rows, int n);
  // The decode path's two-phase append: reserves the pages (copy-on-write included),
  // commits the new length and writes into `slots` where the rows go, in order; the
  // backend writes the rows itself (for example one device scatter for the batch).
  // Copy-on-write copies are issued now through the storage, so on CUDA they precede
  // anything enqueued later on its stream. `slots` must hold MaxAppendSlots(n) entries.
  // Allocates nothing beyond amortised growth of the sequence's block table, which may
  // move it: read BlockTable() after the last reservation touching the sequence.
  absl::Status ReserveAppend(Sequence* seq, int layer, int n, AppendSlot* slots,
                             int* num_slots);
  // Most runs n rows can span: ceil((63 + n) / 64), which is at most ceil(n / 64) + 1.
  static constexpr int MaxAppendSlots(int n) { return (n + 2 * kPageSize - 2) / kPageSize; }
  // Sets a layer's length back to new_length (clamped to [0, Length]), freeing pages no
  // layer needs any more; undoes a ReserveAppend whose step failed. Rows past the new
  // length are garbage and later appends overwrite them.
  void TruncateLayer(Sequence* seq, int layer, int64_t new_length);

  // Export and import (docs/export-import.md). ReadStoredRows copies rows
  // [first_row, first_row + n) of a layer, as stored (n * row_bytes), into host memory;
  // INVALID_ARGUMENT when they are not all below the layer's length.
  // With synchronize = false the rows are complete only after storage()->SynchronizeReads()
  // (several reads then share one wait).
  absl::Status ReadStoredRows(const Sequence* seq, int layer, int64_t first_row, int64_t n, void* dst,
                              bool synchronize = true) const;
  // The published content keys of the sequence's leading pages: page i's while every
  // page before it has one and every layer has filled it.
  std::vector<PageKey> PublishedKeys(const Sequence* seq) const;
  // An import builds a sequence out of sight. BeginImport reserves every page the
  // lengths need up front (RESOURCE_EXHAUSTED naming "lengths", nothing taken, when the
  // free pages cannot hold them) and returns a pending sequence of those lengths that
  // Find, the idle list and num_sequences do not see. WriteImportRows fills its rows as
  // stored; CommitImport gives it its id (as CreateSequence: ALREADY_EXISTS or
  // INVALID_ARGUMENT, and then the import stays pending) and publishes `keys` for its
  // leading full pages; AbortImport gives its pages back. A pending sequence is passed
  // to nothing else.
  // With the sequence's page keys (at most one per page full in every layer: INVALID_
  // ARGUMENT naming "page_keys" otherwise), every leading page the prefix cache holds is
  // attached by reference instead of reserved (PrefixTokens says how many rows), and
  // WriteImportRows skips those rows; CommitImport must then get the same keys.
  absl::StatusOr<Sequence*> BeginImport(const std::vector<int64_t>& lengths,
                                        const std::vector<PageKey>& keys = {});
  absl::Status WriteImportRows(Sequence* pending, int layer, int64_t first_row, int64_t n, const void* rows);
  // serial != 0 gives the sequence that Serial instead of a new one: a sequence brought
  // back from the host tier stays the same sequence for exports begun before it moved.
  absl::StatusOr<Sequence*> CommitImport(Sequence* pending, absl::string_view id, const std::vector<PageKey>& keys,
                                         uint64_t serial = 0);
  void AbortImport(Sequence* pending);
  int64_t pending_imports() const { return static_cast<int64_t>(pending_.size()); }

  // Logical page ids, shared by every layer: layer l's storage pages are these plus
  // config().PageOffset(l). Its size is ceil(max layer length / 64).
  const std::vector<int32_t>& BlockTable(const Sequence* seq) const;
  int64_t Length(const Sequence* seq, int layer) const;  // 0 for a layer out of range
  const std::vector<int64_t>& Lengths(const Sequence* seq) const;
  const std::string& Id(const Sequence* seq) const;
  int64_t PagesOf(const Sequence* seq) const;

  // For idle-TTL release. New sequences are stamped with absl::Now(); the manager reads
  // the clock nowhere else, so callers Touch on use. Sequences sit on a list in order of
  // last use (Touch moves one to the end, a fork goes next to its source), so finding
  // the idle ones costs O(found), not a scan and sort of every sequence. A Touch with a
  // time earlier than the newest on the list walks back a few places to keep the order;
  // past that (clock steps) the order is by touch, and a sequence behind a newer one is
  // released late by at most that inversion, never early.
  absl::Time LastUsed(const Sequence* seq) const;
  void Touch(Sequence* seq, absl::Time now);
  // Ids of up to `max` sequences last used before `cutoff`, least recently used first.
  std::vector<std::string> IdleSequences(absl::Time cutoff, size_t max = SIZE_MAX) const;
  // Releases up to `max` sequences last used before `cutoff`, least recently used
  // first; returns how many. O(released + their pages).
  int ReleaseIdle(absl::Time cutoff, int max);

  int64_t num_sequences() const { return static_cast<int64_t>(sequences_.size()); }
  // A number unique to this sequence for the manager's lifetime: tells a sequence from
  // a later one created under the same id (and maybe at the same address).
  uint64_t Serial(const Sequence* seq) const;
  // Pages of the sequence's table that another sequence also references.
  int64_t SharedPagesOf(const Sequence* seq) const;

  // Reads outside the manager's lock. A batch reads pages through tables it looked up
  // under the engine's lock and keeps reading after the lock is dropped, so a page
  // freed meanwhile (a release, a fork's last reference going away) must not be handed
  // out again until that read is over. OpenRead marks such a read; pages freed while
  // any read is open wait ("retiring") until every read opened before the free has
  // closed. Reads close in the order they opened; CloseRead takes the id OpenRead gave.
  uint64_t OpenRead();
  void CloseRead(uint64_t read);
  int64_t retiring_pages() const { return static_cast<int64_t>(retiring_.size()); }

  struct Stats {
    int64_t total_pages = 0;
    int64_t free_pages = 0;      // ready to hand out
    int64_t retiring_pages = 0;  // freed, waiting for open reads to close
    int64_t used_pages = 0;      // held by sequences
    int64_t high_water_pages = 0;  // most pages ever used at once
    int64_t sequences = 0;
    // The prefix cache. Cached pages are unreferenced but keep their rows and key; they
    // count as free (free_pages) and are evicted least recently used when the free
    // list is empty.
    int64_t cached_pages = 0;
    int64_t keyed_pages = 0;      // pages whose key is published (referenced or cached)
    uint64_t prefix_hits = 0;     // pages attached from the cache
    uint64_t prefix_misses = 0;   // keys CreateSequence did not find (the first miss ends the walk)
    uint64_t evictions = 0;       // cached pages handed out again
  };
  Stats GetStats() const;
  // Pages an append may take: the free list and the cached pages.
  int64_t free_pages() const { return static_cast<int64_t>(free_list_.size()) + cached_count_; }
  // References to a logical page (0 = free). For tests and debugging.
  int32_t RefCount(int32_t page) const;
  // Whether the page's content key is published (it is then never written again).
  bool Keyed(int32_t page) const { return page >= 0 && page < config_.num_pages && keyed_[page] != 0; }

  // Recomputes everything derivable and compares: reference counts equal the
  // references from block tables, the free list holds each unreferenced page exactly
  // once, table sizes match lengths. INTERNAL with the first mismatch.
  absl::Status CheckConsistency() const;

 private:
  absl::StatusOr<std::string> NewId(absl::string_view requested, absl::string_view field);
  absl::Status CheckAppend(const Sequence* seq, int layer, int n) const;
  // Makes the pages for rows [Length, Length + n) of `layer` present and private to
  // `seq`: copies shared ones, appends fresh ones. All or nothing for running out.
  absl::Status PreparePages(Sequence* seq, int layer, int n);
  // Drops table entries past what the longest layer needs.
  void TrimTable(Sequence* seq);
  int32_t AllocPage();
  // Drops one reference; returns true when the page became free (or retiring, or cached).
  bool Unref(int32_t page);
  // A page no sequence references and no read may still touch: cached if it has a key,
  // else free.
  void Unreferenced(int32_t page);
  // Publishes the keys of seq's pages that every layer has filled since the last call.
  void PublishFull(Sequence* seq);
  void CacheLink(int32_t page);    // at the most recently used end
  void CacheUnlink(int32_t page);
  void Unkey(int32_t page);

  struct Retiring {
    uint64_t after_read;  // free once reads up to this id have closed
    int32_t page;
  };

  const KvCacheConfig config_;
  KvStorage* const storage_;
  std::vector<int32_t> refcount_;   // per logical page
  std::vector<int32_t> free_list_;  // stack of free page ids
  std::vector<Retiring> retiring_;  // in order of after_read
  uint64_t reads_opened_ = 0, reads_closed_ = 0;
  int64_t high_water_ = 0;
  absl::flat_hash_map<std::string, std::unique_ptr<Sequence>> sequences_;
  absl::flat_hash_map<Sequence*, std::unique_ptr<Sequence>> pending_;  // imports not yet committed
  // Prefix cache: published keys and their pages; per page its key and its place on the
  // list of cached (unreferenced) pages, least recently cached first.
  absl::flat_hash_map<PageKey, int32_t> by_key_;
  std::vector<PageKey> key_of_;
  std::vector<uint8_t> keyed_;
  std::vector<int32_t> cache_prev_, cache_next_;  // -1: none
  int32_t cache_head_ = -1, cache_tail_ = -1;
  int64_t cached_count_ = 0;
  uint64_t prefix_hits_ = 0, prefix_misses_ = 0, evictions_ = 0;
  // Least recently used first (see Touch).
  Sequence* lru_head_ = nullptr;
  Sequence* lru_tail_ = nullptr;
  uint64_t next_serial_ = 1;

  void LruUnlink(Sequence* seq);
  void LruInsertAfter(Sequence* pos, Sequence* seq);  // pos null: at the front
};

}  // namespace latentd::engine::kv
