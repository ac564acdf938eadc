// Random layers for engine/layer's tests (random_layer.h).
#include "engine/layer/testing/random_layer.h"

#include <cmath>

#include "kernels/cpu/half.h"

namespace latentd::engine::layer::testing {

using kernels::DType;

model::ModelConfig SmallConfig(DType dtype, std::optional<int> q_lora_rank, bool interleave, bool yarn) {
  model::ModelConfig c;
  c.path = "test/config.json";
  c.hidden_size = kHidden;
  c.num_attention_heads = kHeads;
  c.q_lora_rank = q_lora_rank;
  c.kv_lora_rank = kRank;
  c.qk_nope_head_dim = kNope;
  c.qk_rope_head_dim = kRope;
  c.v_head_dim = kV;
  c.num_hidden_layers = 1;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000;
  c.rope_interleave = interleave;
  if (yarn) {
    model::YarnScaling y;
    y.factor = 40;
    y.original_max_position_embeddings = 4096;
    y.beta_fast = 32;
    y.beta_slow = 1;
    y.mscale = 1.0;
    y.mscale_all_dim = 0.8;
    c.yarn = y;
  }
  c.dtype = dtype;
  return c;
}

model::HostTensor Random(const std::string& name, std::vector<int64_t> shape, double mean, double sigma, DType dtype,
                         std::mt19937_64& rng) {
  model::HostTensor t;
  t.name = name;
  t.shape = shape;
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  std::normal_distribution<double> normal(mean, sigma);
  t.values.resize(count);
  for (uint16_t& v : t.values) v = kernels::FloatToHalf(dtype, static_cast<float>(normal(rng)));
  return t;
}

model::AttentionLayerWeights RandomWeights(const model::ModelConfig& c, std::mt19937_64& rng) {
  const DType dt = c.dtype;
  const int64_t qk = kNope + kRope;
  model::AttentionLayerWeights w;
  if (c.q_lora_rank) {
    const int64_t rq = *c.q_lora_rank;
    w.q_a_proj = Random("q_a_proj.weight", {rq, kHidden}, 0, 1 / std::sqrt(double{kHidden}), dt, rng);
    w.q_a_layernorm = Random("q_a_layernorm.weight", {rq}, 1, 0.1, dt, rng);
    w.q_b_proj = Random("q_b_proj.weight", {kHeads * qk, rq}, 0, 1.2 / std::sqrt(double(rq)), dt, rng);
  } else {
    w.q_proj = Random("q_proj.weight", {kHeads * qk, kHidden}, 0, 1.2 / std::sqrt(double{kHidden}), dt, rng);
  }
  w.kv_a_proj_with_mqa =
      Random("kv_a_proj_with_mqa.weight", {kRank + kRope, kHidden}, 0, 1 / std::sqrt(double{kHidden}), dt, rng);
  w.kv_a_layernorm = Random("kv_a_layernorm.weight", {kRank}, 1, 0.1, dt, rng);
  w.kv_b_proj = Random("kv_b_proj.weight", {kHeads * (kNope + kV), kRank}, 0, 1.2 / std::sqrt(double{kRank}), dt, rng);
  w.o_proj = Random("o_proj.weight", {kHidden, kHeads * kV}, 0, 1 / std::sqrt(double{kHeads * kV}), dt, rng);
  return w;
}

}  // namespace latentd::engine::layer::testing
