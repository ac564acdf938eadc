// Sharded bounded step queue; see step_queue.h.
#include "engine/step_queue.h"

#include <algorithm>

namespace latentd::engine {

StepQueue::StepQueue(int capacity, int num_shards) : capacity_(capacity), shards_(num_shards) {
  // Each shard can hold the whole capacity so one hot sequence is not refused early;
  // the shared size_ counter enforces the global bound.
  for (auto& s : shards_) {
    absl::MutexLock lock(&s.mu);
    s.ring.resize(capacity);
  }
}

uint64_t StepQueue::Arrival(const DecodeStep* step) {
  return reinterpret_cast<uint64_t>(step->engine_private);
}

absl::Status StepQueue::Push(DecodeStep* step, uint64_t shard_key, bool wake) {
  if (size_.fetch_add(1) >= capacity_) {
    size_.fetch_sub(1);
    return absl::ResourceExhaustedError("decode queue is full (" + std::to_string(capacity_) +
                                        " steps queued); retry later");
  }
  Shard& s = shards_[shard_key % shards_.size()];
  {
    absl::MutexLock lock(&s.mu);
    step->engine_private = reinterpret_cast<void*>(next_arrival_.fetch_add(1, std::memory_order_relaxed));
    s.ring[(s.head + s.count) % s.ring.size()] = step;
    ++s.count;
    in_shards_.fetch_add(1);  // under the shard lock, so a drain never sees it negative
  }
  if (wake && consumer_waiting_.load()) {
    absl::MutexLock lock(&wake_mu_);
    woken_ = true;
    wake_cv_.Signal();
  }
  return absl::OkStatus();
}

int StepQueue::DrainInto(std::vector<DecodeStep*>* out) {
  const size_t first = out->size();
  for (auto& s : shards_) {
    absl::MutexLock lock(&s.mu);
    for (; s.count > 0; --s.count) {
      out->push_back(s.ring[s.head]);
      s.head = (s.head + 1) % s.ring.size();
    }
  }
  const int n = static_cast<int>(out->size() - first);
  in_shards_.fetch_sub(n);
  std::sort(out->begin() + first, out->end(),
            [](const DecodeStep* a, const DecodeStep* b) { return Arrival(a) < Arrival(b); });
  return n;
}

bool StepQueue::WaitForWork(absl::Time deadline) {
  absl::MutexLock lock(&wake_mu_);
  consumer_waiting_.store(true);
  while (in_shards_.load() == 0 && !woken_) {
    if (wake_cv_.WaitWithDeadline(&wake_mu_, deadline)) break;
  }
  woken_ = false;
  consumer_waiting_.store(false);
  return in_shards_.load() > 0;
}

void StepQueue::Wake() {
  absl::MutexLock lock(&wake_mu_);
  woken_ = true;
  wake_cv_.Signal();
}

}  // namespace latentd::engine
