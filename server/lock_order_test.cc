// SetLockOrderChecks: a lock-order inversion is reported with the checks on and costs
// nothing with them off. Each case runs in a child process (death-test style) so the
// detector's global graph starts empty.
#include "server/lock_order.h"

#include <chrono>
#include <cstdio>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace latentd::server {
namespace {

// Takes a then b, then b then a, on one thread: no deadlock happens, but the order is
// inverted, which the detector reports when it is on.
void InvertOrder() {
  absl::Mutex a, b;
  a.Lock();
  b.Lock();
  b.Unlock();
  a.Unlock();
  b.Lock();
  a.Lock();
  a.Unlock();
  b.Unlock();
}

TEST(LockOrderTest, OnReportsAnInversion) {
  EXPECT_EXIT(
      {
        SetLockOrderChecks(true);
        InvertOrder();
        std::fflush(nullptr);
        std::_Exit(0);
      },
      testing::ExitedWithCode(0), "Potential Mutex deadlock");
}

TEST(LockOrderTest, OffReportsNothing) {
  EXPECT_EXIT(
      {
        SetLockOrderChecks(false);
        InvertOrder();
        std::fprintf(stderr, "no report\n");
        std::fflush(nullptr);
        std::_Exit(0);
      },
      testing::ExitedWithCode(0), "^no report\n$");
}

}  // namespace
}  // namespace latentd::server
