// End-to-end test of the absorbed MLA layer: LatentRows into a paged KV cache, Queries, the CPU
// decode kernel and Output, against a plain double-precision reference of Hugging Face's
// DeepseekV3Attention (full 192-wide keys from kv_b_proj, no absorption); and the errors.
#include "engine/layer/layer_math.h"

#include <algorithm>
#include <cmath>
#include <complex>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/layer/testing/random_layer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/half.h"
#include "kernels/cpu/mla_decode_cpu.h"
#include "kernels/params.h"

namespace latentd::engine::layer {
namespace {

using kernels::DType;

using testing::kHeads;
using testing::kHidden;
using testing::kNope;
using testing::kRank;
using testing::kRope;
using testing::kV;
using testing::RandomWeights;
using testing::SmallConfig;

constexpr int kMaxPositions = 8192;

// ---- The reference: HF's DeepseekV3Attention in double, written out plainly. ----

std::vector<double> Values(const model::HostTensor& t, DType dt) {
  std::vector<double> out(t.values.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = kernels::HalfToFloat(dt, t.values[i]);
  return out;
}

// y = W x for W [rows, cols] row-major.
std::vector<double> MatVec(const std::vector<double>& w, int rows, int cols, const std::vector<double>& x) {
  std::vector<double> y(rows, 0.0);
  for (int r = 0; r < rows; ++r) {
    double s = 0;
    for (int k = 0; k < cols; ++k) s += w[static_cast<size_t>(r) * cols + k] * x[k];
    y[r] = s;
  }
  return y;
}

std::vector<double> RmsNormRef(const std::vector<double>& x, const std::vector<double>& w, double eps) {
  double ms = 0;
  for (double v : x) ms += v * v;
  ms /= x.size();
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = w[i] * x[i] / std::sqrt(ms + eps);
  return y;
}

// YaRN from its definition (see rope_test.cc): pair i keeps theta^(-2i/d) below the beta_fast
// dimension, is divided by the factor above the beta_slow one, linearly in between.
double InvFreq(int i, const model::ModelConfig& c) {
  const int d = c.qk_rope_head_dim;
  const double unscaled = std::exp(-std::log(c.rope_theta) * (2.0 * i) / d);
  const model::YarnScaling& y = *c.yarn;
  const double L = static_cast<double>(y.original_max_position_embeddings);
  auto pair_index = [&](double turns) { return (d / 2.0) * std::log(L / (2 * M_PI * turns)) / std::log(c.rope_theta); };
  const double low = std::max(std::floor(pair_index(y.beta_fast)), 0.0);
  const double high = std::min(std::ceil(pair_index(y.beta_slow)), d - 1.0);
  const double t = std::clamp((i - low) / (high - low), 0.0, 1.0);
  return unscaled * (1.0 - t * (1.0 - 1.0 / y.factor));
}

// RoPE as a complex rotation of each pair, scaled by the attention factor (DeepSeek's own
// inference code writes it this way); the pairs are (x[2i], x[2i+1]) when interleaved and
// (x[i], x[i + d/2]) otherwise. The layout of the result does not matter for q_pe . k_pe.
std::vector<double> RopeRef(const std::vector<double>& x, int64_t position, const model::ModelConfig& c) {
  const model::YarnScaling& y = *c.yarn;
  auto mscale = [&](double m) { return y.factor <= 1 ? 1.0 : 0.1 * m * std::log(y.factor) + 1; };
  const double factor = mscale(y.mscale) / mscale(y.mscale_all_dim);
  const int half = c.qk_rope_head_dim / 2;
  std::vector<double> out(x.size());
  for (int i = 0; i < half; ++i) {
    const int a = c.rope_interleave ? 2 * i : i, b = c.rope_interleave ? 2 * i + 1 : i + half;
    const std::complex<double> z(x[a], x[b]);
    const std::complex<double> r = z * std::polar(factor, position * InvFreq(i, c));
    out[a] = r.real();
    out[b] = r.imag();
  }
  return out;
}

struct Reference {
  std::vector<std::vector<double>> out;  // [new token][hidden]
  double max_probability = 0;            // over every head and new token
};

// Tokens 0 .. N-1 with their hidden states; the last s_q are the new ones, causal.
Reference ReferenceAttention(const model::ModelConfig& c, const model::AttentionLayerWeights& w,
                             const std::vector<std::vector<double>>& x, const std::vector<int64_t>& positions,
                             int s_q) {
  const DType dt = c.dtype;
  const int N = static_cast<int>(x.size());
  const int qk = kNope + kRope;
  const std::vector<double> kv_a = Values(w.kv_a_proj_with_mqa, dt), kv_norm = Values(w.kv_a_layernorm, dt),
                            kv_b = Values(w.kv_b_proj, dt), o_proj = Values(w.o_proj, dt);
  // Keys and values of every token: k = [k_nope | k_pe] (192 per head), v (128 per head).
  std::vector<std::vector<double>> keys(N), values(N), k_pe(N);
  for (int t = 0; t < N; ++t) {
    const std::vector<double> ckv = MatVec(kv_a, kRank + kRope, kHidden, x[t]);
    const std::vector<double> latent =
        RmsNormRef(std::vector<double>(ckv.begin(), ckv.begin() + kRank), kv_norm, c.rms_norm_eps);
    k_pe[t] = RopeRef(std::vector<double>(ckv.begin() + kRank, ckv.end()), positions[t], c);
    const std::vector<double> kv = MatVec(kv_b, kHeads * (kNope + kV), kRank, latent);
    keys[t].resize(kHeads * qk);
    values[t].resize(kHeads * kV);
    for (int j = 0; j < kHeads; ++j) {
      for (int d = 0; d < kNope; ++d) keys[t][j * qk + d] = kv[j * (kNope + kV) + d];
      for (int d = 0; d < kRope; ++d) keys[t][j * qk + kNope + d] = k_pe[t][d];  // shared by all heads
      for (int d = 0; d < kV; ++d) values[t][j * kV + d] = kv[j * (kNope + kV) + kNope + d];
    }
  }
  const double scale = model::SoftmaxScale(c);
  Reference ref;
  for (int i = 0; i < s_q; ++i) {
    const int t = N - s_q + i;
    std::vector<double> q;
    if (c.q_lora_rank) {
      const int rq = *c.q_lora_rank;
      const std::vector<double> cq =
          RmsNormRef(MatVec(Values(w.q_a_proj, dt), rq, kHidden, x[t]), Values(w.q_a_layernorm, dt), c.rms_norm_eps);
      q = MatVec(Values(w.q_b_proj, dt), kHeads * qk, rq, cq);
    } else {
      q = MatVec(Values(w.q_proj, dt), kHeads * qk, kHidden, x[t]);
    }
    std::vector<double> o(kHeads * kV, 0.0);
    for (int j = 0; j < kHeads; ++j) {
      std::vector<double> pe(q.begin() + j * qk + kNope, q.begin() + (j + 1) * qk);
      pe = RopeRef(pe, positions[t], c);
      std::copy(pe.begin(), pe.end(), q.begin() + j * qk + kNope);
      const int visible = t + 1;  // causal: keys 0 .. t
      std::vector<double> s(visible);
      for (int k = 0; k < visible; ++k) {
        double dot = 0;
        for (int d = 0; d < qk; ++d) dot += q[j * qk + d] * keys[k][j * qk + d];
        s[k] = scale * dot;
      }
      const double m = *std::max_element(s.begin(), s.end());
      double sum = 0;
      for (double& v : s) sum += (v = std::exp(v - m));
      for (int k = 0; k < visible; ++k) {
        const double p = s[k] / sum;
        ref.max_probability = std::max(ref.max_probability, p);
        for (int d = 0; d < kV; ++d) o[j * kV + d] += p * values[k][j * kV + d];
      }
    }
    ref.out.push_back(MatVec(o_proj, kHidden, kHeads * kV, o));
  }
  return ref;
}

// ---- The absorbed path. ----

struct Absorbed {
  std::vector<uint16_t> out;  // [s_q, hidden]
};

// query_position_shift moves the new tokens' query positions (not their keys), to show that
// the comparison notices a wrong rotation.
absl::StatusOr<Absorbed> AbsorbedAttention(const model::ModelConfig& c, CpuLayerMath& math,
                                           const std::vector<uint16_t>& x_bits, const std::vector<int64_t>& positions,
                                           int s_q, std::mt19937_64& rng, int64_t query_position_shift = 0) {
  const DType dt = c.dtype;
  const int N = static_cast<int>(positions.size());
  constexpr int kRow = kernels::kHeadDimQK;
  std::vector<uint16_t> rows(static_cast<size_t>(N) * kRow);
  if (absl::Status s = math.LatentRows(x_bits, positions, absl::MakeSpan(rows)); !s.ok()) return s;

  // Pages of 64 rows in a shuffled order, with spare pages; every row no token owns is NaN.
  const int pages = (N + kernels::kPageSize - 1) / kernels::kPageSize;
  const int num_pages = pages + 3;
  std::vector<int32_t> order(num_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int32_t> block_table(order.begin(), order.begin() + pages);
  const uint16_t nan = dt == DType::kBF16 ? 0x7fc0 : 0x7e00;
  std::vector<uint16_t> cache(static_cast<size_t>(num_pages) * kernels::kPageSize * kRow, nan);
  for (int t = 0; t < N; ++t) {
    const size_t row =
        static_cast<size_t>(block_table[t / kernels::kPageSize]) * kernels::kPageSize + t % kernels::kPageSize;
    std::copy(rows.begin() + static_cast<size_t>(t) * kRow, rows.begin() + static_cast<size_t>(t + 1) * kRow,
              cache.begin() + row * kRow);
  }

  std::vector<uint16_t> x_new(x_bits.end() - static_cast<ptrdiff_t>(s_q) * kHidden, x_bits.end());
  std::vector<int64_t> q_positions(positions.end() - s_q, positions.end());
  for (int64_t& p : q_positions) p += query_position_shift;
  std::vector<uint16_t> q(static_cast<size_t>(s_q) * kHeads * kRow);
  if (absl::Status s = math.Queries(x_new, q_positions, absl::MakeSpan(q)); !s.ok()) return s;

  std::vector<uint16_t> latent_out(static_cast<size_t>(s_q) * kHeads * kernels::kHeadDimV);
  std::vector<float> lse(static_cast<size_t>(kHeads) * s_q);
  const int32_t seqlen = N;
  kernels::MlaDecodeParams p;
  p.dtype = dt;
  p.batch = 1;
  p.s_q = s_q;
  p.h_q = kHeads;
  p.h_kv = 1;
  p.num_pages = num_pages;
  p.max_pages_per_seq = pages;
  p.softmax_scale = static_cast<float>(model::SoftmaxScale(c));
  p.causal = s_q > 1;
  p.q = q.data();
  p.kv = cache.data();
  p.block_table = block_table.data();
  p.seqlens = &seqlen;
  p.out = latent_out.data();
  p.lse = lse.data();
  kernels::SetContiguousStrides(&p);
  kernels::CpuMlaDecoder decoder(2);
  const kernels::Status ks = decoder.Run(p);
  if (!ks.ok()) return absl::InternalError(ks.message);

  Absorbed a;
  a.out.resize(static_cast<size_t>(s_q) * kHidden);
  if (absl::Status s = math.Output(s_q, latent_out, absl::MakeSpan(a.out)); !s.ok()) return s;
  return a;
}

struct Errors {
  double max_rel = 0;  // max |ours - ref| / rms(ref)
  double rms_rel = 0;  // rms(ours - ref) / rms(ref)
};

Errors Compare(const Reference& ref, const std::vector<uint16_t>& out, DType dt) {
  double ref_sq = 0, err_sq = 0, err_max = 0;
  size_t count = 0;
  for (size_t i = 0; i < ref.out.size(); ++i) {
    for (int d = 0; d < kHidden; ++d) {
      const double r = ref.out[i][d];
      const double e = kernels::HalfToFloat(dt, out[i * kHidden + d]) - r;
      ref_sq += r * r;
      err_sq += e * e;
      err_max = std::max(err_max, std::fabs(e));
      ++count;
    }
  }
  const double rms = std::sqrt(ref_sq / count);
  return {err_max / rms, std::sqrt(err_sq / count) / rms};
}

struct Problem {
  model::ModelConfig config;
  model::AttentionLayerWeights weights;
  std::vector<uint16_t> x_bits;        // [N, hidden]
  std::vector<std::vector<double>> x;  // the same values
  std::vector<int64_t> positions;      // [N]
};

// T prior tokens (more than two pages) and s_q new ones at consecutive positions past YaRN's
// original 4096.
Problem MakeProblem(DType dt, std::optional<int> q_lora_rank, int s_q, std::mt19937_64& rng, bool interleave = true) {
  constexpr int kPrior = 150;
  Problem pr;
  pr.config = SmallConfig(dt, q_lora_rank, interleave);
  pr.weights = RandomWeights(pr.config, rng);
  const int N = kPrior + s_q;
  std::normal_distribution<double> normal(0, 1);
  pr.x_bits.resize(static_cast<size_t>(N) * kHidden);
  pr.x.assign(N, std::vector<double>(kHidden));
  for (int t = 0; t < N; ++t) {
    pr.positions.push_back(5000 + t);
    for (int d = 0; d < kHidden; ++d) {
      const uint16_t b = kernels::FloatToHalf(dt, static_cast<float>(normal(rng)));
      pr.x_bits[static_cast<size_t>(t) * kHidden + d] = b;
      pr.x[t][d] = kernels::HalfToFloat(dt, b);
    }
  }
  return pr;
}

std::unique_ptr<CpuLayerMath> MakeMath(const Problem& pr) {
  absl::StatusOr<std::unique_ptr<CpuLayerMath>> m =
      CpuLayerMath::Create(pr.config, pr.weights, {.num_heads = kHeads, .max_positions = kMaxPositions});
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : nullptr;
}

// Tolerances relative to the output's RMS. The absorbed path rounds to the model dtype about a
// dozen times along the way (after each projection, twice in each RMSNorm, after RoPE, the
// absorbed query, the kernel's output, W_UV's output); the reference rounds nowhere. Rounding
// errors in q and k reach the output through the softmax amplified by the spread of the scores
// (a few units here), so the limits come from measurement: over these nine cases the largest
// errors were max 0.039 / rms 0.0096 (bf16) and max 0.0046 / rms 0.00125 (fp16), a ratio close
// to the 8x between the two formats' unit roundoffs (2^-9 and 2^-12), as rounding noise and not
// a formula mistake would give. The limits leave ~1.5x room; a query rotated one position off
// lands far outside them (WrongQueryPositionFailsTheComparison).
double MaxTolerance(DType dt) { return dt == DType::kBF16 ? 6e-2 : 8e-3; }
double RmsTolerance(DType dt) { return dt == DType::kBF16 ? 1.5e-2 : 2e-3; }

class AbsorbedVsReferenceTest : public ::testing::TestWithParam<std::tuple<DType, bool, int, bool>> {};

TEST_P(AbsorbedVsReferenceTest, MatchesWithinDtypeTolerance) {
  const auto [dt, q_lora, s_q, interleave] = GetParam();
  std::mt19937_64 rng(1234 + 10 * s_q + (q_lora ? 1 : 0) + (dt == DType::kFP16 ? 100 : 0) + (interleave ? 0 : 1000));
  const Problem pr = MakeProblem(dt, q_lora ? std::optional<int>(96) : std::nullopt, s_q, rng, interleave);
  std::unique_ptr<CpuLayerMath> math = MakeMath(pr);
  ASSERT_NE(math, nullptr);
  const Reference ref = ReferenceAttention(pr.config, pr.weights, pr.x, pr.positions, s_q);
  // The scores must matter: no head's softmax may be (nearly) one-hot or uniform.
  ASSERT_LT(ref.max_probability, 0.9);
  ASSERT_GT(ref.max_probability, 5.0 / pr.positions.size());
  absl::StatusOr<Absorbed> a = AbsorbedAttention(pr.config, *math, pr.x_bits, pr.positions, s_q, rng);
  ASSERT_TRUE(a.ok()) << a.status();
  const Errors e = Compare(ref, a->out, dt);
  std::printf("%s q_lora=%d s_q=%d interleave=%d: max |err| / rms = %.3g, rms err / rms = %.3g, max p = %.3f\n",
              kernels::DTypeName(dt), q_lora, s_q, interleave, e.max_rel, e.rms_rel, ref.max_probability);
  EXPECT_LT(e.max_rel, MaxTolerance(dt));
  EXPECT_LT(e.rms_rel, RmsTolerance(dt));
}

INSTANTIATE_TEST_SUITE_P(
    Configs, AbsorbedVsReferenceTest,
    ::testing::Values(std::make_tuple(DType::kBF16, true, 1, true), std::make_tuple(DType::kBF16, false, 1, true),
                      std::make_tuple(DType::kBF16, true, 2, true), std::make_tuple(DType::kBF16, false, 2, true),
                      std::make_tuple(DType::kFP16, true, 1, true), std::make_tuple(DType::kFP16, false, 1, true),
                      std::make_tuple(DType::kFP16, true, 2, true), std::make_tuple(DType::kFP16, false, 2, true),
                      std::make_tuple(DType::kBF16, true, 2, false)));

// The comparison is sharp enough to see a query rotated for the wrong position.
TEST(LayerMathTest, WrongQueryPositionFailsTheComparison) {
  std::mt19937_64 rng(77);
  const Problem pr = MakeProblem(DType::kFP16, 96, 1, rng);
  std::unique_ptr<CpuLayerMath> math = MakeMath(pr);
  ASSERT_NE(math, nullptr);
  const Reference ref = ReferenceAttention(pr.config, pr.weights, pr.x, pr.positions, 1);
  absl::StatusOr<Absorbed> a = AbsorbedAttention(pr.config, *math, pr.x_bits, pr.positions, 1, rng, 1);
  ASSERT_TRUE(a.ok()) << a.status();
  const Errors e = Compare(ref, a->out, DType::kFP16);
  std::printf("query one position off: max |err| / rms = %.3g, rms err / rms = %.3g\n", e.max_rel, e.rms_rel);
  // Outside even the bf16 limits, on an fp16 model.
  EXPECT_GT(e.max_rel, MaxTolerance(DType::kBF16));
  EXPECT_GT(e.rms_rel, RmsTolerance(DType::kBF16));
}

// Float hidden states holding model-dtype values give the same bits as the 16-bit overloads,
// and OutputFloat rounds to Output.
TEST(LayerMathTest, FloatOverloadsAgree) {
  std::mt19937_64 rng(5);
  const Problem pr = MakeProblem(DType::kBF16, 96, 1, rng);
  std::unique_ptr<CpuLayerMath> math = MakeMath(pr);
  ASSERT_NE(math, nullptr);
  const int n = 3;
  std::vector<uint16_t> bits(pr.x_bits.begin(), pr.x_bits.begin() + n * kHidden);
  std::vector<float> floats(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) floats[i] = kernels::Bf16ToFloat(bits[i]);
  const std::vector<int64_t> positions = {3, 4000, 8191};
  std::vector<uint16_t> q1(n * kHeads * 576), q2(q1.size()), r1(n * 576), r2(r1.size());
  ASSERT_TRUE(math->Queries(bits, positions, absl::MakeSpan(q1)).ok());
  ASSERT_TRUE(math->Queries(floats, positions, absl::MakeSpan(q2)).ok());
  EXPECT_EQ(q1, q2);
  ASSERT_TRUE(math->LatentRows(bits, positions, absl::MakeSpan(r1)).ok());
  ASSERT_TRUE(math->LatentRows(floats, positions, absl::MakeSpan(r2)).ok());
  EXPECT_EQ(r1, r2);

  std::vector<uint16_t> latent(n * kHeads * 512);
  for (size_t i = 0; i < latent.size(); ++i) latent[i] = q1[i % q1.size()];
  std::vector<uint16_t> out(n * kHidden);
  std::vector<float> out_f(n * kHidden);
  ASSERT_TRUE(math->Output(n, latent, absl::MakeSpan(out)).ok());
  ASSERT_TRUE(math->OutputFloat(n, latent, absl::MakeSpan(out_f)).ok());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], kernels::FloatToBf16(out_f[i])) << i;
  // A smaller batch after a larger one reuses the scratch.
  ASSERT_TRUE(
      math->Output(1, absl::MakeSpan(latent).subspan(0, kHeads * 512), absl::MakeSpan(out).subspan(0, kHidden)).ok());
}

void ExpectInvalid(const absl::Status& s, const std::string& field) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(field), absl::string_view::npos) << s;
}

