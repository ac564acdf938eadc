// Engine metrics: steps/s, batch sizes, queue wait and execution time percentiles and
// rejections by reason. Written by the scheduler thread once per batch; read by the
// server for its status page and logs.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/types.h"

namespace latentd::engine {

enum class RejectReason { kQueueFull, kInvalid, kDeadline, kCancelled };

class EngineMetricsRecorder {
 public:
  EngineMetricsRecorder();

  void Reject(RejectReason reason);
  void RecordQueueWait(absl::Duration wait);
  void RecordBatch(int size, int ok_steps, absl::Duration exec, absl::Time now);
  EngineMetrics Snapshot() const;

 private:
  static constexpr int kSamples = 4096;   // latest samples kept for percentiles
  static constexpr int kRateWindow = 256;  // latest batches kept for steps/s

  std::array<std::atomic<uint64_t>, 4> rejected_{};

  mutable absl::Mutex mu_;
  std::vector<float> wait_us_ ABSL_GUARDED_BY(mu_);
  size_t wait_next_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<float> exec_us_ ABSL_GUARDED_BY(mu_);
  size_t exec_next_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> histogram_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<absl::Time, int>> recent_ ABSL_GUARDED_BY(mu_);
  size_t recent_next_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t batches_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace latentd::engine
