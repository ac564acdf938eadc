// The --model preset table and its softmax-scale derivation. docs/deployment.md lists the
// same values; server/presets_test.cc pins them.
#include "server/presets.h"

#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace latentd::server {
namespace {

// Values from each model's config.json on Hugging Face (num_hidden_layers,
// num_attention_heads, qk_nope_head_dim, qk_rope_head_dim, rope_scaling):
//
//   deepseek-ai/DeepSeek-V3 (and DeepSeek-R1, the same architecture): 61 layers,
//     128 heads, rope_scaling {type yarn, factor 40, mscale 1.0, mscale_all_dim 1.0,
//     original_max_position_embeddings 4096}. The checkpoint's extra multi-token-
//     prediction module (num_nextn_predict_layers 1) is not counted: a stack that runs
//     it through latentd for speculative decoding adds --num_layers=62.
//   deepseek-ai/DeepSeek-V2-Lite: 27 layers, 16 heads, rope_scaling {yarn, factor 40,
//     mscale 0.707, mscale_all_dim 0.707}.
//   moonshotai/Kimi-K2-Instruct (and -Base): 61 layers, 64 heads, rope_scaling {yarn,
//     factor 32, mscale 1.0, mscale_all_dim 1.0} (128K context).
//   moonshotai/Kimi-K2-Instruct-0905: the same, but factor 64 (256K context), which
//     changes the scale: a separate entry.
//
// Every one has kv_lora_rank 512 and qk_rope_head_dim 64 (latentd's 576 = 512 + 64),
// and qk_nope_head_dim 128.
const std::vector<ModelPreset>* const kPresets = new std::vector<ModelPreset>{
    {"deepseek-v3", "deepseek-ai/DeepSeek-V3", 61, 128, 128, 64, 40.0, 1.0},
    {"deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", 27, 16, 128, 64, 40.0, 0.707},
    {"kimi-k2", "moonshotai/Kimi-K2-Instruct", 61, 64, 128, 64, 32.0, 1.0},
    {"kimi-k2-0905", "moonshotai/Kimi-K2-Instruct-0905", 61, 64, 128, 64, 64.0, 1.0},
};

// Other names for a table entry: models whose attention is identical.
const std::vector<std::pair<const char*, const char*>>* const kAliases =
    new std::vector<std::pair<const char*, const char*>>{
        {"deepseek-r1", "deepseek-v3"},
    };

}  // namespace

// yarn_get_mscale in DeepSeek's modeling code: 0.1 * m * ln(factor) + 1 for factor > 1.
// With scaling off (factor <= 1) there is no correction.
double YarnMscale(double factor, double mscale_all_dim) {
  if (factor <= 1.0) return 1.0;
  return 0.1 * mscale_all_dim * std::log(factor) + 1.0;
}

// DeepSeek's attention sets softmax_scale = q_head_dim^-0.5 and, when rope_scaling has
// mscale_all_dim, multiplies it by mscale^2 (YaRN's temperature, applied to the logits
// rather than folded into q and k). q_head_dim is the original per-head query/key width,
// qk_nope_head_dim + qk_rope_head_dim = 192. The absorbed form latentd computes (q_nope
// multiplied into W_UK, so q . k runs over the 512-wide latent plus the 64 rope values)
// gives exactly the same dot product as the original 192-wide one, so the scale must
// stay 1/sqrt(192)-based, not 1/sqrt(576) (latentd's default without a preset).
double PresetSoftmaxScale(const ModelPreset& p) {
  const double m = YarnMscale(p.yarn_factor, p.yarn_mscale_all_dim);
  return m * m / std::sqrt(static_cast<double>(p.qk_nope_head_dim + p.qk_rope_head_dim));
}

const std::vector<ModelPreset>& ModelPresets() { return *kPresets; }

std::string KnownPresetNames() {
  std::vector<std::string> names;
  for (const ModelPreset& p : *kPresets) names.push_back(p.name);
  for (const auto& [alias, target] : *kAliases) names.push_back(absl::StrCat(alias, " (= ", target, ")"));
  return absl::StrJoin(names, ", ");
}

absl::StatusOr<ResolvedPreset> ResolvePreset(absl::string_view name, int tensor_parallel) {
  std::string key = absl::AsciiStrToLower(name);
  for (const auto& [alias, target] : *kAliases) {
    if (key == alias) key = target;
  }
  const ModelPreset* found = nullptr;
  for (const ModelPreset& p : *kPresets) {
    if (key == p.name) found = &p;
  }
  if (found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--model: unknown model '", name, "'; known: ", KnownPresetNames()));
  }
  if (tensor_parallel < 1 || found->num_heads_q_total % tensor_parallel != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--tensor_parallel: ", tensor_parallel, " does not divide ",
                                                   found->name, "'s ", found->num_heads_q_total,
                                                   " query heads"));
  }
  ResolvedPreset r;
  r.name = found->name;
  r.num_layers = found->num_layers;
  r.num_heads_q = found->num_heads_q_total / tensor_parallel;
  r.num_heads_kv = 1;
  r.dtype = "bf16";
  r.softmax_scale = PresetSoftmaxScale(*found);
  r.tensor_parallel = tensor_parallel;
  return r;
}

}  // namespace latentd::server
