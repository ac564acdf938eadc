// Engine scenarios: batched results against the CPU oracle, order per sequence, mixed
// layers and s_q in one batch, fairness under overload and between flows,
// backpressure, cancellation, deadlines, pool exhaustion mid-run, draining, chunked
// uploads, the sequence limit and resync, and an fp8 KV cache. Built twice: on the CPU backend (CI,
// bit-exact against the oracle) and on the CUDA backend (tag gpu, within tolerance).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <thread>

#include "engine/engine.h"
#include "engine/testing/backend_under_test.h"
#include "engine/testing/engine_harness.h"

namespace latentd::engine {
namespace {

using testing::Harness;

constexpr BackendKind kBackend = testing::kBackendUnderTest;
constexpr bool kExact = testing::kExactUnderTest;

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef LATENTD_TEST_CUDA
    if (!CudaPresent()) GTEST_SKIP() << "no CUDA device: skipping the CUDA backend scenarios";
#endif
  }
  static bool CudaPresent() {
    EngineOptions o;
    o.backend = BackendKind::kCuda;
    o.kv_pages = 8;
    return Engine::Create(o).ok();
  }

  std::unique_ptr<Engine> Make(EngineOptions o) {
    o.backend = kBackend;
    if (o.kv_pages == 0) o.kv_pages = 256;
    o.cpu_threads = 2;
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }

  static EngineOptions Model(int layers, int h_q, int h_kv = 1) {
    EngineOptions o;
    o.model.num_layers = layers;
    o.model.num_heads_q = h_q;
    o.model.num_heads_kv = h_kv;
    return o;
  }
};

TEST_F(EngineTest, ConcurrentStepsMatchOracle) {
  EngineOptions o = Model(3, 16);
  o.batch_window = absl::Milliseconds(2);
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 11);
  std::vector<std::string> seqs;
  const int prefixes[] = {0, 1, 63, 64, 65, 200, 700};
  for (int p : prefixes) seqs.push_back(h.NewSequence(p));
  std::vector<Harness::Pending*> steps;
  // Three rounds per sequence and layer, all in flight at once: order per (sequence,
  // layer) must hold, and each round sees the rows of the rounds before it.
  for (int round = 0; round < 3; ++round)
    for (const auto& s : seqs)
      for (int layer = 0; layer < 3; ++layer) {
        auto* p = h.MakeStep(s, layer, 1, false);
        ASSERT_TRUE(h.Submit(p).ok());
        steps.push_back(p);
      }
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  for (auto* p : steps) EXPECT_TRUE(h.Check(*p, kExact));
  const auto m = engine->Metrics();
  EXPECT_EQ(m.steps_completed, steps.size());
  EXPECT_LT(m.batches, steps.size()) << "steps were never batched together";
}

// A full batch of long sequences: on the GPU this plans a few split-K partitions per
// sequence (the merge fused into the decode kernel), and it runs twice so the
// workspace's arrival counters are reused.
TEST_F(EngineTest, FullBatchOfLongSequences) {
  EngineOptions o = Model(1, 16);
  // Stalls the scheduler in a held completion (or reads completion order): only the
  // scheduler's own completions do that (the pool keeps order within each flow only).
  o.completion_threads = 0;
  o.kv_pages = 1200;
  o.batch_window = absl::Milliseconds(20);
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 21);
  std::vector<std::string> seqs;
  for (int i = 0; i < 64; ++i) seqs.push_back(h.NewSequence(1000 + i));
  std::vector<Harness::Pending*> steps;
  h.HoldCallbacks(true);
  for (int round = 0; round < 2; ++round)
    for (const auto& s : seqs) {
      steps.push_back(h.MakeStep(s, 0, 1, false));
      ASSERT_TRUE(h.Submit(steps.back()).ok());
    }
  h.HoldCallbacks(false);
  ASSERT_TRUE(h.WaitAll(absl::Seconds(120)));
  for (auto* p : steps) EXPECT_TRUE(h.Check(*p, kExact));
}

// DecodeStep::complete_inline: such steps are answered on the scheduler thread as their
// batch finishes, the others on the completion threads; both right.
TEST_F(EngineTest, InlineCompletionsRunOnTheScheduler) {
  EngineOptions o = Model(1, 16);
  o.completion_threads = 2;
  o.batch_window = absl::Milliseconds(20);
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 13);
  std::vector<Harness::Pending*> steps;
  for (int i = 0; i < 8; ++i) {
    const std::string s = h.NewSequence(70 + i);
    steps.push_back(h.MakeStep(s, 0, 1, false));
    steps.back()->step.complete_inline = i % 2 == 0;
  }
  std::vector<Harness::Pending*> first(steps.begin(), steps.begin() + 4), rest(steps.begin() + 4, steps.end());
  ASSERT_TRUE(h.SubmitBatch(first).ok());
  for (auto* p : rest) ASSERT_TRUE(h.Submit(p).ok());
  // One more inline step whose caller left before it launched: refused at collection,
  // answered on the scheduler too.
  Harness::Pending* gone = h.MakeStep(h.NewSequence(5), 0, 1, false);
  gone->step.complete_inline = true;
  gone->cancelled.store(true);
  ASSERT_TRUE(h.Submit(gone).ok());
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  EXPECT_TRUE(absl::IsCancelled(gone->status)) << gone->status;
  EXPECT_EQ(gone->completed_on, "latentd-sched");
  for (auto* p : steps) {
    EXPECT_TRUE(h.Check(*p, kExact));
    if (p->step.complete_inline) {
      EXPECT_EQ(p->completed_on, "latentd-sched") << p->step.request_id;
    } else {
      EXPECT_NE(p->completed_on, "latentd-sched") << p->step.request_id;
    }
  }
  EXPECT_EQ(engine->Metrics().steps_completed, steps.size());
}

