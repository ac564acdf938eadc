// Client-side check of server results: mirrors every KV row a client uploaded (prefixes
// and decode steps, in the order the server appends them) and recomputes a step with
// the exact CPU implementation (kernels/cpu), then compares within FlashMLA's tolerances.
// Against an fp8 KV cache (ServerInfo.kv_dtype) it mirrors what the server stores: each
// row quantized (QuantizeKvRowFp8) and read back dequantized, as every decoder reads it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/cpu/mla_decode_cpu.h"
#include "kernels/params.h"
#include "proto/latentd.pb.h"

namespace latentd::client {

// count random 16-bit values (uniform in [-1, 1)) in the given dtype, as raw bytes.
std::string RandomHalves(std::mt19937_64& rng, size_t count, kernels::DType dtype);

kernels::DType DTypeOf(const v1::ServerInfo& info);
// kModel for "" (a server from before the field), the model dtype's name or "auto".
kernels::KvDType KvDTypeOf(const v1::ServerInfo& info);

class Reference {
 public:
  // cpu_threads: threads of the CPU decoder used for checks (0: all cores).
  explicit Reference(const v1::ServerInfo& info, int cpu_threads = 2);

  void Append(const std::string& sequence_id, int layer, absl::string_view rows);
  void Fork(const std::string& from, const std::string& to);
  void Erase(const std::string& sequence_id);
  // Drops rows beyond length (a step the server refused did not append its rows).
  void Truncate(const std::string& sequence_id, int layer, int64_t length);
  int64_t Length(const std::string& sequence_id, int layer) const;

  // Expected out [s_q, h_q, 512] and lse [h_q, s_q] of a step over rows [0, end) of the
  // layer, where end counts the step's own new rows (so end = length after the step).
  absl::Status Expected(const std::string& sequence_id, int layer, int64_t end, absl::string_view q, int s_q,
                        bool causal, std::string* out, std::string* lse);

  // OK when the server's out/lse bytes match the expected ones within tolerance; the
  // error says where and by how much they differ.
  absl::Status Compare(absl::string_view got_out, absl::string_view got_lse, absl::string_view want_out,
                       absl::string_view want_lse) const;

  // For a result Compare refused: which one wrong key row would explain it. Tries, for
  // every row k of [0, end) and every page, "k read as zeros", "k left out", "k counted
  // twice", "the page read as zeros" and "one zero key too many" (closed forms over the exact softmax sums, in double), and
  // keeps the best of each with its remaining error beside the error of the result as
  // it is. A stale or misplaced read of one row (e.g. a new row read before it lands)
  // shows as a remainder near the output's rounding for that row. A split-K merge that
  // lost a partition is tried too: for every key range a partition can cover (its size a
  // multiple of 32 keys, the planner's granularity, starting at a multiple of its size),
  // "the range left out and the rest renormalised" (its partial's weight lost too) and
  // "the range's values lost, its weight kept" (a partial read before its stores were
  // visible), each in only the (token, head) rows where it explains more than the result
  // as it is, since a merge fault can hit one row tile and not another. Diagnostics only:
  // O(end x s_q x h_q x 512 x log(end / 32)).
  struct Diagnosis {
    int64_t values = 0, off = 0, not_finite = 0;  // values out of tolerance, and not finite
    double max_error = 0;                          // of the result as it is
    int worst_token = 0, worst_head = 0, worst_dim = 0;
    std::vector<std::pair<int, int>> off_heads;    // (token, head) with a value out of tolerance
    // Per pair of off_heads: its values out of tolerance and the first and last such dim
    // (column chunks of a row point at a merge or a copy, spread values at the keys).
    struct OffDims {
      int values = 0, first = 0, last = 0;
    };
    std::vector<OffDims> off_dims;
    int64_t zeroed_row = -1, missing_row = -1, doubled_row = -1, zeroed_page = -1;
    // What each leaves; extra_zero_key: one key of zeros more than the step has (a row
    // past the end read, unmasked, from a pool still holding zeros).
    double zeroed_row_error = 0, missing_row_error = 0, doubled_row_error = 0, zeroed_page_error = 0,
           extra_zero_key_error = 0;
    // Key ranges [begin, end) of the best split-K explanations, the (token, head) rows
    // they were applied to, and what they leave (over all rows, the others as they are).
    struct KeyRange {
      int64_t begin = -1, end = -1;
      int rows = 0;
      double error = 0;
    };
    KeyRange range_left_out, range_values_lost;
    std::string ToString(int64_t end, int s_q) const;
  };
  absl::StatusOr<Diagnosis> Diagnose(const std::string& sequence_id, int layer, int64_t end, absl::string_view q,
                                     int s_q, bool causal, absl::string_view got_out);

  // Expected + Compare for one result.
  absl::Status Check(const std::string& sequence_id, int layer, int64_t end, absl::string_view q, int s_q,
                     bool causal, const v1::StepResult& result);

 private:
  const kernels::DType dtype_;
  const kernels::KvDType kv_dtype_;
  const int h_q_, h_kv_;
  const float scale_;
  // One sequence's mirrored rows, per layer, under a lock of its own: a check copying
  // one sequence's rows holds up no other sequence's appends.
  struct Rows {
    std::mutex mu;
    std::vector<std::vector<uint16_t>> layers;
  };
  std::shared_ptr<Rows> Find(const std::string& sequence_id) const;  // null when unknown
  // Rows [0, end) of a sequence's layer into dst (end x h_kv x 576 values).
  absl::Status CopyRows(const std::string& sequence_id, int layer, int64_t end, uint16_t* dst) const;
  std::shared_ptr<Rows> FindOrAdd(const std::string& sequence_id);
  mutable std::mutex rows_mu_;  // the map only
  std::map<std::string, std::shared_ptr<Rows>> rows_;
  const int num_layers_;
  std::mutex decoder_mu_;
  std::unique_ptr<kernels::CpuMlaDecoder> decoder_;
};

}  // namespace latentd::client
