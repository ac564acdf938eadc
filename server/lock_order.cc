// SetLockOrderChecks: abseil's deadlock detector on (report) or off.
#include "server/lock_order.h"

#include "absl/synchronization/mutex.h"

namespace latentd::server {

void SetLockOrderChecks(bool on) {
  absl::SetMutexDeadlockDetectionMode(on ? absl::OnDeadlockCycle::kReport : absl::OnDeadlockCycle::kIgnore);
}

}  // namespace latentd::server
