// Runs decode steps' completion callbacks (StepCallback::StepsDone) on a few threads of
// their own, so the scheduler thread goes back to staging the next batch instead of
// answering each step of the last one (a server's StepDone starts gRPC writes and
// reads: microseconds each, times the batch). Steps of one key (a gRPC stream) are
// completed in the order given, on one thread; nothing allocates after construction.
// A thread whose ring is full makes Push wait (back-pressure on the scheduler, never
// on a gRPC thread); sized as the engine sizes it, the ring holds every step that can
// be accepted at once and never fills.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "engine/types.h"

namespace latentd::engine {

class CompletionPool {
 public:
  // done(steps, statuses, n) runs every Push exactly once, in runs of consecutive
  // pushes to one thread (what had arrived when the thread looked, up to kMaxRun), so a
  // batch's completions are answered together. threads 0: inline, in Push, one by one.
  // capacity: completions each thread's ring holds.
  using Done = std::function<void(DecodeStep* const* steps, const absl::Status* statuses, int n)>;
  static constexpr int kMaxRun = 256;
  CompletionPool(int threads, int capacity, Done done);
  // Runs every completion pushed before it, then stops the threads.
  ~CompletionPool();

  void Push(DecodeStep* step, const absl::Status& status, uint64_t key);

  // Pushes that waited for room in a full ring (for tests).
  uint64_t waits() const;

 private:
  struct Item {
    DecodeStep* step = nullptr;
    absl::Status status;
  };
  struct Worker {
    absl::Mutex mu;
    absl::CondVar cv;
    std::vector<Item> ring ABSL_GUARDED_BY(mu);
    size_t head ABSL_GUARDED_BY(mu) = 0;
    size_t count ABSL_GUARDED_BY(mu) = 0;
    bool stop ABSL_GUARDED_BY(mu) = false;
    uint64_t waits ABSL_GUARDED_BY(mu) = 0;
    std::thread thread;
  };
  void Run(Worker* w);

  const Done done_;
  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace latentd::engine
