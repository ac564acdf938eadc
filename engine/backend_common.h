// Pieces both attention backends share: KV pool sizing and grouping a batch into
// kernel launches by (s_q, causal), since one launch has a single s_q.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/attention_backend.h"
#include "engine/batch.h"

namespace latentd::engine {

// Bytes of one logical page (64 tokens of every layer).
int64_t PageBytes(const ModelConfig& model);

// Pages for the pool from kv_pages, else kv_bytes, else fraction * available_bytes.
absl::StatusOr<int64_t> PoolPages(const BackendOptions& options, int64_t available_bytes);

// A run of batch entries (in launch order) that share one kernel launch.
struct LaunchGroup {
  int s_q = 1;
  bool causal = false;
  int first_entry = 0;  // index into the launch order
  int num_entries = 0;
  int first_token = 0;  // sum of s_q of the entries before it
};

// Orders the OK entries of a batch by (s_q, causal) and cuts them into groups.
// order and groups are reused across calls (no allocation once warm).
void GroupBatch(const Batch& batch, std::vector<int>* order, std::vector<LaunchGroup>* groups);

// Widest block table (in pages) among the OK entries.
int MaxTablePages(const Batch& batch);

}  // namespace latentd::engine
