// Layer steps through the engine (CPU backend): hidden states in, the layer's output out,
// and uploads of hidden states, against the same layer math driven by hand around the
// kernel-level API of a second engine (the math itself is checked against a float64
// reference in engine/layer/layer_math_test); and the layer API's errors.
#include "engine/layer_stage.h"

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "engine/attention_backend.h"
#include "engine/engine.h"
#include "engine/layer/layer_math.h"
#include "engine/model/config.h"
#include "engine/model/safetensors.h"
#include "engine/model/testing/checkpoint_writer.h"
#include "engine/model/weights.h"
#include "gtest/gtest.h"
#include "kernels/cpu/half.h"

namespace latentd::engine {
namespace {

using kernels::DType;
using kernels::kHeadDimQK;
using kernels::kHeadDimV;
namespace mt = model::testing;

struct Loaded {
  std::shared_ptr<const model::ModelConfig> config;
  std::shared_ptr<const model::AttentionWeights> weights;
};

mt::TinyModelSpec Spec(mt::WeightFormat format, bool q_lora, uint32_t seed) {
  mt::TinyModelSpec s;
  s.format = format;
  s.q_lora = q_lora;
  s.seed = seed;
  s.num_layers = 2;
  s.hidden_size = 192;
  s.num_heads = 4;
  s.q_lora_rank = 96;
  s.kv_lora_rank = 512;  // the decode kernel's row: 512 latent + 64 rope values
  s.qk_rope_head_dim = 64;
  s.qk_nope_head_dim = 32;
  s.v_head_dim = 32;
  return s;
}

Loaded Load(const mt::TinyModelSpec& spec, const std::string& name) {
  const std::string dir = mt::TempDir(name);
  mt::WriteTinyModel(mt::MakeTinyModel(spec), dir, 2, true);
  auto config = model::LoadModelConfig(dir);
  EXPECT_TRUE(config.ok()) << config.status();
  auto ckpt = model::Checkpoint::Open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  auto w = model::LoadAttentionWeights(*ckpt, *config);
  EXPECT_TRUE(w.ok()) << w.status();
  return {std::make_shared<const model::ModelConfig>(*config),
          std::make_shared<const model::AttentionWeights>(*std::move(w))};
}

#ifdef LATENTD_TEST_CUDA
constexpr BackendKind kLayeredBackend = BackendKind::kCuda;
#else
constexpr BackendKind kLayeredBackend = BackendKind::kCpu;
#endif

// The engine under test runs on kLayeredBackend; the hand-driven one always on the CPU.
EngineOptions Options(const Loaded& m, bool with_weights) {
  EngineOptions o;
  o.backend = with_weights ? kLayeredBackend : BackendKind::kCpu;
  o.model.num_layers = m.config->num_hidden_layers;
  o.model.num_heads_q = m.weights->num_heads;
  o.model.num_heads_kv = 1;
  o.model.dtype = m.config->dtype;
  o.model.softmax_scale = static_cast<float>(model::SoftmaxScale(*m.config));
  o.kv_pages = 64;
  o.max_batch_size = 16;
  o.max_batch_tokens = 64;
  o.cpu_threads = 2;
  o.layer_max_positions = 4096;
  if (with_weights) {
    o.layer_config = m.config;
    o.layer_weights = m.weights;
  }
  return o;
}

// Collects results; one Wait per submitted set.
class Waiter : public StepCallback {
 public:
  void StepDone(DecodeStep* step, absl::Status status) override {
    absl::MutexLock lock(&mu_);
    statuses_.push_back(status);
    ++done_;
  }
  // Waits for `n` results in all, then returns the statuses so far.
  std::vector<absl::Status> Wait(int n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(60));
    return statuses_;
  }

 private:
  absl::Mutex mu_;
  int done_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
};

std::vector<uint16_t> RandomHidden(int n, int hidden, DType dt, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> x(size_t(n) * hidden);
  for (auto& v : x) v = kernels::FloatToHalf(dt, normal(rng));
  return x;
}

std::string Bytes(const std::vector<uint16_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 2);
}

