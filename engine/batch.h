// One launch's worth of decode steps as the scheduler hands it to an attention
// backend: each entry knows its keys after appending, the KV page offset of its layer,
// where its new rows go and (while staging) its block table.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/types.h"
#include "engine/kv/manager.h"

namespace latentd::engine {

// A step's new rows span at most this many page runs (s_q <= 64 * (kMaxSlots - 1)).
inline constexpr int kMaxAppendSlots = 4;

struct BatchEntry {
  DecodeStep* step = nullptr;
  int64_t seqlen = 0;            // keys the step attends over (after its rows are appended)
  int64_t page_offset = 0;       // layer * num_pages: logical page -> physical page
  const int32_t* table = nullptr;  // logical page ids; valid only during Stage
  kv::Sequence* seq = nullptr;     // the step's sequence; valid only during Stage (under the KV lock)
  int table_pages = 0;
  kv::AppendSlot slots[kMaxAppendSlots];
  int num_slots = 0;
  absl::Status status;           // set by the backend if this entry failed alone
  // Layer steps: the RoPE position of the first token, and (when the step left it to the
  // engine) the layer's length it was computed from, which staging checks.
  int64_t position = 0;
  int64_t expect_length = -1;
};

struct Batch {
  std::vector<BatchEntry> entries;  // capacity reserved once (max_batch_size)
  int slot = 0;                     // double-buffer slot of the backend
  int tokens = 0;                   // sum of s_q
  absl::Time formed_at;
  absl::Time launched_at;
  uint64_t kv_read = 0;             // KvCacheManager::OpenRead while the batch runs
};

}  // namespace latentd::engine
