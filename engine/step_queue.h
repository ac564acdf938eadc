// A bounded multi-producer queue of decode steps, sharded so that submitters of
// different sequences never contend on one lock. The scheduler drains every shard;
// arrival numbers restore FIFO order across shards.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "engine/types.h"

namespace latentd::engine {

class StepQueue {
 public:
  // capacity: steps queued at once over all shards; pushes beyond it fail at once.
  StepQueue(int capacity, int num_shards = 16);

  // Never blocks on the consumer. RESOURCE_EXHAUSTED when full. wake = false leaves a
  // sleeping consumer asleep (a caller pushing several steps wakes it once, with Wake).
  absl::Status Push(DecodeStep* step, uint64_t shard_key, bool wake = true);

  // Moves every queued step into out (appended), ordered by arrival. Returns the count.
  // Drained steps still count against the capacity until Done: the bound covers every
  // step accepted and not yet launched or dropped, wherever it waits.
  int DrainInto(std::vector<DecodeStep*>* out);
  // n drained steps left the engine's waiting list (launched or dropped).
  void Done(int n) { size_.fetch_sub(n); }

  // Blocks until a push happens or the deadline passes; returns true if steps are queued.
  bool WaitForWork(absl::Time deadline);
  void Wake();  // wakes a waiting consumer (after pushes without wake; shutdown)

  // Whether steps were pushed and not yet drained (a cheap check for spinning).
  bool HasPending() const { return in_shards_.load(std::memory_order_acquire) > 0; }
  // Steps accepted and not yet Done.
  int64_t size() const { return size_.load(std::memory_order_relaxed); }
  int capacity() const { return capacity_; }

  // Arrival number of a step pushed through this queue.
  static uint64_t Arrival(const DecodeStep* step);

 private:
  struct Shard {
    absl::Mutex mu;
    std::vector<DecodeStep*> ring ABSL_GUARDED_BY(mu);
    size_t head ABSL_GUARDED_BY(mu) = 0;
    size_t count ABSL_GUARDED_BY(mu) = 0;
  };

  const int capacity_;
  std::vector<Shard> shards_;
  std::atomic<int64_t> size_{0};     // accepted, not yet Done (the capacity bound)
  std::atomic<int64_t> in_shards_{0};  // pushed, not yet drained (wakes the consumer)
  std::atomic<uint64_t> next_arrival_{1};

  // The consumer sleeps here only when every shard is empty.
  absl::Mutex wake_mu_;
  absl::CondVar wake_cv_;
  std::atomic<bool> consumer_waiting_{false};
  bool woken_ ABSL_GUARDED_BY(wake_mu_) = false;
};

}  // namespace latentd::engine