// The layer by hand: the layer math's queries and rows, a kernel-level step on an engine
// without weights, the layer math's output.
class ByHand {
 public:
  ByHand(const Loaded& m, Engine* kernel_engine) : m_(m), engine_(kernel_engine) {
    layer::LayerMathOptions lo;
    lo.num_heads = m.weights->num_heads;
    lo.max_positions = 4096;
    for (const auto& lw : m.weights->layers) {
      auto math = layer::CpuLayerMath::Create(*m.config, lw, lo);
      EXPECT_TRUE(math.ok()) << math.status();
      math_.push_back(*std::move(math));
    }
  }

  std::vector<int64_t> Positions(int64_t first, int n) {
    std::vector<int64_t> p(n);
    for (int i = 0; i < n; ++i) p[i] = first + i;
    return p;
  }

  void Append(const std::string& id, int layer, const std::vector<uint16_t>& x, int64_t first) {
    const int n = static_cast<int>(x.size() / m_.config->hidden_size);
    std::vector<uint16_t> rows(size_t(n) * kHeadDimQK);
    ASSERT_TRUE(math_[layer]->LatentRows(x, Positions(first, n), absl::MakeSpan(rows)).ok());
    ASSERT_TRUE(engine_->AppendKv(id, layer, Bytes(rows)).ok());
  }

  // The layer's output for s_q tokens at positions first.. (their rows appended first).
  std::vector<uint16_t> Step(const std::string& id, int layer, const std::vector<uint16_t>& x, int64_t first,
                             bool causal) {
    const int h = m_.weights->num_heads, s_q = static_cast<int>(x.size() / m_.config->hidden_size);
    std::vector<uint16_t> q(size_t(s_q) * h * kHeadDimQK), rows(size_t(s_q) * kHeadDimQK);
    EXPECT_TRUE(math_[layer]->Queries(x, Positions(first, s_q), absl::MakeSpan(q)).ok());
    EXPECT_TRUE(math_[layer]->LatentRows(x, Positions(first, s_q), absl::MakeSpan(rows)).ok());
    std::vector<uint16_t> latent(size_t(s_q) * h * kHeadDimV);
    std::vector<float> lse(size_t(s_q) * h);
    Waiter w;
    DecodeStep s;
    s.sequence_id = id;
    s.layer = layer;
    s.s_q = s_q;
    s.causal = causal;
    s.q = TensorLocation::Host(q.data(), q.size() * 2);
    s.kv = TensorLocation::Host(rows.data(), rows.size() * 2);
    s.out = TensorLocation::Host(latent.data(), latent.size() * 2);
    s.lse = TensorLocation::Host(lse.data(), lse.size() * 4);
    s.callback = &w;
    EXPECT_TRUE(engine_->Submit(&s).ok());
    auto st = w.Wait(1);
    EXPECT_TRUE(st[0].ok()) << st[0];
    std::vector<uint16_t> out(x.size());
    EXPECT_TRUE(math_[layer]->Output(s_q, latent, absl::MakeSpan(out)).ok());
    return out;
  }

 private:
  const Loaded& m_;
  Engine* engine_;
  std::vector<std::unique_ptr<layer::CpuLayerMath>> math_;
};

// Max |a - b| over the RMS of b.
double RelErr(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, DType dt) {
  double num = 0, rms = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double x = kernels::HalfToFloat(dt, a[i]), y = kernels::HalfToFloat(dt, b[i]);
    num = std::max(num, std::fabs(x - y));
    rms += y * y;
  }
  return num / std::sqrt(rms / b.size());
}

struct LayerStep {
  DecodeStep step;
  std::vector<uint16_t> x, out;
};

void MakeLayerStep(LayerStep* p, const std::string& id, int layer, std::vector<uint16_t> x, int hidden, bool causal,
                   StepCallback* cb) {
  p->x = std::move(x);
  p->out.assign(p->x.size(), 0);
  p->step.sequence_id = id;
  p->step.layer = layer;
  p->step.s_q = static_cast<int>(p->x.size() / hidden);
  p->step.causal = causal;
  p->step.hidden = TensorLocation::Host(p->x.data(), p->x.size() * 2);
  p->step.layer_out = TensorLocation::Host(p->out.data(), p->out.size() * 2);
  p->step.callback = cb;
}

