// Exact CPU implementation of MLA decode: fp32 accumulation, the same layouts and edge
// cases as the CUDA kernel (no keys: out 0, lse -inf). It is the oracle of every kernel
// test and the engine's CPU backend, so it runs on a fixed pool of threads with
// scratch that is reused across calls.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/params.h"

namespace latentd::kernels {

class CpuMlaDecoder {
 public:
  // num_threads <= 0 uses every hardware thread.
  explicit CpuMlaDecoder(int num_threads = 0);
  ~CpuMlaDecoder();
  CpuMlaDecoder(const CpuMlaDecoder&) = delete;
  CpuMlaDecoder& operator=(const CpuMlaDecoder&) = delete;

  // Host pointers. Not thread-safe: one Run at a time per decoder.
  Status Run(const MlaDecodeParams& p);

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Sizes every buffer for calls of up to max_batch sequences, h_kv KV heads and
  // max_rows query rows per KV head ((h_q / h_kv) * s_q): a Run within those bounds then
  // allocates nothing, whatever its split plan (the serving hot path reserves once).
  void Reserve(int max_batch, int h_kv, int max_rows, bool fp8);

  // The inner loops exist for AVX2+FMA and for any x86-64, chosen by the CPU; tests
  // force the portable one to check it on AVX2 hosts too (process-wide).
  static void ForceGenericCodeForTesting(bool force);
  static bool UsesAvx2();

  // Keys per split-K partition when a call has fewer (sequence, KV head) items than
  // threads; exposed for tests so that small inputs exercise the split path.
  void set_min_keys_per_split(int keys) { min_keys_per_split_ = keys; }

 private:
  struct WorkItem {
    int batch;
    int kv_head;
    int key_begin;
    int key_end;
    int partial;  // index into partial storage, or -1 to write out/lse directly
  };
  struct Scratch {
    std::vector<float> q;       // [rows, 576], pre-scaled
    std::vector<float> k;       // [64, 576]
    std::vector<uint16_t> kv16;  // [64, 576] dequantized rows of an fp8 cache
    std::vector<float> scores;  // [rows, 64]
    std::vector<float> acc;     // [rows, 512]
    std::vector<float> m, l;    // [rows]
    std::vector<int> limit, visible;  // [rows] keys each row may see
  };

  void Grow(int pairs, int rows, int partials, bool fp8);
  void ParallelFor(int n, const std::function<void(int, int)>& fn);  // fn(index, thread)
  void WorkerLoop(int thread);
  void RunItem(const MlaDecodeParams& p, const WorkItem& item, Scratch& s);
  void CombineItem(const MlaDecodeParams& p, int batch, int kv_head, int first_partial, int num_partials);

  int min_keys_per_split_ = 2048;
  std::vector<std::thread> workers_;
  std::vector<Scratch> scratch_;
  std::vector<WorkItem> items_;
  std::vector<int> combine_first_;  // per (batch, kv head): first partial, or -1
  std::vector<int> combine_count_;
  std::vector<float> partial_acc_;  // [partials, rows, 512]
  std::vector<float> partial_ml_;   // [partials, rows, 2] (max, sum)

  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int, int)>* job_ = nullptr;
  int job_size_ = 0;
  std::atomic<int> next_{0};
  int generation_ = 0;
  int busy_ = 0;
  bool stop_ = false;
};

}  // namespace latentd::kernels
