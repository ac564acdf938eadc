// The thread that runs ExportSequence and ImportSequence streams' copies between gRPC
// messages and the KV pool (a chunk under the KV lock, or a device copy), so that no
// gRPC callback thread waits for them. Private to //server:service.
#pragma once

#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace latentd::server {

// Tasks run one at a time in the order posted. Each transfer stream has at most one task
// queued (the next chunk to read or apply), so the queue is bounded by the stream limits.
class TransferWorker {
 public:
  TransferWorker();
  // Runs what is queued, then stops the thread.
  ~TransferWorker();
  TransferWorker(const TransferWorker&) = delete;
  TransferWorker& operator=(const TransferWorker&) = delete;

  void Post(std::function<void()> task);

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the rest is built
};

}  // namespace latentd::server