class LayerStageTest : public ::testing::TestWithParam<std::tuple<mt::WeightFormat, bool>> {
 protected:
  void SetUp() override {
#ifdef LATENTD_TEST_CUDA
    if (!CudaDevicePresent()) GTEST_SKIP() << "no CUDA device";
#endif
  }
};

TEST_P(LayerStageTest, StepsAndUploadsMatchTheLayerDrivenByHand) {
  const auto [format, q_lora] = GetParam();
  const Loaded m = Load(Spec(format, q_lora, 7), "layer_stage");
  auto layered = Engine::Create(Options(m, true));
  ASSERT_TRUE(layered.ok()) << layered.status();
  auto plain = Engine::Create(Options(m, false));
  ASSERT_TRUE(plain.ok()) << plain.status();
  ByHand hand(m, plain->get());
  const int H = m.config->hidden_size;
  const DType dt = m.config->dtype;
  EXPECT_TRUE((*layered)->Info().layer_api);
  EXPECT_EQ((*layered)->Info().hidden_size, H);
  EXPECT_GT((*layered)->Info().weight_bytes, 0);
  EXPECT_FALSE((*plain)->Info().layer_api);

  std::mt19937_64 rng(11);
  // Prefixes across page edges (63, 64, 65, 150 tokens), uploaded as hidden states.
  const std::vector<int> prefixes = {63, 64, 65, 150};
  std::vector<std::string> ids;
  for (size_t i = 0; i < prefixes.size(); ++i) {
    const std::string id = "seq" + std::to_string(i);
    ASSERT_TRUE((*layered)->CreateSequence(id).ok());
    ASSERT_TRUE((*plain)->CreateSequence(id).ok());
    for (int l = 0; l < 2; ++l) {
      auto x = RandomHidden(prefixes[i], H, dt, rng);
      auto lengths = (*layered)->AppendHidden(id, l, Bytes(x));
      ASSERT_TRUE(lengths.ok()) << lengths.status();
      EXPECT_EQ(lengths->lengths[l], prefixes[i]);
      hand.Append(id, l, x, 0);
    }
    ids.push_back(id);
  }
  // Rounds of steps: every sequence on one layer in one batch (s_q 1..3, causal), then
  // the other layer; the layer's output against the hand-driven one.
  std::vector<int64_t> length(prefixes.begin(), prefixes.end());
  for (int round = 0; round < 4; ++round) {
    for (int l = 0; l < 2; ++l) {
      Waiter w;
      std::vector<std::unique_ptr<LayerStep>> steps;
      std::vector<DecodeStep*> ptrs;
      for (size_t i = 0; i < ids.size(); ++i) {
        const int s_q = 1 + static_cast<int>((i + round) % 3);
        steps.push_back(std::make_unique<LayerStep>());
        MakeLayerStep(steps.back().get(), ids[i], l, RandomHidden(s_q, H, dt, rng), H, /*causal=*/true, &w);
        ptrs.push_back(&steps.back()->step);
      }
      std::vector<absl::Status> submitted(ptrs.size());
      (*layered)->SubmitBatch(ptrs.data(), static_cast<int>(ptrs.size()), submitted.data());
      for (const auto& s : submitted) ASSERT_TRUE(s.ok()) << s;
      auto done = w.Wait(static_cast<int>(ptrs.size()));
      for (const auto& s : done) ASSERT_TRUE(s.ok()) << s;
      for (size_t i = 0; i < ids.size(); ++i) {
        const LayerStep& p = *steps[i];
        const int64_t first = l == 0 ? length[i] : length[i] - p.step.s_q;
        if (l == 0) length[i] += p.step.s_q;
        auto expected = hand.Step(ids[i], l, p.x, first, true);
        const double err = RelErr(p.out, expected, dt);
        EXPECT_LT(err, 0.02) << "round " << round << " layer " << l << " seq " << i;
        // The engine gave the step's q, kv, out and lse back unset.
        EXPECT_FALSE(p.step.q.set() || p.step.kv.set() || p.step.out.set() || p.step.lse.set());
      }
    }
  }
  auto info = (*layered)->GetSequence(ids[3]);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->lengths[0], length[3]);
  EXPECT_EQ(info->lengths[1], length[3]);
}