TEST_F(EngineTest, MixedLayersAndQueryLengthsInOneBatch) {
  EngineOptions o = Model(2, 32, 2);
  // Stalls the scheduler in a held completion (or reads completion order): only the
  // scheduler's own completions do that (the pool keeps order within each flow only).
  o.completion_threads = 0;
  o.batch_window = absl::Milliseconds(20);
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 12);
  std::vector<Harness::Pending*> steps;
  const std::string a = h.NewSequence(90), b = h.NewSequence(130), c = h.NewSequence(1);
  h.HoldCallbacks(true);  // keep the first batch's completion waiting so the rest queue up
  steps.push_back(h.MakeStep(a, 0, 1, false));
  ASSERT_TRUE(h.Submit(steps.back()).ok());
  for (auto [seq, layer, s_q, causal] : {std::tuple{a, 1, 2, true}, {b, 0, 2, false}, {b, 1, 1, false},
                                         {c, 0, 4, true}, {c, 1, 3, false}, {a, 0, 2, true}}) {
    steps.push_back(h.MakeStep(seq, layer, s_q, causal));
    ASSERT_TRUE(h.Submit(steps.back()).ok());
  }
  h.HoldCallbacks(false);
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  for (auto* p : steps) EXPECT_TRUE(h.Check(*p, kExact));
  const auto m = engine->Metrics();
  uint64_t multi = 0;
  for (size_t i = 1; i < m.batch_size_histogram.size(); ++i) multi += m.batch_size_histogram[i];
  EXPECT_GT(multi, 0u) << "no batch held more than one step";
}

TEST_F(EngineTest, ForkedSequencesDiverge) {
  auto engine = Make(Model(2, 16));
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 13);
  const std::string parent = h.NewSequence(100);
  const std::string child = h.Fork(parent);
  std::vector<Harness::Pending*> steps;
  for (int i = 0; i < 3; ++i)
    for (const auto& s : {parent, child}) {
      steps.push_back(h.MakeStep(s, i % 2, 1, false));
      ASSERT_TRUE(h.Submit(steps.back()).ok());
    }
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  for (auto* p : steps) EXPECT_TRUE(h.Check(*p, kExact));
}

TEST_F(EngineTest, FifoUnderOverloadDoesNotStarve) {
  EngineOptions o = Model(1, 16);
  // Completion order is what this test reads: only the scheduler's own completions
  // keep the launch order across flows (the pool keeps it within each flow).
  o.completion_threads = 0;
  o.max_batch_size = 4;
  o.batch_window = absl::ZeroDuration();
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 14);
  const std::string hot = h.NewSequence(10);
  std::vector<std::string> cold;
  for (int i = 0; i < 6; ++i) cold.push_back(h.NewSequence(10));
  h.HoldCallbacks(true);
  // A hot sequence floods 40 steps (one per batch at most), then each cold sequence
  // sends one: FIFO with at most one step per (sequence, layer) per batch means the
  // cold steps complete long before the hot backlog.
  std::vector<Harness::Pending*> hot_steps, cold_steps;
  for (int i = 0; i < 40; ++i) {
    hot_steps.push_back(h.MakeStep(hot, 0, 1, false));
    ASSERT_TRUE(h.Submit(hot_steps.back()).ok());
  }
  for (const auto& s : cold) {
    cold_steps.push_back(h.MakeStep(s, 0, 1, false));
    ASSERT_TRUE(h.Submit(cold_steps.back()).ok());
  }
  h.HoldCallbacks(false);
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  for (auto* p : cold_steps) {
    EXPECT_TRUE(h.Check(*p, kExact));
    EXPECT_LT(p->completion_rank, 12) << "a cold step waited behind the hot sequence's backlog";
  }
  for (size_t i = 0; i < hot_steps.size(); ++i) {
    EXPECT_TRUE(h.Check(*hot_steps[i], kExact));
    if (i > 0) {
      EXPECT_GT(hot_steps[i]->completion_rank, hot_steps[i - 1]->completion_rank);
    }
  }
}

TEST_F(EngineTest, BackpressureRefusesAtOnce) {
  EngineOptions o = Model(1, 16);
  // The scheduler itself stalls in the held completion, so the queue fills (with
  // completion threads, their rings would take the launched steps first).
  o.completion_threads = 0;
  o.max_queue = 8;
  o.max_batch_size = 2;
  o.batch_window = absl::ZeroDuration();
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 15);
  std::vector<std::string> seqs;
  for (int i = 0; i < 40; ++i) seqs.push_back(h.NewSequence(5));
  h.HoldCallbacks(true);  // the scheduler stalls in the first completion: the queue fills
  int accepted = 0, refused = 0;
  std::vector<Harness::Pending*> ok_steps;
  for (const auto& s : seqs) {
    auto* p = h.MakeStep(s, 0, 1, false);
    const absl::Status st = h.Submit(p);
    if (st.ok()) {
      ++accepted;
      ok_steps.push_back(p);
    } else {
      EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
      ++refused;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_LE(accepted, 8 + 2 * 2);  // queue capacity plus at most two batches taken out of it
  h.HoldCallbacks(false);
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  for (auto* p : ok_steps) EXPECT_TRUE(h.Check(*p, kExact));
  EXPECT_EQ(engine->Metrics().rejected_queue_full, static_cast<uint64_t>(refused));
}

TEST_F(EngineTest, CancelledAndExpiredStepsAreDropped) {
  EngineOptions o = Model(1, 16);
  // The scheduler itself stalls in the held completion, so the later steps are still
  // queued when they are cancelled or expire.
  o.completion_threads = 0;
  o.max_batch_size = 1;
  o.batch_window = absl::ZeroDuration();
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 16);
  const std::string a = h.NewSequence(20), b = h.NewSequence(20), c = h.NewSequence(20);
  h.HoldCallbacks(true);
  auto* first = h.MakeStep(a, 0, 1, false);
  ASSERT_TRUE(h.Submit(first).ok());
  auto* gone = h.MakeStep(b, 0, 1, false);
  ASSERT_TRUE(h.Submit(gone).ok());
  gone->cancelled.store(true);  // caller left before the step was launched
  auto* late = h.MakeStep(c, 0, 1, false);
  late->step.deadline = absl::Now() - absl::Seconds(1);
  ASSERT_TRUE(h.Submit(late).ok());
  h.HoldCallbacks(false);
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  EXPECT_TRUE(h.Check(*first, kExact));
  EXPECT_TRUE(absl::IsCancelled(gone->status)) << gone->status;
  EXPECT_TRUE(absl::IsDeadlineExceeded(late->status)) << late->status;
  // Dropped steps appended nothing: the next steps see only the prefix.
  h.Rollback(gone);
  h.Rollback(late);
  auto* again_b = h.MakeStep(b, 0, 1, false);
  auto* again_c = h.MakeStep(c, 0, 1, false);
  ASSERT_TRUE(h.Submit(again_b).ok());
  ASSERT_TRUE(h.Submit(again_c).ok());
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  EXPECT_TRUE(h.Check(*again_b, kExact));
  EXPECT_TRUE(h.Check(*again_c, kExact));
  const auto m = engine->Metrics();
  EXPECT_EQ(m.dropped_cancelled, 1u);
  EXPECT_EQ(m.rejected_deadline, 1u);
}

