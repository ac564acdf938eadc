// The decode hot path allocates nothing per step: once the engine has served a few
// rounds, submitting, batching, attending and completing further steps makes no heap
// allocation on any thread. Counted by replacing the global operator new in this test
// binary. Built for the CPU backend (CI) and, with LATENTD_TEST_CUDA, the CUDA one.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "engine/engine.h"
#include "engine/testing/backend_under_test.h"
#include "engine/testing/engine_harness.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocations{0};
}  // namespace

void* operator new(std::size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace latentd::engine {
namespace {

using testing::Harness;

constexpr BackendKind kBackend = testing::kBackendUnderTest;
constexpr bool kExact = testing::kExactUnderTest;

TEST(EngineAllocTest, SteadyStateStepsAllocateNothing) {
  EngineOptions o;
  o.model.num_layers = 2;
  o.model.num_heads_q = 16;
  o.backend = kBackend;
  o.cpu_threads = 2;
  o.kv_pages = 256;
  o.batch_window = absl::Microseconds(100);
  auto engine = Engine::Create(o);
#ifdef LATENTD_TEST_CUDA
  if (!engine.ok()) GTEST_SKIP() << "no CUDA device: " << engine.status();
#endif
  ASSERT_TRUE(engine.ok()) << engine.status();
  Harness h(engine->get(), 5);
  // Prefixes just past a page boundary, so the rounds below never need a new page (a
  // new page grows block tables: amortised, not per step).
  std::vector<std::string> seqs;
  for (int i = 0; i < 12; ++i) seqs.push_back(h.NewSequence(64 * (1 + i % 4) + 1));

  // Half the sequences' steps are answered on the scheduler (complete_inline, as a
  // doorbell ring's are), half on the completion threads.
  auto round = [&](std::vector<Harness::Pending*>* steps) {
    for (size_t i = 0; i < seqs.size(); ++i)
      for (int layer = 0; layer < 2; ++layer) {
        steps->push_back(h.MakeStep(seqs[i], layer, 1 + layer, layer == 1));
        steps->back()->step.complete_inline = i % 2 == 0;
      }
  };
  // Warm-up: buffers reach their high-water marks.
  std::vector<Harness::Pending*> warm;
  for (int r = 0; r < 5; ++r) round(&warm);
  for (auto* p : warm) ASSERT_TRUE(h.Submit(p).ok());
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));

  // Measured: steps built beforehand (the client's allocations), then submitted and run.
  std::vector<Harness::Pending*> measured;
  for (int r = 0; r < 10; ++r) round(&measured);
  g_allocations = 0;
  g_counting = true;
  for (auto* p : measured) {
    if (!h.Submit(p).ok()) {
      g_counting = false;
      FAIL() << "submit refused";
    }
  }
  const bool done = h.WaitAll(absl::Seconds(60));
  g_counting = false;
  ASSERT_TRUE(done);
  EXPECT_EQ(g_allocations.load(), 0) << "heap allocations while serving " << measured.size() << " steps";
  for (auto* p : measured) EXPECT_TRUE(h.Check(*p, kExact));
}

}  // namespace
}  // namespace latentd::engine