TEST(LayerMathTest, UnsupportedConfigsAndWrongWeights) {
  std::mt19937_64 rng(9);
  const model::ModelConfig good = SmallConfig(DType::kBF16, 96);
  const model::AttentionLayerWeights w = RandomWeights(good, rng);
  const LayerMathOptions options{.num_heads = kHeads, .max_positions = 64};
  ASSERT_TRUE(CpuLayerMath::Create(good, w, options).ok());

  model::ModelConfig c = good;
  c.kv_lora_rank = 256;
  ExpectInvalid(CpuLayerMath::Create(c, w, options).status(), "kv_lora_rank");
  c = good;
  c.qk_rope_head_dim = 32;
  ExpectInvalid(CpuLayerMath::Create(c, w, options).status(), "qk_rope_head_dim");
  ExpectInvalid(CpuLayerMath::Create(good, w, {.num_heads = 0, .max_positions = 64}).status(), "num_heads");
  ExpectInvalid(CpuLayerMath::Create(good, w, {.num_heads = kHeads, .max_positions = 0}).status(), "max_positions");

  model::AttentionLayerWeights bad = w;
  bad.kv_b_proj.shape = {kHeads * (kNope + kV) - 1, kRank};
  ExpectInvalid(CpuLayerMath::Create(good, bad, options).status(), "kv_b_proj");
  bad = w;
  bad.o_proj.values.pop_back();
  ExpectInvalid(CpuLayerMath::Create(good, bad, options).status(), "o_proj");
  // Two heads' worth of weights for a rank that says it holds four.
  ExpectInvalid(CpuLayerMath::Create(good, w, {.num_heads = 2, .max_positions = 64}).status(), "q_b_proj");
  // q_lora_rank null: q_proj is required, and it is empty here.
  c = good;
  c.q_lora_rank.reset();
  ExpectInvalid(CpuLayerMath::Create(c, w, options).status(), "q_proj");

  std::unique_ptr<CpuLayerMath> math = *CpuLayerMath::Create(good, w, options);
  std::vector<uint16_t> x(kHidden), q(kHeads * 576), rows(576), out(kHidden);
  const std::vector<int64_t> pos = {0};
  ExpectInvalid(math->Queries(absl::MakeSpan(x).subspan(1), pos, absl::MakeSpan(q)), "x");
  ExpectInvalid(math->Queries(x, pos, absl::MakeSpan(q).subspan(1)), "q");
  ExpectInvalid(math->LatentRows(x, pos, absl::MakeSpan(rows).subspan(1)), "rows");
  EXPECT_EQ(math->LatentRows(x, std::vector<int64_t>{64}, absl::MakeSpan(rows)).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(math->Queries(x, std::vector<int64_t>{-1}, absl::MakeSpan(q)).code(), absl::StatusCode::kOutOfRange);
  std::vector<uint16_t> latent(kHeads * 512);
  ExpectInvalid(math->Output(2, latent, absl::MakeSpan(out)), "latent_out");
  ExpectInvalid(math->Output(1, latent, absl::MakeSpan(out).subspan(1)), "out");
  // Zero tokens are fine.
  EXPECT_TRUE(math->Queries(absl::Span<const uint16_t>(), {}, absl::Span<uint16_t>()).ok());
  EXPECT_TRUE(math->Output(0, absl::Span<const uint16_t>(), absl::Span<uint16_t>()).ok());
}

}  // namespace
}  // namespace latentd::engine::layer
