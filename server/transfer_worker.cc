// The transfer streams' thread (transfer_worker.h).
#include "server/transfer_worker.h"

#include <pthread.h>

#include <utility>

namespace latentd::server {

TransferWorker::TransferWorker() {
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "latentd-xfer");  // for top -H and debuggers
    Loop();
  });
}

TransferWorker::~TransferWorker() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void TransferWorker::Post(std::function<void()> task) {
  absl::MutexLock l(&mu_);
  tasks_.push_back(std::move(task));
}

void TransferWorker::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(
          +[](TransferWorker* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return self->stop_ || !self->tasks_.empty();
          },
          this));
      if (tasks_.empty()) return;  // stopping, and nothing left
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace latentd::server