TEST_F(EngineTest, PoolExhaustionFailsOnlyStepsThatNeedPages) {
  EngineOptions o = Model(1, 16);
  o.kv_pages = 4;
  o.batch_window = absl::Milliseconds(5);
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 17);
  const std::string full = h.NewSequence(64);    // one page, full: its next row needs a page
  const std::string roomy = h.NewSequence(10);   // room left in its page
  const std::string hog = h.NewSequence(65);     // takes the last two pages
  ASSERT_EQ(engine->Info().free_pages, 0);
  auto* needs_page = h.MakeStep(full, 0, 1, false);
  auto* fits = h.MakeStep(roomy, 0, 1, false);
  auto* fits2 = h.MakeStep(hog, 0, 1, false);
  ASSERT_TRUE(h.Submit(needs_page).ok());
  ASSERT_TRUE(h.Submit(fits).ok());
  ASSERT_TRUE(h.Submit(fits2).ok());
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  EXPECT_TRUE(absl::IsResourceExhausted(needs_page->status)) << needs_page->status;
  EXPECT_TRUE(h.Check(*fits, kExact));
  EXPECT_TRUE(h.Check(*fits2, kExact));
  h.Rollback(needs_page);
  // Once pages come back, the same sequence steps again from where it was.
  ASSERT_TRUE(engine->ReleaseSequence(hog).ok());
  auto* retry = h.MakeStep(full, 0, 1, false);
  ASSERT_TRUE(h.Submit(retry).ok());
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  EXPECT_TRUE(h.Check(*retry, kExact));
}

TEST_F(EngineTest, BadStepsAreRefusedWithTheField) {
  auto engine = Make(Model(2, 16));
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 18);
  const std::string a = h.NewSequence(3);
  auto* p = h.MakeStep(a, 0, 1, false);
  p->step.q = TensorLocation::Host(p->q.data(), 100);
  absl::Status st = h.Submit(p);
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_NE(st.message().find("q: expected 18432 bytes"), std::string::npos) << st;
  p = h.MakeStep(a, 2, 1, false);
  st = h.Submit(p);
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_NE(st.message().find("layer: expected 0..1"), std::string::npos) << st;
  p = h.MakeStep(a, 0, 1, false);
  p->step.kv = TensorLocation::Host(p->kv.data() + 1, p->kv.size() - 1);
  st = h.Submit(p);
  EXPECT_NE(st.message().find("kv: expected"), std::string::npos) << st;
  // An unknown sequence fails through the callback, alone.
  auto* unknown = h.MakeStep("no-such-sequence", 0, 1, false);
  auto* good = h.MakeStep(a, 0, 1, false);
  ASSERT_TRUE(h.Submit(unknown).ok());
  ASSERT_TRUE(h.Submit(good).ok());
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  EXPECT_TRUE(absl::IsNotFound(unknown->status)) << unknown->status;
  EXPECT_TRUE(h.Check(*good, kExact));
  // Control-plane errors.
  EXPECT_TRUE(absl::IsAlreadyExists(engine->CreateSequence(a).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(engine->CreateSequence("bad id!").status()));
  EXPECT_TRUE(absl::IsNotFound(engine->ReleaseSequence("nope").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(engine->AppendKv(a, 0, "odd").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(engine->AppendKv(a, 5, std::string(1152, 'x')).status()));
}

TEST_F(EngineTest, PrefixKeysAttachCachedPagesAndCountTheSavedBytes) {
  auto engine = Make(Model(2, 16));
  ASSERT_NE(engine, nullptr);
  const size_t row = 576 * 2;
  std::vector<std::string> keys;
  for (int i = 0; i < 3; ++i) keys.push_back(std::string(15, 'k') + static_cast<char>('0' + i));
  auto a = engine->CreateSequenceWithPrefix("", keys);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->prefix_tokens, 0);
  std::string rows(2 * 64 * row + 7 * row, '\x3c');  // two full pages and a partial one
  for (int layer = 0; layer < 2; ++layer) ASSERT_TRUE(engine->AppendKv(a->sequence_id, layer, rows).ok());
  auto b = engine->CreateSequenceWithPrefix("b", keys);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->sequence_id, "b");
  EXPECT_EQ(b->prefix_tokens, 128);
  auto info = engine->GetSequence("b");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->lengths, (std::vector<int64_t>{128, 128}));
  EXPECT_EQ(info->shared_pages, 2);
  EngineMetrics m = engine->Metrics();
  EXPECT_EQ(m.prefix_hit_pages, 2u);
  EXPECT_EQ(m.prefix_miss_pages, 3u + 1u);
  EXPECT_EQ(m.prefix_bytes_saved, 128u * row * 2);
  EXPECT_EQ(m.pages_keyed, 2);
  ASSERT_TRUE(engine->ReleaseSequence(a->sequence_id).ok());
  ASSERT_TRUE(engine->ReleaseSequence("b").ok());
  m = engine->Metrics();
  EXPECT_EQ(m.pages_cached, 2);
  EXPECT_EQ(m.pages_used, 0);
  // Bad keys: the field and what was expected; nothing is created.
  auto bad = engine->CreateSequenceWithPrefix("c", {keys[0], "short"});
  ASSERT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_NE(bad.status().message().find("page_keys[1]: expected 16 bytes, got 5"), std::string::npos) << bad.status();
  EXPECT_TRUE(absl::IsNotFound(engine->GetSequence("c").status()));
}

