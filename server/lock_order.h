// Whether abseil checks the lock order of every absl::Mutex acquisition. Debian builds
// abseil without NDEBUG, which leaves its deadlock detector on: each Lock then takes one
// process-wide spinlock and updates a global lock graph, so binaries switch it off.
#ifndef LATENTD_SERVER_LOCK_ORDER_H_
#define LATENTD_SERVER_LOCK_ORDER_H_

namespace latentd::server {

// on: a lock-order cycle is reported on stderr ("Potential Mutex deadlock") and the
// program goes on; off: no checks. Call early, before the program starts its threads.
void SetLockOrderChecks(bool on);

}  // namespace latentd::server

#endif  // LATENTD_SERVER_LOCK_ORDER_H_
