// The YaRN rotary table: every quantity is computed in float32 in the order of HF's
// DeepseekV3YarnRotaryEmbedding (torch runs it in float32), so the table matches the model's
// cos_cached / sin_cached before their cast to the model dtype.
#include "engine/layer/rope.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace latentd::engine::layer {
namespace {

constexpr double kPi = 3.14159265358979323846;

// yarn_find_correction_dim: the (fractional) dimension index whose wavelength fits
// `rotations` full turns into the original context. Python floats, so double.
double CorrectionDim(double rotations, int dim, double theta, double original_max) {
  return dim * std::log(original_max / (rotations * 2 * kPi)) / (2 * std::log(theta));
}

}  // namespace

RopeConfig RopeConfig::FromModel(const model::ModelConfig& config) {
  RopeConfig c;
  c.dim = config.qk_rope_head_dim;
  c.theta = config.rope_theta;
  c.yarn = config.yarn;
  c.interleave = config.rope_interleave;
  return c;
}

absl::StatusOr<Rope> Rope::Create(const RopeConfig& config, int max_positions) {
  if (config.dim < 2 || config.dim > kMaxDim || config.dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("qk_rope_head_dim: expected an even number in [2, ", kMaxDim, "], got ", config.dim));
  }
  if (!(config.theta > 1.0) || !std::isfinite(config.theta)) {
    return absl::InvalidArgumentError(absl::StrCat("rope_theta: expected a finite number > 1, got ", config.theta));
  }
  if (max_positions < 1 || max_positions > kMaxPositions) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_positions: expected [1, ", kMaxPositions, "], got ", max_positions));
  }
  if (config.yarn.has_value()) {
    const model::YarnScaling& y = *config.yarn;
    if (!(y.factor > 0) || !std::isfinite(y.factor)) {
      return absl::InvalidArgumentError(absl::StrCat("rope_scaling.factor: expected > 0, got ", y.factor));
    }
    if (y.original_max_position_embeddings < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rope_scaling.original_max_position_embeddings: expected >= 1, got ", y.original_max_position_embeddings));
    }
    if (!(y.beta_fast > 0) || !(y.beta_slow > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("rope_scaling.beta_fast, beta_slow: expected > 0, got ", y.beta_fast, ", ", y.beta_slow));
    }
  }

  Rope r;
  r.dim_ = config.dim;
  r.half_ = config.dim / 2;
  r.max_positions_ = max_positions;
  r.interleave_ = config.interleave;
  r.inv_freq_.resize(r.half_);

  // float32 like torch: theta ** (arange(0, dim, 2) / dim), then reciprocals.
  const float theta = static_cast<float>(config.theta);
  std::vector<float> powers(r.half_);
  for (int i = 0; i < r.half_; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(config.dim);
    powers[i] = std::pow(theta, exponent);
  }
  if (!config.yarn.has_value()) {
    for (int i = 0; i < r.half_; ++i) r.inv_freq_[i] = 1.0f / powers[i];
  } else {
    const model::YarnScaling& y = *config.yarn;
    const double original = static_cast<double>(y.original_max_position_embeddings);
    // yarn_find_correction_range: floor of the fast end, ceil of the slow end, clamped to the
    // dimension range (dim - 1, not dim / 2 - 1, as in the model).
    const int low =
        std::max(static_cast<int>(std::floor(CorrectionDim(y.beta_fast, config.dim, config.theta, original))), 0);
    const int high = std::min(
        static_cast<int>(std::ceil(CorrectionDim(y.beta_slow, config.dim, config.theta, original))), config.dim - 1);
    // yarn_linear_ramp_mask: (i - low) / (high - low) clamped to [0, 1], with high nudged by
    // 0.001 when the range is empty.
    const float span = low == high ? static_cast<float>(high + 0.001 - low) : static_cast<float>(high - low);
    const float factor = static_cast<float>(y.factor);
    for (int i = 0; i < r.half_; ++i) {
      const float extrapolated = 1.0f / powers[i];
      const float interpolated = 1.0f / (factor * powers[i]);
      const float ramp = std::clamp((static_cast<float>(i) - static_cast<float>(low)) / span, 0.0f, 1.0f);
      const float keep = 1.0f - ramp;  // HF's inv_freq_mask: the extrapolated share
      const float a = interpolated * (1.0f - keep);
      const float b = extrapolated * keep;
      r.inv_freq_[i] = a + b;
    }
    r.attention_factor_ = model::YarnGetMscale(y.factor, y.mscale) / model::YarnGetMscale(y.factor, y.mscale_all_dim);
  }

  // freqs = outer(float32 positions, inv_freq); cos/sin of that float32 angle (evaluated in
  // double and rounded, within torch's float32 cosf), times _mscale as a float32 product.
  const float attention = static_cast<float>(r.attention_factor_);
  const size_t entries = static_cast<size_t>(max_positions) * r.half_;
  r.cos_.resize(entries);
  r.sin_.resize(entries);
  for (int p = 0; p < max_positions; ++p) {
    for (int i = 0; i < r.half_; ++i) {
      const float angle = static_cast<float>(p) * r.inv_freq_[i];
      const size_t at = static_cast<size_t>(p) * r.half_ + i;
      r.cos_[at] = static_cast<float>(std::cos(static_cast<double>(angle))) * attention;
      r.sin_[at] = static_cast<float>(std::sin(static_cast<double>(angle))) * attention;
    }
  }
  return r;
}

absl::Status Rope::Apply(int64_t position, absl::Span<float> x) const {
  if (position < 0 || position >= max_positions_) {
    return absl::OutOfRangeError(
        absl::StrCat("position ", position, " outside the rotary table [0, ", max_positions_, ")"));
  }
  if (static_cast<int64_t>(x.size()) != dim_) {
    return absl::InvalidArgumentError(absl::StrCat("rope: expected ", dim_, " values, got ", x.size()));
  }
  ApplyUnchecked(static_cast<int>(position), x.data());
  return absl::OkStatus();
}

void Rope::ApplyUnchecked(int position, float* x) const {
  const float* c = &cos_[static_cast<size_t>(position) * half_];
  const float* s = &sin_[static_cast<size_t>(position) * half_];
  // HF: out = x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1], on the
  // de-interleaved view when interleaved. Pair i is (first, second) below.
  float first[kMaxDim / 2], second[kMaxDim / 2];
  for (int i = 0; i < half_; ++i) {
    first[i] = interleave_ ? x[2 * i] : x[i];
    second[i] = interleave_ ? x[2 * i + 1] : x[i + half_];
  }
  for (int i = 0; i < half_; ++i) {
    x[i] = first[i] * c[i] - second[i] * s[i];
    x[i + half_] = second[i] * c[i] + first[i] * s[i];
  }
}

}  // namespace latentd::engine::layer