TEST_F(EngineTest, DrainFinishesAcceptedStepsThenRefuses) {
  EngineOptions o = Model(1, 16);
  o.max_batch_size = 2;
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 19);
  std::vector<Harness::Pending*> steps;
  for (int i = 0; i < 10; ++i) {
    const std::string s = h.NewSequence(30 + i);
    steps.push_back(h.MakeStep(s, 0, 1, false));
    ASSERT_TRUE(h.Submit(steps.back()).ok());
  }
  EXPECT_TRUE(engine->Drain(absl::Seconds(60)));
  EXPECT_EQ(h.completed(), 10);
  for (auto* p : steps) EXPECT_TRUE(h.Check(*p, kExact));
  const std::string s = h.NewSequence(3);
  auto* late = h.MakeStep(s, 0, 1, false);
  EXPECT_TRUE(absl::IsUnavailable(h.Submit(late)));
}

TEST_F(EngineTest, IdleSequencesAreReleased) {
  auto engine = Make(Model(1, 16));
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 20);
  const std::string s = h.NewSequence(100);
  const int64_t free_before = engine->Info().free_pages;
  EXPECT_EQ(engine->ReleaseIdleSequences(absl::Hours(1)), 0);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(engine->ReleaseIdleSequences(absl::Milliseconds(10)), 1);
  EXPECT_EQ(engine->Info().free_pages, free_before + 2);
  EXPECT_TRUE(absl::IsNotFound(engine->ReleaseSequence(s).status()));
}

// A sequence released while its step runs: its pages go to nobody else until the batch
// is over, so the step still answers over its own rows while another sequence is
// written into the pool (the free list would hand it exactly those pages).
TEST_F(EngineTest, ReleaseDuringAStepKeepsItsPagesUntilTheBatchEnds) {
  EngineOptions o = Model(1, 64);
  o.batch_window = absl::ZeroDuration();
  o.kv_pages = 100;
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 21);
  constexpr int kLen = 2500;  // 40 pages, a few milliseconds of CPU attention at h_q 64
  const std::string other(size_t(kLen) * kernels::kHeadDimQK * 2, '\x4c');
  int ran = 0;
  for (int round = 0; round < 40 && ran < 4; ++round) {
    const std::string a = h.NewSequence(kLen);
    Harness::Pending* p = h.MakeStep(a, 0, 1, false);
    ASSERT_TRUE(h.Submit(p).ok());
    absl::SleepFor(absl::Microseconds(1500));  // usually staged by now and still running
    ASSERT_TRUE(engine->ReleaseSequence(a).ok());
    auto b = engine->CreateSequence("");
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_TRUE(engine->AppendKv(*b, 0, other).ok());
    ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
    if (p->status.ok()) {
      ++ran;
      // Within tolerance, not bit-exact: one step alone is split over keys across the
      // CPU threads. Rows of the other sequence (all 0x4c4c) would be far outside it.
      EXPECT_TRUE(h.Check(*p, false)) << "round " << round;
    } else {
      EXPECT_TRUE(absl::IsNotFound(p->status)) << p->status;  // released before staging
    }
    ASSERT_TRUE(engine->ReleaseSequence(*b).ok());
  }
  EXPECT_GT(ran, 0);
  EXPECT_EQ(engine->Info().free_pages, 100);
}

TEST_F(EngineTest, ManyThreadsSubmitting) {
  EngineOptions o = Model(2, 16);
  o.batch_window = absl::Microseconds(200);
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  // One harness per thread: each thread owns its sequences and shadows.
  constexpr int kThreads = 6;
  std::vector<std::unique_ptr<Harness>> hs;
  for (int t = 0; t < kThreads; ++t) hs.push_back(std::make_unique<Harness>(engine.get(), 100 + t));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      Harness& h = *hs[t];
      const std::string s = h.NewSequence(50 + 30 * t);
      for (int i = 0; i < 20; ++i) ASSERT_TRUE(h.Submit(h.MakeStep(s, i % 2, 1 + (i % 3 == 0), i % 2 == 0)).ok());
      ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(engine->Metrics().steps_completed, uint64_t{kThreads} * 20);
}

