// Futex calls of the doorbell ring (server/ring.h), shared by the daemon and the C++
// client. Shared (not FUTEX_PRIVATE) futexes, since the two sides are two processes.
#include "proto/ring.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

namespace latentd::ring {

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_us) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout_us / 1000000);
  ts.tv_nsec = static_cast<long>((timeout_us % 1000000) * 1000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

}  // namespace latentd::ring
