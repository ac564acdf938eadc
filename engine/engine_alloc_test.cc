// The decode hot path allocates nothing per step: once the engine has served a few
// rounds, submitting, batching, attending and completing further steps makes no heap
// allocation on any thread. Counted by replacing the global operator new in this test
// binary. Built for the CPU backend (CI) and, with LATENTD_TEST_CUDA, the CUDA one.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "absl/synchronization/mutex.h"
#include "engine/engine.h"
#include "engine/model/config.h"
#include "engine/model/safetensors.h"
#include "engine/model/testing/checkpoint_writer.h"
#include "engine/model/weights.h"
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

// Counts results; the steps and their buffers are the test's, built before counting.
class Counter : public StepCallback {
 public:
  void StepDone(DecodeStep*, absl::Status status) override {
    absl::MutexLock lock(&mu_);
    ok_ += status.ok() ? 1 : 0;
    ++done_;
  }
  bool Wait(int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(60));
  }
  int ok() {
    absl::MutexLock lock(&mu_);
    return ok_;
  }

 private:
  absl::Mutex mu_;
  int done_ ABSL_GUARDED_BY(mu_) = 0;
  int ok_ ABSL_GUARDED_BY(mu_) = 0;
};

// The same for layer steps (hidden states in, the layer's output back): the projections
// run in buffers sized at start.
TEST(EngineAllocTest, SteadyStateLayerStepsAllocateNothing) {
  namespace mt = model::testing;
  mt::TinyModelSpec spec;
  spec.num_layers = 2;
  spec.hidden_size = 192;
  spec.q_lora_rank = 96;
  spec.kv_lora_rank = 512;
  spec.qk_rope_head_dim = 64;
  spec.qk_nope_head_dim = 32;
  spec.v_head_dim = 32;
  const std::string dir = mt::TempDir("alloc_layer");
  mt::WriteTinyModel(mt::MakeTinyModel(spec), dir, 1, false);
  auto config = model::LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto ckpt = model::Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto weights = model::LoadAttentionWeights(*ckpt, *config);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EngineOptions o;
  o.model.num_layers = 2;
  o.model.num_heads_q = spec.num_heads;
  o.model.dtype = config->dtype;
  o.backend = kBackend;
  o.cpu_threads = 2;
  o.kv_pages = 256;
  o.max_batch_tokens = 64;
  o.layer_max_positions = 4096;
  o.layer_config = std::make_shared<const model::ModelConfig>(*config);
  o.layer_weights = std::make_shared<const model::AttentionWeights>(*std::move(weights));
  auto engine = Engine::Create(o);
#ifdef LATENTD_TEST_CUDA
  if (!engine.ok()) GTEST_SKIP() << "no CUDA device: " << engine.status();
#endif
  ASSERT_TRUE(engine.ok()) << engine.status();
  const int H = spec.hidden_size;
  std::vector<std::string> seqs;
  for (int i = 0; i < 8; ++i) {
    auto id = (*engine)->CreateSequence("");
    ASSERT_TRUE(id.ok());
    for (int l = 0; l < 2; ++l)
      ASSERT_TRUE((*engine)->AppendHidden(*id, l, std::string(size_t(65) * H * 2, '\x3c')).ok());
    seqs.push_back(*id);
  }
  struct Step {
    DecodeStep step;
    std::vector<uint16_t> hidden, out;
  };
  Counter counter;
  // One round: every sequence on each layer, s_q 1 and 2 (at most 3 tokens per sequence
  // and layer in the rounds below: no new page).
  auto build = [&](std::vector<std::unique_ptr<Step>>* steps, int rounds) {
    for (int r = 0; r < rounds; ++r)
      for (size_t i = 0; i < seqs.size(); ++i)
        for (int l = 0; l < 2; ++l) {
          auto p = std::make_unique<Step>();
          const int s_q = 1 + int((i + l) % 2);
          p->hidden.assign(size_t(s_q) * H, static_cast<uint16_t>(0x3c00 + 37 * (i + r + l)));
          p->out.assign(p->hidden.size(), 0);
          p->step.sequence_id = seqs[i];
          p->step.layer = l;
          p->step.s_q = s_q;
          p->step.causal = true;
          p->step.hidden = TensorLocation::Host(p->hidden.data(), p->hidden.size() * 2);
          p->step.layer_out = TensorLocation::Host(p->out.data(), p->out.size() * 2);
          p->step.callback = &counter;
          steps->push_back(std::move(p));
        }
  };
  // Rounds go in one after another: a sequence's steps on one layer run in order.
  auto run = [&](std::vector<std::unique_ptr<Step>>& steps, int first_done) {
    const int per_round = static_cast<int>(seqs.size()) * 2;
    for (size_t k = 0; k < steps.size(); k += per_round) {
      for (int j = 0; j < per_round; ++j)
        if (!(*engine)->Submit(&steps[k + j]->step).ok()) return false;
      if (!counter.Wait(first_done + static_cast<int>(k) + per_round)) return false;
    }
    return true;
  };
  std::vector<std::unique_ptr<Step>> warm, measured;
  build(&warm, 1);
  build(&measured, 2);
  ASSERT_TRUE(run(warm, 0));
  g_allocations = 0;
  g_counting = true;
  const bool done = run(measured, static_cast<int>(warm.size()));
  g_counting = false;
  ASSERT_TRUE(done);
  EXPECT_EQ(g_allocations.load(), 0) << "heap allocations while serving " << measured.size() << " layer steps";
  EXPECT_EQ(counter.ok(), static_cast<int>(warm.size() + measured.size()));
}

}  // namespace
}  // namespace latentd::engine
