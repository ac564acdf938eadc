// Model presets for --model: the attention shape of public MLA models (layers, query
// heads per tensor-parallel rank, latent KV heads, dtype, softmax scale with the YaRN
// correction), so an operator names the model instead of deriving five numbers.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace latentd::server {

// One model as published (its config.json), before tensor parallelism.
struct ModelPreset {
  const char* name;
  const char* source;          // where the numbers come from (Hugging Face repository)
  int num_layers;              // num_hidden_layers (MTP modules excluded)
  int num_heads_q_total;       // num_attention_heads, all ranks together
  int qk_nope_head_dim;        // 128 for every model here
  int qk_rope_head_dim;        // 64 for every model here
  double yarn_factor;          // rope_scaling.factor
  double yarn_mscale_all_dim;  // rope_scaling.mscale_all_dim
};

// What one daemon serves: the shape for one tensor-parallel rank.
struct ResolvedPreset {
  std::string name;  // canonical name (an alias resolves to its model)
  int num_layers = 0;
  int num_heads_q = 0;  // per rank
  int num_heads_kv = 1;
  std::string dtype;  // "bf16"
  double softmax_scale = 0;
  int tensor_parallel = 1;
};

// YaRN's attention-temperature factor, as DeepSeek's reference code computes it.
double YarnMscale(double factor, double mscale_all_dim);

// mscale^2 / sqrt(qk_nope_head_dim + qk_rope_head_dim).
double PresetSoftmaxScale(const ModelPreset& p);

// The table, canonical names only.
const std::vector<ModelPreset>& ModelPresets();

// Every accepted name, aliases included, comma-separated (for errors and --help).
std::string KnownPresetNames();

// Case-insensitive lookup; INVALID_ARGUMENT for an unknown name (listing the known
// ones) or a tensor-parallel degree that does not divide the model's query heads.
absl::StatusOr<ResolvedPreset> ResolvePreset(absl::string_view name, int tensor_parallel);

}  // namespace latentd::server
