// CompletionPool (engine/completion_pool.h).
#include "engine/completion_pool.h"

#include <pthread.h>

#include <string>

namespace latentd::engine {

CompletionPool::CompletionPool(int threads, int capacity, Done done) : done_(std::move(done)) {
  for (int i = 0; i < threads; ++i) {
    auto w = std::make_unique<Worker>();
    {
      absl::MutexLock l(&w->mu);
      w->ring.resize(static_cast<size_t>(capacity > 0 ? capacity : 1));
    }
    workers_.push_back(std::move(w));
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker* w = workers_[i].get();
    w->thread = std::thread([this, w, i] {
      const std::string name = "latentd-done" + std::to_string(i);
      pthread_setname_np(pthread_self(), name.c_str());
      Run(w);
    });
  }
}

CompletionPool::~CompletionPool() {
  for (auto& w : workers_) {
    absl::MutexLock l(&w->mu);
    w->stop = true;
    w->cv.SignalAll();
  }
  for (auto& w : workers_) w->thread.join();
}

void CompletionPool::Push(DecodeStep* step, const absl::Status& status, uint64_t key) {
  if (workers_.empty()) {
    done_(&step, &status, 1);
    return;
  }
  Worker& w = *workers_[key % workers_.size()];
  absl::MutexLock l(&w.mu);
  if (w.count == w.ring.size()) {
    ++w.waits;
    while (w.count == w.ring.size()) w.cv.Wait(&w.mu);
  }
  Item& it = w.ring[(w.head + w.count) % w.ring.size()];
  it.step = step;
  it.status = status;
  ++w.count;
  w.cv.SignalAll();
}

uint64_t CompletionPool::waits() const {
  uint64_t n = 0;
  for (auto& w : workers_) {
    absl::MutexLock l(&w->mu);
    n += w->waits;
  }
  return n;
}

void CompletionPool::Run(Worker* w) {
  // The run taken off the ring, allocated once before the steady state.
  std::vector<DecodeStep*> steps(kMaxRun);
  std::vector<absl::Status> statuses(kMaxRun);
  for (;;) {
    int n = 0;
    {
      absl::MutexLock l(&w->mu);
      while (w->count == 0 && !w->stop) w->cv.Wait(&w->mu);
      if (w->count == 0) return;  // stopped, and everything pushed has run
      while (w->count > 0 && n < kMaxRun) {
        Item& front = w->ring[w->head];
        steps[n] = front.step;
        statuses[n] = std::move(front.status);
        front.status = absl::OkStatus();
        w->head = (w->head + 1) % w->ring.size();
        --w->count;
        ++n;
      }
      w->cv.SignalAll();  // a Push waiting for room
    }
    done_(steps.data(), statuses.data(), n);
    for (int i = 0; i < n; ++i) statuses[i] = absl::OkStatus();  // drops error messages
  }
}

}  // namespace latentd::engine
