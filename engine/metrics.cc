// Engine metrics recorder; see metrics.h.
#include "engine/metrics.h"

#include <algorithm>

namespace latentd::engine {
namespace {

void Percentiles(std::vector<float> v, double* p50, double* p90, double* p99) {
  if (v.empty()) return;
  auto at = [&](double q) {
    const size_t k = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
    std::nth_element(v.begin(), v.begin() + k, v.end());
    return static_cast<double>(v[k]);
  };
  *p50 = at(0.50);
  *p90 = at(0.90);
  *p99 = at(0.99);
}

}  // namespace

EngineMetricsRecorder::EngineMetricsRecorder() {
  absl::MutexLock lock(&mu_);
  wait_us_.reserve(kSamples);
  exec_us_.reserve(kSamples);
  histogram_.assign(16, 0);
  recent_.reserve(kRateWindow);
}

void EngineMetricsRecorder::Reject(RejectReason reason) { rejected_[static_cast<int>(reason)].fetch_add(1); }

void EngineMetricsRecorder::RecordQueueWait(absl::Duration wait) {
  const float us = static_cast<float>(absl::ToDoubleMicroseconds(wait));
  absl::MutexLock lock(&mu_);
  if (wait_us_.size() < kSamples) {
    wait_us_.push_back(us);
  } else {
    wait_us_[wait_next_] = us;
    wait_next_ = (wait_next_ + 1) % kSamples;
  }
}

void EngineMetricsRecorder::RecordBatch(int size, int ok_steps, absl::Duration exec, absl::Time now) {
  const float us = static_cast<float>(absl::ToDoubleMicroseconds(exec));
  absl::MutexLock lock(&mu_);
  if (exec_us_.size() < kSamples) {
    exec_us_.push_back(us);
  } else {
    exec_us_[exec_next_] = us;
    exec_next_ = (exec_next_ + 1) % kSamples;
  }
  int bucket = 0;
  while ((2 << bucket) <= size && bucket + 1 < static_cast<int>(histogram_.size())) ++bucket;
  ++histogram_[bucket];
  if (recent_.size() < kRateWindow) {
    recent_.emplace_back(now, ok_steps);
  } else {
    recent_[recent_next_] = {now, ok_steps};
    recent_next_ = (recent_next_ + 1) % kRateWindow;
  }
  steps_ += ok_steps;
  ++batches_;
}

EngineMetrics EngineMetricsRecorder::Snapshot() const {
  EngineMetrics m;
  m.rejected_queue_full = rejected_[static_cast<int>(RejectReason::kQueueFull)].load();
  m.rejected_invalid = rejected_[static_cast<int>(RejectReason::kInvalid)].load();
  m.rejected_deadline = rejected_[static_cast<int>(RejectReason::kDeadline)].load();
  m.dropped_cancelled = rejected_[static_cast<int>(RejectReason::kCancelled)].load();
  std::vector<float> waits, execs;
  {
    absl::MutexLock lock(&mu_);
    waits = wait_us_;
    execs = exec_us_;
    m.batch_size_histogram = histogram_;
    m.steps_completed = steps_;
    m.batches = batches_;
    // Steps per second over the last 5 seconds of batches.
    const absl::Time now = absl::Now();
    absl::Time oldest = now;
    uint64_t steps = 0;
    for (const auto& [t, n] : recent_) {
      if (now - t > absl::Seconds(5)) continue;
      steps += n;
      oldest = std::min(oldest, t);
    }
    const double span = std::max(absl::ToDoubleSeconds(now - oldest), 1e-3);
    if (steps > 0) m.steps_per_second = static_cast<double>(steps) / span;
  }
  Percentiles(std::move(waits), &m.queue_wait_us_p50, &m.queue_wait_us_p90, &m.queue_wait_us_p99);
  Percentiles(std::move(execs), &m.exec_us_p50, &m.exec_us_p90, &m.exec_us_p99);
  return m;
}

}  // namespace latentd::engine