// Holds the scheduler inside the first batch's completion, so that every step
// submitted afterwards is waiting when the next batch forms. Metrics count a batch
// before its callbacks run, so once batches reaches 1 the scheduler is in (or about
// to enter) the held callback.
void StallScheduler(Engine* engine, Harness& h, const std::string& seq) {
  h.HoldCallbacks(true);
  ASSERT_TRUE(h.Submit(h.MakeStep(seq, 0, 1, false)).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (engine->Metrics().batches < 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(engine->Metrics().batches, 1u);
}

// One flow floods 3000 steps; a steady flow's step submitted after them goes into the
// very next batch. Plain FIFO would run it after the whole flood.
TEST_F(EngineTest, FloodFlowDoesNotDelaySteadyFlow) {
  EngineOptions o = Model(1, 16);
  // Stalls the scheduler in a held completion (or reads completion order): only the
  // scheduler's own completions do that (the pool keeps order within each flow only).
  o.completion_threads = 0;
  o.max_batch_size = 64;
  o.batch_window = absl::ZeroDuration();
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 31);
  std::vector<std::string> flood_seqs;
  for (int i = 0; i < 100; ++i) flood_seqs.push_back(h.NewSequence(1));
  const std::string steady = h.NewSequence(5), blocker = h.NewSequence(1);
  StallScheduler(engine.get(), h, blocker);
  std::vector<Harness::Pending*> flood;
  for (int i = 0; i < 3000; ++i) {
    flood.push_back(h.MakeStep(flood_seqs[i % flood_seqs.size()], 0, 1, false));
    flood.back()->step.flow = 1;
    ASSERT_TRUE(h.Submit(flood.back()).ok());
  }
  auto* mine = h.MakeStep(steady, 0, 1, false);
  mine->step.flow = 2;
  ASSERT_TRUE(h.Submit(mine).ok());
  EXPECT_EQ(engine->Metrics().waiting_flows, 0);  // not collected while the scheduler is held
  h.HoldCallbacks(false);
  ASSERT_TRUE(h.WaitAll(absl::Seconds(120)));
  EXPECT_TRUE(h.Check(*mine, kExact));
  // Rank 0 is the blocker; the next batch holds ranks 1..64.
  EXPECT_LE(mine->completion_rank, o.max_batch_size) << "the steady step waited behind the flood";
  for (size_t i = 0; i < flood.size(); ++i) {
    ASSERT_TRUE(h.Check(*flood[i], kExact)) << i;
    if (i > 0) ASSERT_GT(flood[i]->completion_rank, flood[i - 1]->completion_rank) << "flood reordered at " << i;
  }
}

// Two flows with equal backlogs split every batch evenly, even though one of them
// submitted everything first.
TEST_F(EngineTest, EqualFlowsShareEachBatch) {
  EngineOptions o = Model(1, 16);
  // Completion order is what this test reads: only the scheduler's own completions
  // keep the launch order across flows (the pool keeps it within each flow).
  o.completion_threads = 0;
  o.max_batch_size = 8;
  o.batch_window = absl::ZeroDuration();
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 32);
  std::vector<std::string> seqs[2];
  for (int f = 0; f < 2; ++f)
    for (int i = 0; i < 40; ++i) seqs[f].push_back(h.NewSequence(3));
  const std::string blocker = h.NewSequence(1);
  StallScheduler(engine.get(), h, blocker);
  std::vector<Harness::Pending*> steps[2];
  for (int f = 0; f < 2; ++f)
    for (const auto& s : seqs[f]) {
      steps[f].push_back(h.MakeStep(s, 0, 1, false));
      steps[f].back()->step.flow = 100 + f;
      ASSERT_TRUE(h.Submit(steps[f].back()).ok());
    }
  h.HoldCallbacks(false);
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  // Ten batches of eight after the blocker (ranks 1..80): four of each flow in each.
  std::map<int, int> per_batch[2];
  for (int f = 0; f < 2; ++f)
    for (auto* p : steps[f]) {
      ASSERT_TRUE(h.Check(*p, kExact));
      ++per_batch[f][(p->completion_rank - 1) / 8];
    }
  for (int b = 0; b < 10; ++b) {
    EXPECT_EQ(per_batch[0][b], 4) << "batch " << b;
    EXPECT_EQ(per_batch[1][b], 4) << "batch " << b;
  }
  const auto m = engine->Metrics();
  EXPECT_EQ(m.last_batch_flows, 2);
  EXPECT_EQ(m.last_batch_max_flow_rows, 4);
}

// A message's steps submitted together run in one launch even when queueing them takes
// longer than the batching window (here 0): the scheduler waits for the whole unit.
TEST_F(EngineTest, SubmitBatchRunsInOneLaunch) {
  EngineOptions o = Model(2, 16);
  o.max_batch_size = 64;
  o.batch_window = absl::ZeroDuration();
  o.on_batch_submit_for_testing = [] { absl::SleepFor(absl::Microseconds(200)); };
  o.batch_submit_wait = absl::Seconds(30);  // the test's sleeps, however slow the host
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 41);
  std::vector<Harness::Pending*> steps;
  for (int i = 0; i < 24; ++i) steps.push_back(h.MakeStep(h.NewSequence(10 + i), i % 2, 1, false));
  ASSERT_TRUE(h.SubmitBatch(steps).ok());
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  for (auto* p : steps) {
    EXPECT_TRUE(h.Check(*p, kExact));
    EXPECT_EQ(p->step.batched_at, steps[0]->step.batched_at);
    EXPECT_LE(p->step.enqueued_at, p->step.batched_at);
    EXPECT_LE(p->step.batched_at, p->step.launched_at);
    EXPECT_LE(p->step.launched_at, p->step.finished_at);
  }
  EXPECT_EQ(engine->Metrics().batches, 1u) << "the message was split over launches";
}

// Messages of several streams waiting at once (model runners): each runs in one launch
// of its own instead of being shared step by step over several launches, and every
// stream gets its turn.
TEST_F(EngineTest, MessagesOfManyFlowsEachRunInOneLaunch) {
  EngineOptions o = Model(1, 16);
  o.completion_threads = 0;  // StallScheduler holds the scheduler in a completion
  o.max_batch_size = 16;
  o.batch_window = absl::ZeroDuration();
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 47);
  std::vector<std::string> seqs[4];
  for (int f = 0; f < 4; ++f)
    for (int i = 0; i < 12; ++i) seqs[f].push_back(h.NewSequence(5));
  const std::string blocker = h.NewSequence(1);
  StallScheduler(engine.get(), h, blocker);
  std::vector<Harness::Pending*> units[4];
  for (int f = 0; f < 4; ++f) {
    for (const auto& s : seqs[f]) {
      units[f].push_back(h.MakeStep(s, 0, 1, false));
      units[f].back()->step.flow = 200 + f;
    }
    ASSERT_TRUE(h.SubmitBatch(units[f]).ok());
  }
  h.HoldCallbacks(false);
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  std::set<absl::Time> launches;
  for (int f = 0; f < 4; ++f) {
    for (auto* p : units[f]) {
      EXPECT_TRUE(h.Check(*p, kExact));
      EXPECT_EQ(p->step.batched_at, units[f][0]->step.batched_at) << "flow " << f << "'s message was split";
    }
    launches.insert(units[f][0]->step.batched_at);
  }
  EXPECT_EQ(launches.size(), 4u) << "12-step messages in 16-step launches: one message each";
  EXPECT_EQ(engine->Metrics().last_batch_flows, 1);
}

