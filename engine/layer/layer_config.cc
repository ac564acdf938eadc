// The config and weight-shape checks CpuLayerMath and CudaLayerMath share (layer_config.h).
#include "engine/layer/layer_config.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace latentd::engine::layer {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) absl::StrAppend(&s, i ? ", " : "", shape[i]);
  return s + "]";
}

absl::Status CheckTensor(const model::HostTensor& t, const char* field, const std::vector<int64_t>& shape) {
  const std::string name = t.name.empty() ? std::string(field) : absl::StrCat(field, " (", t.name, ")");
  if (t.shape != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected shape ", ShapeString(shape), ", got ", ShapeString(t.shape)));
  }
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  if (static_cast<int64_t>(t.values.size()) != count) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected ", count, " values for shape ", ShapeString(shape), ", got ", t.values.size()));
  }
  return absl::OkStatus();
}

absl::Status Positive(const char* field, int64_t v) {
  if (v >= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": expected >= 1, got ", v));
}

}  // namespace

absl::Status CheckLayerConfig(const model::ModelConfig& config, const LayerMathOptions& options) {
  // The decode kernel's row is 512 latent + 64 rope values; other widths would need another kernel.
  if (config.kv_lora_rank != kLatentRank) {
    return absl::InvalidArgumentError(absl::StrCat("kv_lora_rank: expected ", kLatentRank,
                                                   " (the decode kernel's latent width), got ", config.kv_lora_rank));
  }
  if (config.qk_rope_head_dim != kRopeDim) {
    return absl::InvalidArgumentError(absl::StrCat("qk_rope_head_dim: expected ", kRopeDim,
                                                   " (the decode kernel's rope width), got ", config.qk_rope_head_dim));
  }
  for (absl::Status s :
       {Positive("hidden_size", config.hidden_size), Positive("qk_nope_head_dim", config.qk_nope_head_dim),
        Positive("v_head_dim", config.v_head_dim), Positive("q_lora_rank", config.q_lora_rank.value_or(1))}) {
    if (!s.ok()) return s;
  }
  if (options.num_heads < 1 || options.num_heads > config.num_attention_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_heads: expected [1, num_attention_heads = ", config.num_attention_heads, "], got ", options.num_heads));
  }
  if (!(config.rms_norm_eps >= 0) || !std::isfinite(config.rms_norm_eps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rms_norm_eps: expected a finite number >= 0, got ", config.rms_norm_eps));
  }
  return absl::OkStatus();
}

absl::Status CheckLayerWeights(const model::ModelConfig& config, const model::AttentionLayerWeights& weights,
                               const LayerMathOptions& options) {
  const int64_t H = config.hidden_size, h = options.num_heads, nope = config.qk_nope_head_dim,
                v = config.v_head_dim, qk = nope + kRopeDim;
  std::vector<absl::Status> checks;
  if (config.q_lora_rank.has_value()) {
    const int64_t rq = *config.q_lora_rank;
    checks.push_back(CheckTensor(weights.q_a_proj, "q_a_proj", {rq, H}));
    checks.push_back(CheckTensor(weights.q_a_layernorm, "q_a_layernorm", {rq}));
    checks.push_back(CheckTensor(weights.q_b_proj, "q_b_proj", {h * qk, rq}));
  } else {
    checks.push_back(CheckTensor(weights.q_proj, "q_proj", {h * qk, H}));
  }
  checks.push_back(CheckTensor(weights.kv_a_proj_with_mqa, "kv_a_proj_with_mqa", {kLatentRank + kRopeDim, H}));
  checks.push_back(CheckTensor(weights.kv_a_layernorm, "kv_a_layernorm", {kLatentRank}));
  checks.push_back(CheckTensor(weights.o_proj, "o_proj", {H, h * v}));
  checks.push_back(CheckTensor(weights.kv_b_proj, "kv_b_proj", {h * (nope + v), kLatentRank}));
  for (const absl::Status& s : checks) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace latentd::engine::layer