INSTANTIATE_TEST_SUITE_P(Formats, LayerStageTest,
                         ::testing::Combine(::testing::Values(mt::WeightFormat::kBF16, mt::WeightFormat::kFP16,
                                                              mt::WeightFormat::kFP8),
                                            ::testing::Bool()));

TEST(LayerStageErrors, NamesTheField) {
  const Loaded m = Load(Spec(mt::WeightFormat::kBF16, true, 3), "layer_errors");
  auto layered = Engine::Create(Options(m, true));
  ASSERT_TRUE(layered.ok()) << layered.status();
  auto plain = Engine::Create(Options(m, false));
  ASSERT_TRUE(plain.ok());
  const int H = m.config->hidden_size;
  std::mt19937_64 rng(5);
  ASSERT_TRUE((*layered)->CreateSequence("a").ok());
  ASSERT_TRUE((*plain)->CreateSequence("a").ok());
  Waiter w;

  // Without weights: the layer API is refused.
  LayerStep p;
  MakeLayerStep(&p, "a", 0, RandomHidden(1, H, m.config->dtype, rng), H, false, &w);
  absl::Status st = (*plain)->Submit(&p.step);
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_NE(st.message().find("hidden"), std::string::npos) << st;
  st = (*plain)->AppendHidden("a", 0, Bytes(p.x)).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;

  // Wrong sizes, q given beside hidden, a position past the table.
  LayerStep bad;
  MakeLayerStep(&bad, "a", 0, RandomHidden(1, H, m.config->dtype, rng), H, false, &w);
  bad.step.hidden = TensorLocation::Host(bad.x.data(), bad.x.size() * 2 - 2);
  st = (*layered)->Submit(&bad.step);
  EXPECT_TRUE(absl::IsInvalidArgument(st) && st.message().find("hidden: expected") != std::string::npos) << st;
  MakeLayerStep(&bad, "a", 0, RandomHidden(1, H, m.config->dtype, rng), H, false, &w);
  std::vector<uint16_t> q(4 * kHeadDimQK);
  bad.step.q = TensorLocation::Host(q.data(), q.size() * 2);
  st = (*layered)->Submit(&bad.step);
  EXPECT_TRUE(absl::IsInvalidArgument(st) && st.message().find("q:") != std::string::npos) << st;
  MakeLayerStep(&bad, "a", 0, RandomHidden(2, H, m.config->dtype, rng), H, false, &w);
  bad.step.q = TensorLocation();
  bad.step.position = 4095;
  st = (*layered)->Submit(&bad.step);
  EXPECT_TRUE(absl::IsOutOfRange(st) && st.message().find("position") != std::string::npos) << st;
  st = (*layered)->AppendHidden("a", 0, std::string(H * 2 + 1, '\x01')).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st) && st.message().find("hidden") != std::string::npos) << st;
  st = (*layered)->AppendHidden("nope", 0, std::string(H * 2, '\x01')).status();
  EXPECT_TRUE(absl::IsNotFound(st)) << st;
  st = (*layered)->AppendHidden("a", 2, std::string(H * 2, '\x01')).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st) && st.message().find("layer") != std::string::npos) << st;

  // An unknown sequence fails in the engine, after acceptance.
  LayerStep lost;
  MakeLayerStep(&lost, "gone", 1, RandomHidden(1, H, m.config->dtype, rng), H, false, &w);
  ASSERT_TRUE((*layered)->Submit(&lost.step).ok());
  auto done = w.Wait(1);
  EXPECT_TRUE(absl::IsNotFound(done[0])) << done[0];
  EXPECT_FALSE(lost.step.q.set());

  // Weights that do not match the engine's model.
  EngineOptions o = Options(m, true);
  o.model.num_heads_q = 8;
  st = Engine::Create(o).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st) && st.message().find("num_heads_q") != std::string::npos) << st;
  o = Options(m, true);
  o.model.num_layers = 3;
  st = Engine::Create(o).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st) && st.message().find("num_layers") != std::string::npos) << st;
  o = Options(m, true);
  o.model.softmax_scale = 0.1f;
  st = Engine::Create(o).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st) && st.message().find("softmax_scale") != std::string::npos) << st;
}