// A message of several steps is a batch already: it launches without waiting out the
// batching window, while a lone step still waits for company.
TEST_F(EngineTest, SubmitBatchEndsTheBatchWindow) {
  EngineOptions o = Model(2, 16);
  o.batch_window = absl::Seconds(1);
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 43);
  std::vector<Harness::Pending*> unit;
  for (int i = 0; i < 3; ++i) unit.push_back(h.MakeStep(h.NewSequence(20 + i), 0, 1, false));
  ASSERT_TRUE(h.SubmitBatch(unit).ok());
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  for (auto* p : unit) {
    EXPECT_TRUE(h.Check(*p, kExact));
    EXPECT_LT(p->step.batched_at - p->step.enqueued_at, absl::Milliseconds(500)) << "the message waited";
  }
  Harness::Pending* lone = h.MakeStep(h.NewSequence(30), 1, 1, false);
  ASSERT_TRUE(h.Submit(lone).ok());
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  EXPECT_TRUE(h.Check(*lone, kExact));
  EXPECT_GE(lone->step.batched_at - lone->step.enqueued_at, absl::Milliseconds(900)) << "the window was skipped";
}

// A spinning scheduler (idle_spin) serves steps that arrive while it spins, after it
// has gone to sleep, and one by one in between, all correct; it stops on destruction.
TEST_F(EngineTest, SpinningSchedulerServesEveryStep) {
  EngineOptions o = Model(2, 16);
  o.idle_spin = absl::Milliseconds(5);
  o.batch_window = absl::ZeroDuration();
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 47);
  const std::string seq = h.NewSequence(90);
  std::vector<Harness::Pending*> steps;
  for (int i = 0; i < 12; ++i) {
    // Gaps within the spin, and a few past it (the scheduler asleep).
    if (i % 4 == 3) absl::SleepFor(absl::Milliseconds(20));
    steps.push_back(h.MakeStep(seq, i % 2, 1 + i % 2, i % 3 == 0));
    ASSERT_TRUE(h.Submit(steps.back()).ok());
    ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  }
  for (auto* p : steps) EXPECT_TRUE(h.Check(*p, kExact));
  EXPECT_EQ(engine->Metrics().steps_completed, steps.size());
}

// Two flows (say, a stream and its replacement after a reconnect) step the same
// sequence and layer alternately: the steps still run one per batch in the order
// submitted, each over the rows of the ones before it.
// Steps whose tensors lie in registered host memory (a same-host client's region) are
// moved by the device straight from and into it, beside staged steps in the same
// launch; one step sits at 2-byte (not 16-byte) aligned offsets. The CPU backend does
// not register memory, and the same steps run staged.
TEST_F(EngineTest, StepsInRegisteredHostMemory) {
  EngineOptions o = Model(2, 32, 2);
  o.batch_window = absl::Milliseconds(20);
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 31);
  const size_t region_bytes = size_t(8) << 20;
  std::vector<char> region(region_bytes + 4096);
  char* base = region.data() + (4096 - reinterpret_cast<uintptr_t>(region.data()) % 4096) % 4096;
  const uint64_t dev = engine->RegisterHostMemory(base, region_bytes);
#ifdef LATENTD_TEST_CUDA
  EXPECT_NE(dev, 0u) << "the CUDA backend registers host memory";
#else
  EXPECT_EQ(dev, 0u);
#endif
  std::vector<std::string> seqs = {h.NewSequence(70), h.NewSequence(300), h.NewSequence(1), h.NewSequence(129)};
  std::vector<Harness::Pending*> steps;
  std::vector<bool> direct;
  std::vector<int> modes;
  size_t at = 0;
  const MemoryRegion registered{base, dev, region_bytes};
  auto located = [&](char* p, size_t bytes) {
    const uint64_t offset = static_cast<uint64_t>(p - base);
    return dev != 0 ? TensorLocation::InHostRegion(registered, offset, bytes) : TensorLocation::Host(p, bytes);
  };
  // Mode 0: staged; 1: every tensor in the registered memory; 2: q and kv there only
  // (TensorLocation::kHostRegion), out and lse in the step's own buffers. Without a
  // registration (dev 0) they are plain host bytes that happen to lie there.
  for (int round = 0; round < 3; ++round)
    for (size_t i = 0; i < seqs.size(); ++i) {
      Harness::Pending* p = h.MakeStep(seqs[i], int(i % 2), 1 + int(i % 3), i % 2 == 1);
      const int mode = static_cast<int>((i + round) % 3);
      const bool in_region = mode == 1;
      modes.push_back(mode);
      if (mode == 2) {
        auto place = [&](size_t bytes) {
          char* ptr = base + at;
          at = (at + bytes + 15) / 16 * 16;
          return ptr;
        };
        char* q = place(p->q.size());
        std::memcpy(q, p->q.data(), p->q.size());
        char* kv = place(p->kv.size());
        std::memcpy(kv, p->kv.data(), p->kv.size());
        p->step.q = located(q, p->q.size());
        p->step.kv = located(kv, p->kv.size());
        ASSERT_LE(at, region_bytes);
      }
      if (in_region) {
        at += (i == 2 ? 2 : 0);  // one unaligned step
        auto place = [&](size_t bytes) {
          char* ptr = base + at;
          at = (at + bytes + 15) / 16 * 16 + (i == 2 ? 2 : 0);
          return ptr;
        };
        char* q = place(p->q.size());
        std::memcpy(q, p->q.data(), p->q.size());
        char* kv = place(p->kv.size());
        std::memcpy(kv, p->kv.data(), p->kv.size());
        char* out = place(p->out.size() * 2);
        std::memcpy(out, p->out.data(), p->out.size() * 2);
        at = (at + 3) / 4 * 4;
        char* lse = place(p->lse.size() * 4);
        std::memcpy(lse, p->lse.data(), p->lse.size() * 4);
        p->step.q = located(q, p->q.size());
        p->step.kv = located(kv, p->kv.size());
        p->step.out = located(out, p->out.size() * 2);
        p->step.lse = located(lse, p->lse.size() * 4);
        ASSERT_LE(at, region_bytes);
      }
      steps.push_back(p);
      direct.push_back(in_region);
    }
  ASSERT_TRUE(h.SubmitBatch(steps).ok());
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  for (size_t k = 0; k < steps.size(); ++k) {
    Harness::Pending* p = steps[k];
    if (direct[k]) {  // results are in the region: bring them home for the check
      std::memcpy(p->out.data(), p->step.out.host(), p->out.size() * 2);
      std::memcpy(p->lse.data(), p->step.lse.host(), p->lse.size() * 4);
    }
    EXPECT_TRUE(h.Check(*p, kExact)) << "step " << k
                                     << (modes[k] == 1   ? " (in registered memory)"
                                         : modes[k] == 2 ? " (inputs in registered memory)"
                                                         : " (staged)");
  }
  if (dev != 0) engine->UnregisterHostMemory(base);
}

