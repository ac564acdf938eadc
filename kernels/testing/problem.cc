// Random problems, a double-precision reference and tolerance checks for kernel tests.
#include "kernels/testing/problem.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>

#include "kernels/cpu/half.h"
#include "kernels/kv_fp8.h"

namespace latentd::kernels::testing {

MlaDecodeParams Problem::Params() {
  MlaDecodeParams p;
  p.dtype = shape.dtype;
  p.kv_dtype = shape.kv_dtype;
  p.batch = shape.batch;
  p.s_q = shape.s_q;
  p.h_q = shape.h_q;
  p.h_kv = shape.h_kv;
  p.num_pages = num_pages;
  p.max_pages_per_seq = max_pages_per_seq;
  p.softmax_scale = softmax_scale;
  p.causal = shape.causal;
  SetContiguousStrides(&p);
  p.q = q.data();
  p.kv = shape.kv_dtype == KvDType::kFp8E4M3 ? static_cast<const void*>(kv8.data()) : kv.data();
  p.block_table = block_table.data();
  p.seqlens = seqlens.data();
  p.out = out.data();
  p.lse = lse.data();
  return p;
}

void Problem::Poison() {
  const uint16_t nan = FloatToHalf(shape.dtype, std::numeric_limits<float>::quiet_NaN());
  std::fill(out.begin(), out.end(), nan);
  std::fill(lse.begin(), lse.end(), std::numeric_limits<float>::quiet_NaN());
}

Problem MakeProblem(const ProblemShape& shape, std::mt19937_64& rng) {
  Problem pr;
  pr.shape = shape;
  const int b = shape.batch;
  pr.seqlens.assign(shape.seqlens.begin(), shape.seqlens.end());
  pr.seqlens.resize(b, 0);
  int max_len = 0, pages_needed = 0;
  for (int len : pr.seqlens) {
    max_len = std::max(max_len, len);
    pages_needed += (len + kPageSize - 1) / kPageSize;
  }
  pr.max_pages_per_seq = std::max(1, (max_len + kPageSize - 1) / kPageSize);
  pr.num_pages = pages_needed + shape.extra_pages;
  pr.softmax_scale = 1.0f / std::sqrt(float(kHeadDimQK));

  std::normal_distribution<float> normal(0.f, 1.f);
  const DType dt = shape.dtype;
  pr.q.resize(size_t(b) * shape.s_q * shape.h_q * kHeadDimQK);
  for (auto& x : pr.q) x = FloatToHalf(dt, normal(rng));

  // Every row starts as NaN; only rows a sequence owns get data.
  const uint16_t nan = FloatToHalf(dt, std::numeric_limits<float>::quiet_NaN());
  const size_t page_elems = size_t(kPageSize) * shape.h_kv * kHeadDimQK;
  pr.kv.assign(size_t(pr.num_pages) * page_elems, nan);

  std::vector<int32_t> perm(pr.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  // Unused table slots point at a random unowned-or-any page: the kernel must not read them.
  std::uniform_int_distribution<int> any_page(0, pr.num_pages - 1);
  pr.block_table.assign(size_t(b) * pr.max_pages_per_seq, 0);
  int next = 0;
  for (int i = 0; i < b; ++i) {
    const int len = pr.seqlens[i];
    const int pages = (len + kPageSize - 1) / kPageSize;
    for (int j = 0; j < pr.max_pages_per_seq; ++j)
      pr.block_table[size_t(i) * pr.max_pages_per_seq + j] = j < pages ? perm[next++] : any_page(rng);
    for (int t = 0; t < len; ++t) {
      const int page = pr.block_table[size_t(i) * pr.max_pages_per_seq + t / kPageSize];
      uint16_t* row = pr.kv.data() + size_t(page) * page_elems + size_t(t % kPageSize) * shape.h_kv * kHeadDimQK;
      const float rope_gain = shape.rising_keys ? 1.f + t / 4.f : 1.f;
      for (int e = 0; e < shape.h_kv * kHeadDimQK; ++e)
        row[e] = FloatToHalf(dt, (e % kHeadDimQK >= kHeadDimV ? rope_gain : 1.f) *
                                     (shape.heavy_tailed ? normal(rng) * std::exp(normal(rng)) : normal(rng)));
    }
  }
  if (shape.kv_dtype == KvDType::kFp8E4M3) {
    const size_t rows = size_t(pr.num_pages) * kPageSize;
    pr.kv8.assign(rows * shape.h_kv * kFp8RowBytes, 0xff);
    for (int i = 0; i < b; ++i)
      for (int t = 0; t < pr.seqlens[i]; ++t) {
        const size_t row = size_t(pr.block_table[size_t(i) * pr.max_pages_per_seq + t / kPageSize]) * kPageSize +
                           t % kPageSize;
        for (int h = 0; h < shape.h_kv; ++h)
          QuantizeKvRowFp8(dt, pr.kv.data() + (row * shape.h_kv + h) * kHeadDimQK,
                           pr.kv8.data() + (row * shape.h_kv + h) * kFp8RowBytes);
      }
  }
  pr.out.resize(size_t(b) * shape.s_q * shape.h_q * kHeadDimV);
  pr.lse.resize(size_t(b) * shape.h_q * shape.s_q);
  pr.Poison();
  return pr;
}

void ReferenceDecode(const Problem& pr, std::vector<double>* out, std::vector<double>* lse, bool unquantized) {
  const auto& s = pr.shape;
  const bool fp8 = s.kv_dtype == KvDType::kFp8E4M3 && !unquantized;
  std::vector<uint16_t> deq(kHeadDimQK);
  const int group = s.h_q / s.h_kv;
  out->assign(size_t(s.batch) * s.s_q * s.h_q * kHeadDimV, 0.0);
  lse->assign(size_t(s.batch) * s.h_q * s.s_q, -std::numeric_limits<double>::infinity());
  std::vector<double> scores;
  for (int b = 0; b < s.batch; ++b) {
    const int len = pr.seqlens[b];
    for (int i = 0; i < s.s_q; ++i) {
      const int visible = std::clamp(s.causal ? len - s.s_q + i + 1 : len, 0, len);
      for (int h = 0; h < s.h_q; ++h) {
        const int kvh = h / group;
        const uint16_t* q = pr.q.data() + ((size_t(b) * s.s_q + i) * s.h_q + h) * kHeadDimQK;
        auto krow = [&](int t) -> const uint16_t* {
          const int page = pr.block_table[size_t(b) * pr.max_pages_per_seq + t / kPageSize];
          const size_t row = (size_t(page) * kPageSize + t % kPageSize) * s.h_kv + kvh;
          if (!fp8) return pr.kv.data() + row * kHeadDimQK;
          DequantizeKvRowFp8(s.dtype, pr.kv8.data() + row * kFp8RowBytes, deq.data());
          return deq.data();
        };
        scores.assign(visible, 0.0);
        double mx = -std::numeric_limits<double>::infinity();
        for (int t = 0; t < visible; ++t) {
          const uint16_t* k = krow(t);
          double dot = 0;
          for (int d = 0; d < kHeadDimQK; ++d) dot += double(HalfToFloat(s.dtype, q[d])) * HalfToFloat(s.dtype, k[d]);
          scores[t] = dot * pr.softmax_scale;
          mx = std::max(mx, scores[t]);
        }
        if (visible == 0) continue;
        double sum = 0;
        for (int t = 0; t < visible; ++t) sum += std::exp(scores[t] - mx);
        double* o = out->data() + ((size_t(b) * s.s_q + i) * s.h_q + h) * kHeadDimV;
        for (int t = 0; t < visible; ++t) {
          const double w = std::exp(scores[t] - mx) / sum;
          const uint16_t* v = krow(t);
          for (int d = 0; d < kHeadDimV; ++d) o[d] += w * HalfToFloat(s.dtype, v[d]);
        }
        (*lse)[(size_t(b) * s.h_q + h) * s.s_q + i] = std::log(sum) + mx;
      }
    }
  }
}

Tolerance POnceTolerance() {
  // P with 8 significant bits: each weight off by up to 2^-9 of itself, so an output
  // dominated by a few keys moves by up to ~2^-9 sum_j p_j |v_j| (the sweeps run with P rounded once at
  // eed84a8: first failures against the default bound off by 1.0e-3 in the median, 4.9e-3
  // at most, on unit-scale random data). 1e-2 absolute keeps twice that margin.
  Tolerance t;
  t.abs_out = 1e-2;
  t.cos_dist = 1e-4;
  return t;
}

Comparison Compare(const Problem& pr, const std::vector<uint16_t>& out, const std::vector<float>& lse,
                   const std::vector<double>& ref_out, const std::vector<double>& ref_lse, const Tolerance& tol) {
  Comparison c;
  const DType dt = pr.shape.dtype;
  // Output rounding: bf16 carries 8 significant bits, fp16 11.
  const double rel_tol = tol.rel_out;
  const double abs_tol = tol.abs_out;
  double dot = 0, nx = 0, ny = 0;
  for (size_t e = 0; e < ref_out.size(); ++e) {
    const double x = HalfToFloat(dt, out[e]);
    const double y = ref_out[e];
    if (std::isnan(x)) {
      if (c.ok) c.first_failure = "out[" + std::to_string(e) + "] is NaN (unwritten or read an unowned row)";
      c.ok = false;
      continue;
    }
    const double err = std::abs(x - y);
    c.max_abs_out = std::max(c.max_abs_out, err);
    if (std::abs(y) > 1e-6) c.max_rel_out = std::max(c.max_rel_out, err / std::abs(y));
    if (err > abs_tol + rel_tol * std::abs(y)) {
      if (c.ok) {
        std::ostringstream m;
        m << "out[" << e << "] = " << x << ", expected " << y;
        c.first_failure = m.str();
      }
      c.ok = false;
    }
    dot += x * y;
    nx += x * x;
    ny += y * y;
  }
  if (ny > 0 && nx > 0) c.cos_dist = 1.0 - dot / std::sqrt(nx * ny);
  if (nx != ny && (nx == 0 || ny == 0)) c.cos_dist = 1.0;
  if (c.cos_dist > tol.cos_dist) {
    if (c.ok) c.first_failure = "cosine distance " + std::to_string(c.cos_dist) + " > " + std::to_string(tol.cos_dist);
    c.ok = false;
  }
  for (size_t e = 0; e < ref_lse.size(); ++e) {
    const double x = lse[e], y = ref_lse[e];
    if (std::isinf(y)) {
      if (!(std::isinf(x) && x < 0)) {
        if (c.ok) c.first_failure = "lse[" + std::to_string(e) + "] = " + std::to_string(x) + ", expected -inf";
        c.ok = false;
      }
      continue;
    }
    const double err = std::abs(x - y);
    if (std::isnan(x) || (err > 1e-6 && err > 8.0 / 65536 * std::abs(y))) {
      if (c.ok) c.first_failure = "lse[" + std::to_string(e) + "] = " + std::to_string(x) + ", expected " + std::to_string(y);
      c.ok = false;
    }
    if (!std::isnan(x)) c.max_abs_lse = std::max(c.max_abs_lse, err);
  }
  return c;
}

std::string Describe(const ProblemShape& s) {
  std::ostringstream m;
  m << DTypeName(s.dtype) << (s.kv_dtype == KvDType::kFp8E4M3 ? " kv fp8_e4m3" : "")
    << (s.heavy_tailed ? " heavy-tailed" : "") << (s.rising_keys ? " rising" : "") << " b=" << s.batch << " s_q=" << s.s_q << " h_q=" << s.h_q << " h_kv=" << s.h_kv
    << " causal=" << s.causal << " seqlens=[";
  for (size_t i = 0; i < s.seqlens.size() && i < 8; ++i) m << (i ? "," : "") << s.seqlens[i];
  if (s.seqlens.size() > 8) m << ",...";
  m << "]";
  return m.str();
}

}  // namespace latentd::kernels::testing
