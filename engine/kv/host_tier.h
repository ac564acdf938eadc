// The host memory tier: offloaded sequences' rows, as the pool stores them, in a
// bounded arena of page-sized blocks allocated once (pinned by the engine on CUDA).
// Bookkeeping and bytes only: the engine decides what moves and when, and serialises
// every call (not thread-safe); a reservation's blocks may be filled or read without
// the engine's lock while the entry is marked busy.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/kv/manager.h"

namespace latentd::engine::kv {

class HostTier {
 public:
  // One offloaded sequence: its lengths, its published page keys, and per layer the
  // blocks holding its rows (block i of layer l holds rows [64 i, 64 i + 64)).
  struct Entry {
    std::string id;
    std::vector<int64_t> lengths;
    std::vector<PageKey> keys;
    std::vector<std::vector<int32_t>> blocks;  // [layer][page] block ids
    absl::Time last_used;                      // the sequence's, when it was offloaded
    uint64_t serial = 0;                       // KvCacheManager::Serial, kept across the move
    bool busy = false;                         // being restored (or read) outside the lock
  };

  struct Stats {
    int64_t capacity_bytes = 0;
    int64_t used_bytes = 0;     // blocks held by entries and reservations
    int64_t sequences = 0;      // committed entries
    uint64_t offloads = 0;      // entries committed
    uint64_t restores = 0;      // entries taken back
    uint64_t refused = 0;       // reservations that did not fit
  };

  // capacity_bytes rounds down to whole blocks of 64 stored rows (64 * row_bytes).
  // RESOURCE_EXHAUSTED when the arena cannot be allocated. 0 blocks is a valid, empty
  // tier that refuses everything.
  static absl::StatusOr<std::unique_ptr<HostTier>> Create(int64_t capacity_bytes, int64_t row_bytes);
  ~HostTier();
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  // The arena, for pinning it (cudaHostRegister) once.
  void* arena() { return arena_; }
  int64_t arena_bytes() const { return int64_t(num_blocks_) * block_bytes_; }
  int64_t block_bytes() const { return block_bytes_; }
  static int64_t BlocksFor(const std::vector<int64_t>& lengths);

  // Blocks for a sequence of these lengths, not yet visible: fill them, then Commit (or
  // Cancel). nullptr, counted as refused, when the free blocks cannot hold them.
  std::unique_ptr<Entry> Reserve(const std::vector<int64_t>& lengths);
  void Cancel(std::unique_ptr<Entry> entry);  // gives the blocks back
  // Makes the entry findable under entry->id (which must not be present).
  void Commit(std::unique_ptr<Entry> entry);

  Entry* Find(absl::string_view id);
  const Entry* Find(absl::string_view id) const;
  // Removes the entry (restored or released) and gives its blocks back.
  void Remove(absl::string_view id, bool restored);

  // Rows [64 page, ...) of one layer's block.
  char* Block(int32_t block) { return arena_ + int64_t(block) * block_bytes_; }
  const char* Block(int32_t block) const { return arena_ + int64_t(block) * block_bytes_; }

  // Ids of entries last used before `cutoff` and not busy (for the idle TTL).
  std::vector<std::string> IdleIds(absl::Time cutoff) const;

  Stats GetStats() const;
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }

 private:
  HostTier(char* arena, int32_t num_blocks, int64_t block_bytes);
  void Free(Entry& e);

  char* const arena_;
  const int32_t num_blocks_;
  const int64_t block_bytes_;
  std::vector<int32_t> free_;  // stack of free block ids
  absl::flat_hash_map<std::string, std::unique_ptr<Entry>> entries_;
  uint64_t offloads_ = 0, restores_ = 0, refused_ = 0;
};

}  // namespace latentd::engine::kv