// Kernel-level steps and layer steps share a daemon: a batch may hold both.
TEST(LayerStageMixed, KernelStepsBesideLayerSteps) {
  const Loaded m = Load(Spec(mt::WeightFormat::kBF16, false, 9), "layer_mixed");
  auto layered = Engine::Create(Options(m, true));
  ASSERT_TRUE(layered.ok());
  auto plain = Engine::Create(Options(m, false));
  ASSERT_TRUE(plain.ok());
  ByHand hand(m, plain->get());
  const int H = m.config->hidden_size, h = m.weights->num_heads;
  const DType dt = m.config->dtype;
  std::mt19937_64 rng(21);
  for (const char* id : {"k", "l"}) {
    ASSERT_TRUE((*layered)->CreateSequence(id).ok());
    ASSERT_TRUE((*plain)->CreateSequence(id).ok());
  }
  auto prefix = RandomHidden(70, H, dt, rng);
  ASSERT_TRUE((*layered)->AppendHidden("l", 0, Bytes(prefix)).ok());
  hand.Append("l", 0, prefix, 0);
  ASSERT_TRUE((*layered)->AppendHidden("k", 0, Bytes(prefix)).ok());
  hand.Append("k", 0, prefix, 0);

  // The kernel-level step: the same q and row the hand path would make, so its latent
  // output must be the hand path's.
  Waiter w;
  auto kx = RandomHidden(1, H, dt, rng);
  auto expected_k = hand.Step("k", 0, kx, 70, false);
  layer::LayerMathOptions lo;
  lo.num_heads = h;
  lo.max_positions = 4096;
  auto math = layer::CpuLayerMath::Create(*m.config, m.weights->layers[0], lo);
  ASSERT_TRUE(math.ok());
  std::vector<uint16_t> q(size_t(h) * kHeadDimQK), row(kHeadDimQK), latent(size_t(h) * kHeadDimV), kout(H);
  std::vector<float> lse(h);
  ASSERT_TRUE((*math)->Queries(kx, {70}, absl::MakeSpan(q)).ok());
  ASSERT_TRUE((*math)->LatentRows(kx, {70}, absl::MakeSpan(row)).ok());
  DecodeStep ks;
  ks.sequence_id = "k";
  ks.q = TensorLocation::Host(q.data(), q.size() * 2);
  ks.kv = TensorLocation::Host(row.data(), row.size() * 2);
  ks.out = TensorLocation::Host(latent.data(), latent.size() * 2);
  ks.lse = TensorLocation::Host(lse.data(), lse.size() * 4);
  ks.callback = &w;
  LayerStep ls;
  auto lx = RandomHidden(2, H, dt, rng);
  MakeLayerStep(&ls, "l", 0, lx, H, true, &w);
  DecodeStep* both[] = {&ks, &ls.step};
  absl::Status sts[2];
  (*layered)->SubmitBatch(both, 2, sts);
  ASSERT_TRUE(sts[0].ok() && sts[1].ok()) << sts[0] << sts[1];
  for (const auto& s : w.Wait(2)) ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE((*math)->Output(1, latent, absl::MakeSpan(kout)).ok());
  EXPECT_LT(RelErr(kout, expected_k, dt), 0.02);
  EXPECT_LT(RelErr(ls.out, hand.Step("l", 0, lx, 70, true), dt), 0.02);

  // Explicit positions: a step at position 500 sees RoPE of 500, not of the length.
  LayerStep at;
  auto ax = RandomHidden(1, H, dt, rng);
  MakeLayerStep(&at, "l", 0, ax, H, false, &w);
  at.step.position = 500;
  ASSERT_TRUE((*layered)->Submit(&at.step).ok());
  for (const auto& s : w.Wait(3)) ASSERT_TRUE(s.ok()) << s;
  EXPECT_LT(RelErr(at.out, hand.Step("l", 0, ax, 500, false), dt), 0.02);
}

}  // namespace
}  // namespace latentd::engine
