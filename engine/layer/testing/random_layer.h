// A small MLA layer with random weights for engine/layer's tests (hidden 256, 4 heads, the
// decode kernel's 512 + 64 row): its config.json fields and its weights in the model dtype.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/model/config.h"
#include "engine/model/weights.h"
#include "kernels/params.h"

namespace latentd::engine::layer::testing {

inline constexpr int kHidden = 256, kHeads = 4, kNope = 128, kRope = 64, kV = 128, kRank = 512;

// rms_norm_eps 1e-6, rope_theta 10000; with `yarn`, YaRN factor 40 over 4096 original
// positions with mscale_all_dim 0.8 (not DeepSeek-V3's 1, so RoPE's attention factor is not
// 1); without it, plain RoPE.
model::ModelConfig SmallConfig(kernels::DType dtype, std::optional<int> q_lora_rank, bool interleave = true,
                               bool yarn = true);

// Random model-dtype values N(mean, sigma^2) (never all zero).
model::HostTensor Random(const std::string& name, std::vector<int64_t> shape, double mean, double sigma,
                         kernels::DType dtype, std::mt19937_64& rng);

// Weights for every head of `c` (kHeads), scaled so that attention scores spread over a few
// units: the softmax is neither uniform nor one-hot.
model::AttentionLayerWeights RandomWeights(const model::ModelConfig& c, std::mt19937_64& rng);

}  // namespace latentd::engine::layer::testing
