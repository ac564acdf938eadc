// CpuLayerMath: the MLA layer's projections as float32 sgemm calls (OpenBLAS), with the model
// dtype's roundings applied between them where Hugging Face's DeepseekV3Attention has them.
#include "engine/layer/layer_math.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/half.h"

namespace latentd::engine::layer {
namespace {

using kernels::DType;

float* Grow(std::vector<float>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Converts a weight CheckLayerWeights accepted to float32.
void ToFloat(const model::HostTensor& t, DType dtype, std::vector<float>& out) {
  out.resize(t.values.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = kernels::HalfToFloat(dtype, t.values[i]);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuLayerMath>> CpuLayerMath::Create(const model::ModelConfig& config,
                                                                   const model::AttentionLayerWeights& weights,
                                                                   const LayerMathOptions& options) {
  if (absl::Status s = CheckLayerConfig(config, options); !s.ok()) return s;
  std::shared_ptr<const Rope> table = options.rope;
  if (table == nullptr) {
    absl::StatusOr<Rope> rope = Rope::Create(RopeConfig::FromModel(config), options.max_positions);
    if (!rope.ok()) return rope.status();
    table = std::make_shared<const Rope>(*std::move(rope));
  }

  std::unique_ptr<CpuLayerMath> m(new CpuLayerMath(std::move(table)));
  auto shared = std::make_shared<Weights>();
  Weights& w = *shared;
  const DType dt = config.dtype;
  const int64_t h = options.num_heads, nope = config.qk_nope_head_dim, v = config.v_head_dim;
  m->dtype_ = dt;
  m->hidden_ = config.hidden_size;
  m->heads_ = options.num_heads;
  m->nope_ = config.qk_nope_head_dim;
  m->v_dim_ = config.v_head_dim;
  m->eps_ = static_cast<float>(config.rms_norm_eps);
  m->has_q_lora_ = config.q_lora_rank.has_value();

  if (absl::Status s = CheckLayerWeights(config, weights, options); !s.ok()) return s;
  auto matrix = [&](const model::HostTensor& t, Matrix& out) {
    out.rows = static_cast<int>(t.shape[0]);
    out.cols = static_cast<int>(t.shape[1]);
    ToFloat(t, dt, out.values);
  };
  if (m->has_q_lora_) {
    m->q_rank_ = *config.q_lora_rank;
    matrix(weights.q_a_proj, w.q_a);
    ToFloat(weights.q_a_layernorm, dt, w.q_a_norm);
    matrix(weights.q_b_proj, w.q_b);
  } else {
    matrix(weights.q_proj, w.q_proj);
  }
  matrix(weights.kv_a_proj_with_mqa, w.kv_a);
  ToFloat(weights.kv_a_layernorm, dt, w.kv_a_norm);
  matrix(weights.o_proj, w.o_proj);
  std::vector<float> kv_b;
  ToFloat(weights.kv_b_proj, dt, kv_b);

  // kv_b_proj is [h * (nope + v), 512], per head nope rows of W_UK then v rows of W_UV; both are
  // copied out contiguously so each head's GEMM reads one dense [rows, 512] block.
  w.w_uk.resize(static_cast<size_t>(h * nope * kLatentRank));
  w.w_uv.resize(static_cast<size_t>(h * v * kLatentRank));
  for (int64_t j = 0; j < h; ++j) {
    const float* head = kv_b.data() + j * (nope + v) * kLatentRank;
    std::copy(head, head + nope * kLatentRank, w.w_uk.begin() + j * nope * kLatentRank);
    std::copy(head + nope * kLatentRank, head + (nope + v) * kLatentRank, w.w_uv.begin() + j * v * kLatentRank);
  }
  m->w_ = std::move(shared);
  return m;
}

void CpuLayerMath::ShareScratch(const CpuLayerMath& other) { s_ = other.s_; }

void CpuLayerMath::Reserve(int n) {
  const size_t t = static_cast<size_t>(std::max(n, 1)), h = static_cast<size_t>(heads_);
  Grow(s_->x, t * hidden_);
  Grow(s_->q_a_out, t * q_rank_);
  Grow(s_->q_full, t * h * (nope_ + kRopeDim));
  Grow(s_->q_out, t * h * (kLatentRank + kRopeDim));
  Grow(s_->kv, t * (kLatentRank + kRopeDim));
  Grow(s_->latent, t * h * kLatentRank);
  Grow(s_->o, t * h * v_dim_);
  Grow(s_->out, t * hidden_);
}

extern "C" int blas_thread_shutdown_(void);  // OpenBLAS's own, exported by the pthread build
extern "C" int blas_thread_init(void);

void RestartBlasThreads() {
  blas_thread_shutdown_();
  blas_thread_init();
}

std::unique_ptr<CpuLayerMath> CpuLayerMath::Clone() const {
  std::unique_ptr<CpuLayerMath> c(new CpuLayerMath(rope_));
  c->dtype_ = dtype_;
  c->hidden_ = hidden_;
  c->heads_ = heads_;
  c->q_rank_ = q_rank_;
  c->nope_ = nope_;
  c->v_dim_ = v_dim_;
  c->eps_ = eps_;
  c->has_q_lora_ = has_q_lora_;
  c->w_ = w_;
  return c;
}

void CpuLayerMath::Round(float* v, size_t count) const {
  for (size_t i = 0; i < count; ++i) v[i] = kernels::HalfToFloat(dtype_, kernels::FloatToHalf(dtype_, v[i]));
}

void CpuLayerMath::Linear(const float* x, int n, const Matrix& w, float* y) const {
  // nn.Linear: y = x . W^T with W [out, in] row-major; the model's GEMM accumulates in float32
  // and writes its dtype.
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, w.rows, w.cols, 1.0f, x, w.cols, w.values.data(), w.cols,
              0.0f, y, w.rows);
  Round(y, static_cast<size_t>(n) * w.rows);
}

void CpuLayerMath::RmsNorm(float* v, int n, int width, int64_t stride, const std::vector<float>& weight) const {
  // DeepseekV3RMSNorm: x * rsqrt(mean(x^2) + eps) in float32, cast to the input dtype, then
  // weight * that in the model dtype (a second rounding).
  for (int t = 0; t < n; ++t) {
    float* row = v + t * stride;
    double sum = 0;
    for (int i = 0; i < width; ++i) sum += static_cast<double>(row[i]) * row[i];
    const float variance = static_cast<float>(sum / width);
    const float inv = 1.0f / std::sqrt(variance + eps_);
    for (int i = 0; i < width; ++i) {
      const float normed = kernels::HalfToFloat(dtype_, kernels::FloatToHalf(dtype_, row[i] * inv));
      row[i] = kernels::HalfToFloat(dtype_, kernels::FloatToHalf(dtype_, weight[i] * normed));
    }
  }
}

int64_t CpuLayerMath::weight_bytes() const {
  size_t n = w_->q_a_norm.size() + w_->kv_a_norm.size() + w_->w_uk.size() + w_->w_uv.size();
  for (const Matrix* m : {&w_->q_a, &w_->q_b, &w_->q_proj, &w_->kv_a, &w_->o_proj}) n += m->values.size();
  return static_cast<int64_t>(n * sizeof(float));
}

absl::Status CpuLayerMath::CheckTokens(size_t x_size, absl::Span<const int64_t> positions, size_t out_size,
                                       size_t out_width, const char* out_name) const {
  const size_t n = positions.size();
  if (x_size != n * hidden_) {
    return absl::InvalidArgumentError(absl::StrCat("x: expected ", n, " tokens x hidden_size ", hidden_, " = ",
                                                   n * hidden_, " values, got ", x_size));
  }
  if (out_size != n * out_width) {
    return absl::InvalidArgumentError(
        absl::StrCat(out_name, ": expected ", n, " x ", out_width, " = ", n * out_width, " values, got ", out_size));
  }
  for (size_t t = 0; t < n; ++t) {
    if (positions[t] < 0 || positions[t] >= rope_->max_positions()) {
      return absl::OutOfRangeError(absl::StrCat("positions[", t, "] = ", positions[t],
                                                ": outside [0, max_positions = ", rope_->max_positions(), ")"));
    }
  }
  if (n > static_cast<size_t>(INT32_MAX / (heads_ * kernels::kHeadDimQK + hidden_))) {
    return absl::InvalidArgumentError(absl::StrCat("positions: ", n, " tokens is too large a batch"));
  }
  return absl::OkStatus();
}

const float* CpuLayerMath::HiddenAsFloat(absl::Span<const uint16_t> x) {
  float* xf = Grow(s_->x, x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = kernels::HalfToFloat(dtype_, x[i]);
  return xf;
}

absl::Status CpuLayerMath::Queries(absl::Span<const uint16_t> x, absl::Span<const int64_t> positions,
                                   absl::Span<uint16_t> q) {
  const size_t width = static_cast<size_t>(heads_) * kernels::kHeadDimQK;
  if (absl::Status s = CheckTokens(x.size(), positions, q.size(), width, "q"); !s.ok()) return s;
  QueriesFloat(HiddenAsFloat(x), positions, q.data());
  return absl::OkStatus();
}

absl::Status CpuLayerMath::Queries(absl::Span<const float> x, absl::Span<const int64_t> positions,
                                   absl::Span<uint16_t> q) {
  const size_t width = static_cast<size_t>(heads_) * kernels::kHeadDimQK;
  if (absl::Status s = CheckTokens(x.size(), positions, q.size(), width, "q"); !s.ok()) return s;
  QueriesFloat(x.data(), positions, q.data());
  return absl::OkStatus();
}

void CpuLayerMath::QueriesFloat(const float* x, absl::Span<const int64_t> positions, uint16_t* q) {
  const int n = static_cast<int>(positions.size());
  if (n == 0) return;
  const int qk = nope_ + kRopeDim;
  const int q_width = heads_ * qk;
  float* full = Grow(s_->q_full, static_cast<size_t>(n) * q_width);
  if (has_q_lora_) {
    float* a = Grow(s_->q_a_out, static_cast<size_t>(n) * q_rank_);
    Linear(x, n, w_->q_a, a);
    RmsNorm(a, n, q_rank_, q_rank_, w_->q_a_norm);
    Linear(a, n, w_->q_b, full);
  } else {
    Linear(x, n, w_->q_proj, full);
  }

  const int out_width = heads_ * kernels::kHeadDimQK;
  float* out = Grow(s_->q_out, static_cast<size_t>(n) * out_width);
  // Absorption, head by head: q_lat_h [n, 512] = q_nope_h [n, nope] . W_UK_h [nope, 512], read
  // in place from q (row stride h * qk) and written in place into the output rows.
  for (int j = 0; j < heads_; ++j) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, kLatentRank, nope_, 1.0f, full + j * qk, q_width,
                w_->w_uk.data() + static_cast<size_t>(j) * nope_ * kLatentRank, kLatentRank, 0.0f,
                out + j * kernels::kHeadDimQK, out_width);
  }
  for (int t = 0; t < n; ++t) {
    for (int j = 0; j < heads_; ++j) {
      float* pe = full + static_cast<size_t>(t) * q_width + j * qk + nope_;
      rope_->ApplyUnchecked(static_cast<int>(positions[t]), pe);
      std::copy(pe, pe + kRopeDim, out + static_cast<size_t>(t) * out_width + j * kernels::kHeadDimQK + kLatentRank);
    }
  }
  // One rounding for both parts: the absorbed query (the kernel reads model-dtype q) and the
  // roped q_pe (the model's RoPE output is a model-dtype tensor).
  const size_t count = static_cast<size_t>(n) * out_width;
  for (size_t i = 0; i < count; ++i) q[i] = kernels::FloatToHalf(dtype_, out[i]);
}

absl::Status CpuLayerMath::LatentRows(absl::Span<const uint16_t> x, absl::Span<const int64_t> positions,
                                      absl::Span<uint16_t> rows) {
  if (absl::Status s = CheckTokens(x.size(), positions, rows.size(), kernels::kHeadDimQK, "rows"); !s.ok()) return s;
  LatentRowsFloat(HiddenAsFloat(x), positions, rows.data());
  return absl::OkStatus();
}

absl::Status CpuLayerMath::LatentRows(absl::Span<const float> x, absl::Span<const int64_t> positions,
                                      absl::Span<uint16_t> rows) {
  if (absl::Status s = CheckTokens(x.size(), positions, rows.size(), kernels::kHeadDimQK, "rows"); !s.ok()) return s;
  LatentRowsFloat(x.data(), positions, rows.data());
  return absl::OkStatus();
}

void CpuLayerMath::LatentRowsFloat(const float* x, absl::Span<const int64_t> positions, uint16_t* rows) {
  const int n = static_cast<int>(positions.size());
  if (n == 0) return;
  constexpr int kRow = kernels::kHeadDimQK;
  float* kv = Grow(s_->kv, static_cast<size_t>(n) * kRow);
  Linear(x, n, w_->kv_a, kv);                        // [c | k_pe], rounded
  RmsNorm(kv, n, kLatentRank, kRow, w_->kv_a_norm);  // c only; k_pe is not normalised
  for (int t = 0; t < n; ++t) rope_->ApplyUnchecked(static_cast<int>(positions[t]), kv + t * kRow + kLatentRank);
  // c is already in the model dtype; this rounds the roped k_pe.
  const size_t count = static_cast<size_t>(n) * kRow;
  for (size_t i = 0; i < count; ++i) rows[i] = kernels::FloatToHalf(dtype_, kv[i]);
}

absl::Status CpuLayerMath::OutputInto(int n, absl::Span<const uint16_t> latent_out, size_t out_size,
                                      const char* out_name) {
  const size_t lat_width = static_cast<size_t>(heads_) * kLatentRank;
  if (n < 0 || static_cast<size_t>(n) > INT32_MAX / (lat_width + hidden_)) {
    return absl::InvalidArgumentError(absl::StrCat("n: expected a token count >= 0, got ", n));
  }
  if (latent_out.size() != n * lat_width) {
    return absl::InvalidArgumentError(absl::StrCat("latent_out: expected ", n, " x ", heads_, " heads x ", kLatentRank,
                                                   " = ", n * lat_width, " values, got ", latent_out.size()));
  }
  if (out_size != static_cast<size_t>(n) * hidden_) {
    return absl::InvalidArgumentError(absl::StrCat(out_name, ": expected ", n, " x hidden_size ", hidden_, " = ",
                                                   static_cast<size_t>(n) * hidden_, " values, got ", out_size));
  }
  if (n == 0) return absl::OkStatus();
  float* lat = Grow(s_->latent, latent_out.size());
  for (size_t i = 0; i < latent_out.size(); ++i) lat[i] = kernels::HalfToFloat(dtype_, latent_out[i]);
  const int o_width = heads_ * v_dim_;
  float* o = Grow(s_->o, static_cast<size_t>(n) * o_width);
  // o_h [n, v] = latent_out_h [n, 512] . W_UV_h^T ([v, 512]); the model's attn_output (softmax
  // times v, then the heads concatenated) is a model-dtype tensor, hence the rounding.
  for (int j = 0; j < heads_; ++j) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, v_dim_, kLatentRank, 1.0f,
                lat + static_cast<size_t>(j) * kLatentRank, heads_ * kLatentRank,
                w_->w_uv.data() + static_cast<size_t>(j) * v_dim_ * kLatentRank, kLatentRank, 0.0f, o + j * v_dim_,
                o_width);
  }
  Round(o, static_cast<size_t>(n) * o_width);
  float* out = Grow(s_->out, static_cast<size_t>(n) * hidden_);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, w_->o_proj.rows, w_->o_proj.cols, 1.0f, o, w_->o_proj.cols,
              w_->o_proj.values.data(), w_->o_proj.cols, 0.0f, out, w_->o_proj.rows);
  return absl::OkStatus();
}

absl::Status CpuLayerMath::Output(int n, absl::Span<const uint16_t> latent_out, absl::Span<uint16_t> out) {
  if (absl::Status s = OutputInto(n, latent_out, out.size(), "out"); !s.ok()) return s;
  // o_proj is a Linear: its output is rounded to the model dtype.
  for (size_t i = 0; i < out.size(); ++i) out[i] = kernels::FloatToHalf(dtype_, s_->out[i]);
  return absl::OkStatus();
}

absl::Status CpuLayerMath::OutputFloat(int n, absl::Span<const uint16_t> latent_out, absl::Span<float> out) {
  if (absl::Status s = OutputInto(n, latent_out, out.size(), "out"); !s.ok()) return s;
  std::copy(s_->out.begin(), s_->out.begin() + out.size(), out.begin());
  return absl::OkStatus();
}

}  // namespace latentd::engine::layer
