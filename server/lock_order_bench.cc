// What abseil's deadlock detector costs per Mutex acquisition (server/lock_order.h):
// each thread locks mutexes of its own, so any slowdown with more threads comes from
// the detector's process-wide lock, not from sharing.
#include <benchmark/benchmark.h>

#include "absl/synchronization/mutex.h"
#include "server/lock_order.h"

namespace latentd::server {
namespace {

// range(0): checks on (1) or off (0); range(1): a second lock taken inside the first
// (the reactor and engine take up to two at once).
void BM_LockUnlock(benchmark::State& state) {
  if (state.thread_index() == 0) SetLockOrderChecks(state.range(0) != 0);
  absl::Mutex outer, inner;
  const bool nested = state.range(1) != 0;
  for (auto _ : state) {
    outer.Lock();
    if (nested) {
      inner.Lock();
      inner.Unlock();
    }
    outer.Unlock();
  }
}
BENCHMARK(BM_LockUnlock)->ArgsProduct({{0, 1}, {0, 1}})->ThreadRange(1, 4)->UseRealTime();

}  // namespace
}  // namespace latentd::server

BENCHMARK_MAIN();