TEST_F(EngineTest, SequenceLayerOrderHoldsAcrossFlows) {
  EngineOptions o = Model(2, 16);
  // Completion order is what this test reads: only the scheduler's own completions
  // keep the launch order across flows (the pool keeps it within each flow).
  o.completion_threads = 0;
  o.batch_window = absl::ZeroDuration();
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 33);
  const std::string s = h.NewSequence(60), blocker = h.NewSequence(1);
  StallScheduler(engine.get(), h, blocker);
  std::vector<Harness::Pending*> steps;
  for (int i = 0; i < 24; ++i) {
    steps.push_back(h.MakeStep(s, i % 4 < 2 ? 0 : 1, 1 + i % 3, i % 2 == 0));
    steps.back()->step.flow = 7 + (i * 5) % 3;
    ASSERT_TRUE(h.Submit(steps.back()).ok());
  }
  h.HoldCallbacks(false);
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  std::map<int, int> last_rank;
  for (auto* p : steps) {
    EXPECT_TRUE(h.Check(*p, kExact));
    EXPECT_GT(p->completion_rank, last_rank[p->step.layer]);
    last_rank[p->step.layer] = p->completion_rank;
  }
}

// An upload several chunks long lands exactly as one copy would.
TEST_F(EngineTest, LargeAppendIsChunkedAndExact) {
  EngineOptions o = Model(2, 16);
  o.kv_pages = 256;
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 34);
  const uint64_t chunks_before = engine->Metrics().append_chunks;
  const std::string s = h.NewSequence(3000);  // 3.4 MB per layer: four 1 MiB chunks
  EXPECT_EQ(engine->Metrics().append_chunks - chunks_before, 8u);
  auto info = engine->GetSequence(s);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->lengths, (std::vector<int64_t>{3000, 3000}));
  std::vector<Harness::Pending*> steps;
  for (int layer = 0; layer < 2; ++layer) {
    steps.push_back(h.MakeStep(s, layer, 2, true));
    ASSERT_TRUE(h.Submit(steps.back()).ok());
  }
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  // Within tolerance: a few long steps are split over keys across the CPU threads. A
  // row out of place or missing would be far outside it.
  for (auto* p : steps) EXPECT_TRUE(h.Check(*p, false));
}

std::string Rows(int n, char fill) { return std::string(size_t(n) * kernels::kHeadDimQK * 2, fill); }

// Pages taken by someone else between two chunks: the upload fails and the layer is
// back at its old length, holding its old pages.
TEST_F(EngineTest, LargeAppendFailingPartWayChangesNothing) {
  EngineOptions o = Model(1, 16);
  o.kv_pages = 40;
  bool in_hook = false, hogged = false;
  std::string hog;
  Engine* raw = nullptr;
  o.on_append_chunk_for_testing = [&] {
    if (in_hook || hogged) return;
    in_hook = true;
    hogged = raw->AppendKv(hog, 0, Rows(19 * 64, '\x11')).ok();  // leaves 6 pages
    in_hook = false;
  };
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  raw = engine.get();
  Harness h(engine.get(), 35);
  const std::string s = h.NewSequence(10);
  hog = *engine->CreateSequence("");
  const int64_t free_before = engine->Info().free_pages;  // 39
  // 1500 more rows need 23 more pages: they fit when the upload starts.
  auto r = engine->AppendKv(s, 0, Rows(1500, '\x22'));
  ASSERT_TRUE(hogged);
  EXPECT_TRUE(absl::IsResourceExhausted(r.status())) << r.status();
  auto info = engine->GetSequence(s);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->lengths[0], 10);
  EXPECT_EQ(info->pages, 1);
  EXPECT_EQ(engine->Info().free_pages, free_before - 19);
  // The old rows are intact: a step sees exactly the prefix.
  auto* p = h.MakeStep(s, 0, 1, false);
  ASSERT_TRUE(h.Submit(p).ok());
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  EXPECT_TRUE(h.Check(*p, kExact));
  // Too big for the whole cache: refused before any copy.
  EXPECT_TRUE(absl::IsInvalidArgument(engine->AppendKv(s, 0, Rows(41 * 64, '\x33')).status()));
}

// Another sequence's decode step runs to completion between two chunks of a large
// upload: the KV lock is not held across the whole copy (if it were, the step could
// not be staged and the wait below would time out).
TEST_F(EngineTest, DecodeProgressesDuringLargeAppend) {
  EngineOptions o = Model(1, 16);
  o.kv_pages = 256;
  o.batch_window = absl::ZeroDuration();
  Harness* harness = nullptr;
  std::string other;
  int hook_calls = 0, completed_between = 0;
  o.on_append_chunk_for_testing = [&] {
    ++hook_calls;
    if (harness == nullptr) return;
    Harness::Pending* p = harness->MakeStep(other, 0, 1, false);
    if (!harness->Submit(p).ok()) return;
    if (harness->WaitAll(absl::Seconds(30)) && harness->Check(*p, kExact)) ++completed_between;
  };
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 36);
  other = h.NewSequence(30);
  auto big = engine->CreateSequence("");
  ASSERT_TRUE(big.ok());
  harness = &h;
  auto r = engine->AppendKv(*big, 0, Rows(4000, '\x3c'));  // five chunks
  harness = nullptr;
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->lengths[0], 4000);
  EXPECT_EQ(hook_calls, 4);
  EXPECT_EQ(completed_between, 4);
}

