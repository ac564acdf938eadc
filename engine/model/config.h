// The attention-relevant part of a Hugging Face MLA model's config.json (DeepSeek-V2/V3/R1,
// Kimi-K2), parsed into a plain struct, and the softmax scale DeepSeek-V3's attention
// derives from it. docs/model-checkpoints.md lists what is read and checked.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/params.h"

namespace latentd::engine::model {

// rope_scaling with type (or rope_type) "yarn". Absent keys take the defaults of
// DeepSeek's DeepseekV3YarnRotaryEmbedding.
struct YarnScaling {
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};

// quantization_config with quant_method "fp8": e4m3 weights, one float32 multiplier
// (`<name>_scale_inv`) per block of weight_block_size [rows, cols].
struct Fp8BlockQuantization {
  int block_rows = 0;
  int block_cols = 0;
};

struct ModelConfig {
  std::string path;  // the config.json it came from, for error messages

  int hidden_size = 0;
  int num_attention_heads = 0;
  std::optional<int> q_lora_rank;  // null: a plain q_proj instead of q_a/q_b
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  int num_hidden_layers = 0;
  int64_t max_position_embeddings = 0;  // 0: absent from config.json
  double rms_norm_eps = 0;
  double rope_theta = 0;
  bool rope_interleave = true;       // absent in DeepSeek's own configs, which interleave
  std::optional<YarnScaling> yarn;   // rope_scaling null or absent: no scaling
  kernels::DType dtype = kernels::DType::kBF16;  // torch_dtype: bfloat16 or float16
  std::string quant_method;          // quantization_config.quant_method, empty without one
  std::optional<Fp8BlockQuantization> fp8;

  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

// Parses config.json's text; `path` names the file in every error. INVALID_ARGUMENT names
// the key and what was expected for malformed JSON, a missing required key, a value of
// the wrong type or out of range, and an unsupported rope_scaling type or torch_dtype.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text, const std::string& path);

// Reads and parses DIR/config.json (NOT_FOUND when it is missing).
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);

// yarn_get_mscale of DeepSeek's modeling code: 0.1 * mscale * ln(factor) + 1, or 1 for
// factor <= 1.
double YarnGetMscale(double factor, double mscale);

// The attention's softmax scale as DeepSeek-V3 computes it: (qk_nope + qk_rope)^-0.5,
// times yarn_get_mscale(factor, mscale_all_dim)^2 when rope_scaling is YaRN with a
// nonzero mscale_all_dim. The absorbed form gives the same q.k dot products as the
// 192-wide original, so the scale stays based on the original head width.
double SoftmaxScale(const ModelConfig& config);

}  // namespace latentd::engine::model
