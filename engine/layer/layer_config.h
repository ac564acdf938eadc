// What both layer-math implementations (CpuLayerMath, CudaLayerMath) accept: the decode
// kernel's row widths, the per-rank options, and the checks of a model config and a layer's
// weights against them, so the two report the same errors for the same input.
#pragma once

#include <memory>

#include <cstdint>

#include "absl/status/status.h"
#include "engine/model/config.h"
#include "engine/model/weights.h"
#include "kernels/params.h"

namespace latentd::engine::layer {

inline constexpr int kLatentRank = kernels::kHeadDimV;                     // kv_lora_rank the kernel reads: 512
inline constexpr int kRopeDim = kernels::kHeadDimQK - kernels::kHeadDimV;  // qk_rope_head_dim: 64

class Rope;  // rope.h

struct LayerMathOptions {
  int num_heads = 0;      // this rank's heads (AttentionWeights::num_heads)
  int max_positions = 0;  // positions [0, max_positions) have a rotary table entry
  // CpuLayerMath: a rotary table to share (every layer of a model has the same one;
  // DeepSeek-V3's is 42 MB), used instead of building one when set.
  std::shared_ptr<const Rope> rope;
};

// INVALID_ARGUMENT naming the field: kv_lora_rank other than 512 or qk_rope_head_dim other
// than 64 (the decode kernel's row), a non-positive dimension, num_heads outside
// [1, num_attention_heads], or an rms_norm_eps that is negative or not finite. The rotary
// fields and max_positions are Rope::Create's to check.
absl::Status CheckLayerConfig(const model::ModelConfig& config, const LayerMathOptions& options);

// INVALID_ARGUMENT naming the tensor: a weight whose shape or value count is not the one
// config.json implies for options.num_heads heads (q_a_proj, q_a_layernorm and q_b_proj when
// q_lora_rank is set, q_proj otherwise; kv_a_proj_with_mqa, kv_a_layernorm, o_proj, kv_b_proj),
// checked in that order. Assumes CheckLayerConfig passed.
absl::Status CheckLayerWeights(const model::ModelConfig& config, const model::AttentionLayerWeights& weights,
                               const LayerMathOptions& options);

}  // namespace latentd::engine::layer
