// Pieces both attention backends share: KV pool sizing and grouping a batch into
// kernel launches by (s_q, causal), since one launch has a single s_q.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/attention_backend.h"
#include "engine/batch.h"
#include "kernels/params.h"

namespace latentd::engine {

// The pool's shape and storage format for `options` (num_pages left 0).
kv::KvCacheConfig PoolShape(const BackendOptions& options);

// Bytes of one logical page (64 tokens of every layer) as the pool stores it.
int64_t PageBytes(const BackendOptions& options);

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

// The entry's block table as physical page ids (its layer's offset added), zero-padded
// to width.
void WritePhysicalTable(const BatchEntry& e, int width, int32_t* row);

// Shapes, dtype, the cache's kv_dtype and contiguous strides (kv strides in the cache's
// elements: bytes for fp8) of one group's launch over a table of `width` pages; the
// caller sets the pointers.
kernels::MlaDecodeParams GroupShape(const ModelConfig& model, const kv::KvCacheConfig& kv, const LaunchGroup& g,
                                    int width);

// Copies each OK entry's rows of out ([tokens, h_q, 512]) and lse ([tokens * h_q], each
// entry's [h_q, s_q] block) into its step, in launch order.
void CopyResults(Batch& batch, const std::vector<int>& order, int h_q, const char* out, const float* lse);

}  // namespace latentd::engine
