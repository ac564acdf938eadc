// Probe for the TSan shim: threads hand ABSL_GUARDED_BY state to each other through
// absl::Mutex, CondVar, Mutex::Await and Notification. Race-free by construction, so
// TSan reports nothing when it understands abseil, and a race when it does not.
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

absl::Mutex mu;
long counter ABSL_GUARDED_BY(mu) = 0;
bool ready ABSL_GUARDED_BY(mu) = false;
absl::CondVar cv;
long payload = 0;  // published by a Notification
absl::Notification published;

}  // namespace

int main() {
  // Plain lock/unlock from several threads.
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([] {
      for (int i = 0; i < 1000; ++i) {
        absl::MutexLock l(&mu);
        ++counter;
      }
    });
  }
  for (auto& t : threads) t.join();

  // CondVar handoff and Await handoff.
  std::thread producer([] {
    absl::SleepFor(absl::Milliseconds(20));
    absl::MutexLock l(&mu);
    counter += 1;
    ready = true;
    cv.Signal();
  });
  {
    absl::MutexLock l(&mu);
    while (!ready) cv.Wait(&mu);
    counter += 1;
  }
  producer.join();
  std::thread setter([] {
    absl::SleepFor(absl::Milliseconds(20));
    absl::MutexLock l(&mu);
    counter += 1;
    ready = false;
  });
  {
    absl::MutexLock l(&mu);
    mu.Await(absl::Condition(+[](bool* r) { return !*r; }, &ready));
    counter += 1;
  }
  setter.join();

  // Reader locks read what a writer wrote.
  std::thread reader([] {
    absl::ReaderMutexLock l(&mu);
    std::printf("reader sees %ld\n", counter);
  });
  reader.join();

  // Notification publishes an unguarded value.
  std::thread notifier([] {
    payload = 42;
    published.Notify();
  });
  published.WaitForNotification();
  const long seen = payload;
  notifier.join();

  absl::MutexLock l(&mu);
  std::printf("counter %ld payload %ld\n", counter, seen);
  return counter == 4004 && seen == 42 ? 0 : 1;
}