TEST_F(EngineTest, MaxSequencesBoundsCreatesAndForks) {
  EngineOptions o = Model(1, 16);
  o.max_sequences = 3;
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(engine->CreateSequence("a").ok());
  ASSERT_TRUE(engine->CreateSequence("b").ok());
  ASSERT_TRUE(engine->ForkSequence("a", "a2").ok());
  auto c = engine->CreateSequence("c");
  EXPECT_TRUE(absl::IsResourceExhausted(c.status())) << c.status();
  EXPECT_NE(c.status().message().find("max_sequences: 3 live sequences; release some or raise --max_sequences"),
            std::string::npos)
      << c.status();
  auto f = engine->ForkSequence("b", "b2");
  EXPECT_TRUE(absl::IsResourceExhausted(f.status())) << f.status();
  EXPECT_TRUE(absl::IsNotFound(engine->GetSequence("b2").status()));
  EXPECT_EQ(engine->Metrics().rejected_max_sequences, 2u);
  EXPECT_EQ(engine->Metrics().sequences, 3);
  ASSERT_TRUE(engine->ReleaseSequence("a").ok());
  EXPECT_TRUE(engine->CreateSequence("c").ok());
  EXPECT_TRUE(absl::IsResourceExhausted(engine->ForkSequence("c", "").status()));
}

TEST_F(EngineTest, GetSequenceReportsLengthsAndPagesWithoutTouching) {
  auto engine = Make(Model(2, 16));
  ASSERT_NE(engine, nullptr);
  Harness h(engine.get(), 37);
  const std::string s = h.NewSequence(130);  // three pages; two full on every layer
  ASSERT_TRUE(engine->AppendKv(s, 1, Rows(10, '\x01')).ok());
  auto info = engine->GetSequence(s);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->sequence_id, s);
  EXPECT_EQ(info->lengths, (std::vector<int64_t>{130, 140}));
  EXPECT_EQ(info->pages, 3);
  EXPECT_EQ(info->shared_pages, 0);
  const std::string child = h.Fork(s);
  info = engine->GetSequence(s);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->shared_pages, 2);  // the filled pages; the tail was copied
  auto missing = engine->GetSequence("nope");
  EXPECT_TRUE(absl::IsNotFound(missing.status()));
  EXPECT_NE(missing.status().message().find("sequence_id"), std::string::npos) << missing.status();
  // Reads are not use: polling a sequence does not keep it alive.
  const absl::Time used = info->last_used;
  absl::SleepFor(absl::Milliseconds(20));
  info = engine->GetSequence(s);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->last_used, used);
  EXPECT_EQ(engine->ReleaseIdleSequences(absl::Milliseconds(10)), 2);
  EXPECT_TRUE(absl::IsNotFound(engine->GetSequence(s).status()));
}

// More idle sequences than one pass of the sweep releases: all go, the one in use
// stays.
TEST_F(EngineTest, IdleSweepReleasesInBoundedPasses) {
  EngineOptions o = Model(1, 16);
  o.kv_pages = 64;
  auto engine = Make(o);
  ASSERT_NE(engine, nullptr);
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(engine->CreateSequence("").ok());
  absl::SleepFor(absl::Milliseconds(20));
  Harness h(engine.get(), 38);
  const std::string busy = h.NewSequence(5);
  EXPECT_EQ(engine->ReleaseIdleSequences(absl::Milliseconds(10)), 1000);
  EXPECT_EQ(engine->Metrics().sequences, 1);
  EXPECT_TRUE(engine->GetSequence(busy).ok());
}

// An fp8_e4m3 cache: rows are quantized as they are appended (AppendKv and steps' own
// rows), forks and copy-on-write carry the stored bytes, and every result matches the
// oracle over the same rows quantized and dequantized (bit-exact on the CPU backend).
TEST_F(EngineTest, Fp8CacheMatchesOracleOverDequantizedRows) {
  for (kernels::DType dtype : {kernels::DType::kBF16, kernels::DType::kFP16}) {
    EngineOptions o = Model(2, 32, 2);
    o.model.dtype = dtype;
    o.kv_dtype = kernels::KvDType::kFp8E4M3;
    o.batch_window = absl::Milliseconds(5);
    auto engine = Make(o);
    ASSERT_NE(engine, nullptr);
    const EngineInfo info = engine->Info();
    EXPECT_EQ(info.kv_dtype, kernels::KvDType::kFp8E4M3);
    EXPECT_EQ(info.kv_bytes_per_token, 656 * 2 * 2);
    Harness h(engine.get(), 40 + static_cast<int>(dtype));
    std::vector<std::string> seqs;
    for (int p : {0, 1, 63, 64, 130}) seqs.push_back(h.NewSequence(p));
    seqs.push_back(h.Fork(seqs.back()));  // shares 130 rows' pages; the next steps copy on write
    std::vector<Harness::Pending*> steps;
    for (int round = 0; round < 2; ++round)
      for (const auto& s : seqs)
        for (int layer = 0; layer < 2; ++layer) {
          const int s_q = 1 + (round + layer) % 3;
          steps.push_back(h.MakeStep(s, layer, s_q, s_q > 1));
          ASSERT_TRUE(h.Submit(steps.back()).ok());
        }
    ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
    for (auto* p : steps) EXPECT_TRUE(h.Check(*p, kExact)) << kernels::DTypeName(dtype);
  }
}

// Pool sizing follows the stored row size: the same bytes hold 1152 / 656 = 1.76x the
// pages of a bf16 cache.
TEST_F(EngineTest, Fp8CacheHoldsMorePagesInTheSameBytes) {
  EngineOptions o = Model(4, 16, 1);
  o.backend = kBackend;
  o.cpu_threads = 2;
  o.kv_bytes = int64_t{64} << 20;  // not Make(): it would fix kv_pages
  auto bf16 = Engine::Create(o);
  o.kv_dtype = kernels::KvDType::kFp8E4M3;
  auto fp8 = Engine::Create(o);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  EXPECT_EQ((*bf16)->Info().kv_dtype, kernels::KvDType::kModel);
  EXPECT_EQ((*bf16)->Info().kv_bytes_per_token, 4 * 576 * 2);
  EXPECT_EQ((*fp8)->Info().kv_bytes_per_token, 4 * 656);
  EXPECT_GE(double((*fp8)->Info().total_pages), 1.7 * double((*bf16)->Info().total_pages));
}

}  // namespace
}  // namespace latentd::engine
