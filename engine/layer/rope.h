// DeepSeek-V3's rotary position embedding with YaRN scaling, as Hugging Face's
// modeling_deepseek.py computes it, for the CPU layer math: a cos/sin table built once up to a
// bounded position, applied in place to float vectors (q_pe of each head, k_pe of a latent row).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/model/config.h"

namespace latentd::engine::layer {

// The rotary part of a model config, separate from ModelConfig so tests can vary it.
struct RopeConfig {
  int dim = 64;                            // qk_rope_head_dim: the rotated values per head
  double theta = 10000.0;                  // rope_theta
  std::optional<model::YarnScaling> yarn;  // none: plain RoPE, no attention factor
  bool interleave = true;                  // rope_interleave: pairs (x0, x1), (x2, x3), ... (DeepSeek's checkpoints)

  static RopeConfig FromModel(const model::ModelConfig& config);
};

// Immutable after construction, so one table serves any number of threads.
class Rope {
 public:
  // The table holds max_positions * dim floats; this bound keeps it at or below 256 MiB at
  // dim 64 (DeepSeek-V3's context is 163840 positions).
  static constexpr int kMaxPositions = 1 << 20;
  static constexpr int kMaxDim = 256;

  // INVALID_ARGUMENT (naming the field) unless dim is even and in [2, kMaxDim], theta > 1,
  // 1 <= max_positions <= kMaxPositions, and YaRN's factor, original_max_position_embeddings
  // and betas are positive.
  static absl::StatusOr<Rope> Create(const RopeConfig& config, int max_positions);

  int dim() const { return dim_; }
  int max_positions() const { return max_positions_; }
  bool interleave() const { return interleave_; }

  // HF's inv_freq buffer (dim / 2 values): YaRN's blend of interpolated and extrapolated
  // frequencies, computed in float32 step by step as torch does.
  absl::Span<const float> inv_freq() const { return inv_freq_; }
  // _mscale = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim), which
  // multiplies cos and sin; 1 without YaRN.
  double attention_factor() const { return attention_factor_; }
  // cos_cached / sin_cached of HF at (position, i) for i < dim / 2 (HF repeats them for the
  // second half), attention factor included, float32.
  float Cos(int position, int i) const { return cos_[static_cast<size_t>(position) * half_ + i]; }
  float Sin(int position, int i) const { return sin_[static_cast<size_t>(position) * half_ + i]; }
  // The whole tables, [max_positions, dim / 2] row-major (Cos(p, i) at p * dim / 2 + i), for
  // copies to another device.
  absl::Span<const float> cos_table() const { return cos_; }
  absl::Span<const float> sin_table() const { return sin_; }

  // Rotates x (dim values) in place for `position`. Interleaved input is read as pairs
  // (x0, x1), (x2, x3), ... and written the way HF's apply_rotary_pos_emb leaves it, de-interleaved:
  // [rotated x0, x2, ..., x_{d-2} | rotated x1, x3, ..., x_{d-1}]; scores only need q_pe and k_pe
  // in the same layout. OUT_OF_RANGE for a position outside [0, max_positions),
  // INVALID_ARGUMENT for a span of another length.
  absl::Status Apply(int64_t position, absl::Span<float> x) const;

  // Apply without the checks, for callers that validated position and length already.
  void ApplyUnchecked(int position, float* x) const;

 private:
  Rope() = default;

  int dim_ = 0;
  int half_ = 0;
  int max_positions_ = 0;
  bool interleave_ = true;
  double attention_factor_ = 1.0;
  std::vector<float> inv_freq_;   // [dim / 2]
  std::vector<float> cos_, sin_;  // [max_positions, dim / 2]
};

}  // namespace latentd::engine::layer
