// Recomputes decode steps on the client with the exact CPU implementation; see reference.h.
#include "clients/cpp/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cpu/half.h"
#include "kernels/kv_fp8.h"

namespace latentd::client {

std::string RandomHalves(std::mt19937_64& rng, size_t count, kernels::DType dtype) {
  std::string out(count * 2, '\0');
  uint16_t* p = reinterpret_cast<uint16_t*>(&out[0]);
  for (size_t i = 0; i < count; i += 4) {
    uint64_t r = rng();
    for (size_t j = 0; j < 4 && i + j < count; ++j, r >>= 16) {
      const float f = static_cast<float>(r & 0xffff) / 32768.f - 1.f;
      p[i + j] = kernels::FloatToHalf(dtype, f);
    }
  }
  return out;
}

kernels::DType DTypeOf(const v1::ServerInfo& info) {
  return info.dtype() == v1::FP16 ? kernels::DType::kFP16 : kernels::DType::kBF16;
}

kernels::KvDType KvDTypeOf(const v1::ServerInfo& info) {
  return info.kv_dtype() == "fp8_e4m3" ? kernels::KvDType::kFp8E4M3 : kernels::KvDType::kModel;
}

Reference::Reference(const v1::ServerInfo& info, int cpu_threads)
    : dtype_(DTypeOf(info)),
      kv_dtype_(KvDTypeOf(info)),
      h_q_(info.num_heads_q()),
      h_kv_(info.num_heads_kv()),
      scale_(info.softmax_scale()),
      num_layers_(info.num_layers()),
      decoder_(std::make_unique<kernels::CpuMlaDecoder>(cpu_threads)) {}

std::shared_ptr<Reference::Rows> Reference::Find(const std::string& sequence_id) const {
  std::lock_guard<std::mutex> l(rows_mu_);
  auto it = rows_.find(sequence_id);
  return it == rows_.end() ? nullptr : it->second;
}

std::shared_ptr<Reference::Rows> Reference::FindOrAdd(const std::string& sequence_id) {
  std::lock_guard<std::mutex> l(rows_mu_);
  std::shared_ptr<Rows>& r = rows_[sequence_id];
  if (r == nullptr) {
    r = std::make_shared<Rows>();
    r->layers.resize(num_layers_);
  }
  return r;
}

void Reference::Append(const std::string& sequence_id, int layer, absl::string_view rows) {
  std::shared_ptr<Rows> seq = FindOrAdd(sequence_id);
  std::lock_guard<std::mutex> l(seq->mu);
  auto& v = seq->layers.at(layer);
  if (rows.empty()) return;  // memcpy from a null data() is undefined even for 0 bytes
  const size_t old = v.size();
  v.resize(old + rows.size() / 2);
  std::memcpy(v.data() + old, rows.data(), rows.size() / 2 * 2);
  if (kv_dtype_ == kernels::KvDType::kFp8E4M3) {
    // The server keeps QuantizeKvRowFp8's bytes; decoders read them dequantized.
    uint8_t stored[kernels::kFp8RowBytes];
    for (size_t r = old; r + kernels::kHeadDimQK <= v.size(); r += kernels::kHeadDimQK) {
      kernels::QuantizeKvRowFp8(dtype_, v.data() + r, stored);
      kernels::DequantizeKvRowFp8(dtype_, stored, v.data() + r);
    }
  }
}

void Reference::Fork(const std::string& from, const std::string& to) {
  auto copy = std::make_shared<Rows>();
  if (std::shared_ptr<Rows> src = Find(from)) {
    std::lock_guard<std::mutex> l(src->mu);
    copy->layers = src->layers;
  }
  copy->layers.resize(num_layers_);
  std::lock_guard<std::mutex> l(rows_mu_);
  rows_[to] = std::move(copy);
}

void Reference::Erase(const std::string& sequence_id) {
  std::lock_guard<std::mutex> l(rows_mu_);
  rows_.erase(sequence_id);
}

void Reference::Truncate(const std::string& sequence_id, int layer, int64_t length) {
  std::shared_ptr<Rows> seq = Find(sequence_id);
  if (seq == nullptr) return;
  std::lock_guard<std::mutex> l(seq->mu);
  if (layer < 0 || layer >= static_cast<int>(seq->layers.size())) return;
  auto& v = seq->layers[layer];
  v.resize(std::min(v.size(), static_cast<size_t>(length * h_kv_ * kernels::kHeadDimQK)));
}

int64_t Reference::Length(const std::string& sequence_id, int layer) const {
  std::shared_ptr<Rows> seq = Find(sequence_id);
  if (seq == nullptr) return 0;
  std::lock_guard<std::mutex> l(seq->mu);
  if (layer < 0 || layer >= static_cast<int>(seq->layers.size())) return 0;
  return static_cast<int64_t>(seq->layers[layer].size()) / (int64_t{h_kv_} * kernels::kHeadDimQK);
}

absl::Status Reference::CopyRows(const std::string& sequence_id, int layer, int64_t end, uint16_t* dst) const {
  const int64_t row = int64_t{h_kv_} * kernels::kHeadDimQK;
  std::shared_ptr<Rows> seq = Find(sequence_id);
  if (seq == nullptr) {
    return absl::NotFoundError(absl::StrCat("reference: no rows for ", sequence_id, " layer ", layer));
  }
  std::lock_guard<std::mutex> l(seq->mu);
  if (layer < 0 || layer >= static_cast<int>(seq->layers.size())) {
    return absl::NotFoundError(absl::StrCat("reference: no rows for ", sequence_id, " layer ", layer));
  }
  const auto& v = seq->layers[layer];
  if (static_cast<int64_t>(v.size()) < end * row) {
    return absl::OutOfRangeError(absl::StrCat("reference: ", sequence_id, " layer ", layer, " has ", v.size() / row,
                                              " rows, step needs ", end));
  }
  std::memcpy(dst, v.data(), static_cast<size_t>(end * row) * 2);
  return absl::OkStatus();
}

absl::Status Reference::Expected(const std::string& sequence_id, int layer, int64_t end, absl::string_view q,
                                 int s_q, bool causal, std::string* out, std::string* lse) {
  const int64_t row = int64_t{h_kv_} * kernels::kHeadDimQK;
  const int64_t pages = std::max<int64_t>(1, (end + kernels::kPageSize - 1) / kernels::kPageSize);
  std::vector<uint16_t> kv(static_cast<size_t>(pages * kernels::kPageSize * row), 0);
  if (absl::Status st = CopyRows(sequence_id, layer, end, kv.data()); !st.ok()) return st;
  std::vector<int32_t> table(static_cast<size_t>(pages));
  for (int64_t i = 0; i < pages; ++i) table[i] = static_cast<int32_t>(i);
  const int32_t seqlen = static_cast<int32_t>(end);
  out->assign(static_cast<size_t>(s_q) * h_q_ * kernels::kHeadDimV * 2, '\0');
  lse->assign(static_cast<size_t>(s_q) * h_q_ * 4, '\0');
  kernels::MlaDecodeParams p;
  p.dtype = dtype_;
  p.batch = 1;
  p.s_q = s_q;
  p.h_q = h_q_;
  p.h_kv = h_kv_;
  p.num_pages = static_cast<int>(pages);
  p.max_pages_per_seq = static_cast<int>(pages);
  p.softmax_scale = scale_;
  p.causal = causal;
  p.q = q.data();
  p.kv = kv.data();
  p.block_table = table.data();
  p.seqlens = &seqlen;
  p.out = &(*out)[0];
  p.lse = reinterpret_cast<float*>(&(*lse)[0]);
  kernels::SetContiguousStrides(&p);
  std::lock_guard<std::mutex> l(decoder_mu_);
  kernels::Status st = decoder_->Run(p);
  if (!st.ok()) return absl::InternalError("reference decoder: " + st.message);
  return absl::OkStatus();
}

absl::Status Reference::Compare(absl::string_view got_out, absl::string_view got_lse, absl::string_view want_out,
                                absl::string_view want_lse) const {
  if (got_out.size() != want_out.size()) {
    return absl::DataLossError(absl::StrCat("out: ", got_out.size(), " bytes, expected ", want_out.size()));
  }
  if (got_lse.size() != want_lse.size()) {
    return absl::DataLossError(absl::StrCat("lse: ", got_lse.size(), " bytes, expected ", want_lse.size()));
  }
  // FlashMLA's acceptance: abs 8e-4 or rel 2/128 per element (bf16; fp16 keeps 3 more
  // mantissa bits), cosine distance under 5e-6; lse abs 1e-5 or rel 8/65536.
  const double rel = dtype_ == kernels::DType::kBF16 ? 2.0 / 128 : 2.0 / 1024;
  const size_t n = got_out.size() / 2;
  const uint16_t* g = reinterpret_cast<const uint16_t*>(got_out.data());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(want_out.data());
  double dot = 0, gg = 0, ww = 0;
  for (size_t i = 0; i < n; ++i) {
    const double a = kernels::HalfToFloat(dtype_, g[i]);
    const double b = kernels::HalfToFloat(dtype_, w[i]);
    if (!std::isfinite(a) || std::abs(a - b) > std::max(8e-4, rel * std::abs(b))) {
      return absl::DataLossError(absl::StrFormat("out[%d] (token %d, head %d, dim %d): got %.6g, expected %.6g",
                                                 i, i / (h_q_ * 512), (i / 512) % h_q_, i % 512, a, b));
    }
    dot += a * b;
    gg += a * a;
    ww += b * b;
  }
  if (gg > 0 && ww > 0) {
    const double cos_dist = 1.0 - dot / std::sqrt(gg * ww);
    if (cos_dist > 5e-6) return absl::DataLossError(absl::StrFormat("out: cosine distance %.3g > 5e-6", cos_dist));
  }
  const size_t m = got_lse.size() / 4;
  for (size_t i = 0; i < m; ++i) {
    float a, b;
    std::memcpy(&a, got_lse.data() + 4 * i, 4);
    std::memcpy(&b, want_lse.data() + 4 * i, 4);
    if (std::isinf(b) && a == b) continue;
    if (!std::isfinite(a) || std::abs(double(a) - b) > std::max(1e-5, 8.0 / 65536 * std::abs(b))) {
      return absl::DataLossError(absl::StrFormat("lse[%d]: got %.8g, expected %.8g", i, a, b));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Reference::Diagnosis> Reference::Diagnose(const std::string& sequence_id, int layer, int64_t end,
                                                         absl::string_view q, int s_q, bool causal,
                                                         absl::string_view got_out) {
  const int64_t row = int64_t{h_kv_} * kernels::kHeadDimQK;
  Diagnosis r;
  r.values = int64_t{s_q} * h_q_ * kernels::kHeadDimV;
  if (end < 1 || s_q < 1 || q.size() != size_t(s_q) * h_q_ * kernels::kHeadDimQK * 2 ||
      got_out.size() != size_t(r.values) * 2) {
    return absl::InvalidArgumentError("diagnose: the result's or the query's size does not fit the step");
  }
  std::vector<float> keys(static_cast<size_t>(end * row));
  {
    std::vector<uint16_t> rows(keys.size());
    if (absl::Status st = CopyRows(sequence_id, layer, end, rows.data()); !st.ok()) return st;
    for (size_t i = 0; i < keys.size(); ++i) keys[i] = kernels::HalfToFloat(dtype_, rows[i]);
  }
  const uint16_t* g = reinterpret_cast<const uint16_t*>(got_out.data());
  const uint16_t* qh = reinterpret_cast<const uint16_t*>(q.data());
  const double rel = dtype_ == kernels::DType::kBF16 ? 2.0 / 128 : 2.0 / 1024;
  constexpr int kV = kernels::kHeadDimV, kP = kernels::kPageSize;
  constexpr int64_t kSplitKeys = 32;  // the planner's partition granularity (kSplitGranularity)
  const int64_t pages = (end + kP - 1) / kP;
  // Largest |got - predicted| under each hypothesis: row k zeroed, row k left out, page p zeroed.
  std::vector<double> zeroed(static_cast<size_t>(end), 0), missing(static_cast<size_t>(end), 0),
      doubled(static_cast<size_t>(end), 0), page_zeroed(static_cast<size_t>(pages), 0);
  std::vector<double> w(static_cast<size_t>(end)), o(kV), got(kV), page_o(static_cast<size_t>(pages) * kV),
      page_w(static_cast<size_t>(pages)), qf(kernels::kHeadDimQK);
  std::vector<int> page_n(static_cast<size_t>(pages));
  // Split-K candidates: [begin, end) of every partition of every size (multiples of 32
  // keys below end), and prefix sums over keys of w_k and w_k v_k for their range sums.
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t len = kSplitKeys; len < end; len += kSplitKeys)
    for (int64_t a = 0; a < end; a += len) ranges.emplace_back(a, std::min(end, a + len));
  std::vector<double> range_lost(ranges.size(), 0), range_values(ranges.size(), 0);
  std::vector<int> range_lost_rows(ranges.size(), 0), range_values_rows(ranges.size(), 0);
  std::vector<double> prefix_w(static_cast<size_t>(end) + 1), prefix_o((static_cast<size_t>(end) + 1) * kV);
  for (int t = 0; t < s_q; ++t) {
    // Keys this token sees: all of them, or with causal masking those up to its own.
    const int64_t lim = causal ? end - s_q + t + 1 : end;
    for (int h = 0; h < h_q_; ++h) {
      const float* kvh = keys.data() + int64_t(h / (h_q_ / h_kv_)) * kernels::kHeadDimQK;
      for (int d = 0; d < kernels::kHeadDimQK; ++d)
        qf[d] = kernels::HalfToFloat(dtype_, qh[(size_t(t) * h_q_ + h) * kernels::kHeadDimQK + d]);
      double m = -INFINITY;
      for (int64_t k = 0; k < lim; ++k) {
        double dot = 0;
        const float* kr = kvh + k * row;
        for (int d = 0; d < kernels::kHeadDimQK; ++d) dot += qf[d] * kr[d];
        w[k] = dot * scale_;
        m = std::max(m, w[k]);
      }
      double sum = 0;
      std::fill(o.begin(), o.end(), 0.0);
      std::fill(page_w.begin(), page_w.end(), 0.0);
      std::fill(page_o.begin(), page_o.end(), 0.0);
      std::fill(page_n.begin(), page_n.end(), 0);
      for (int64_t k = 0; k < lim; ++k) {
        w[k] = std::exp(w[k] - m);
        sum += w[k];
        const float* vr = kvh + k * row;
        double* po = page_o.data() + (k / kP) * kV;
        for (int d = 0; d < kV; ++d) {
          o[d] += w[k] * vr[d];
          po[d] += w[k] * vr[d];
        }
        page_w[k / kP] += w[k];
        ++page_n[k / kP];
      }
      const double z = std::exp(-m);  // the weight of a zero key (score 0)
      bool head_off = false;
      Diagnosis::OffDims dims;
      double as_is = 0;  // this row's largest error as the result is
      for (int d = 0; d < kV; ++d) {
        got[d] = kernels::HalfToFloat(dtype_, g[(size_t(t) * h_q_ + h) * kV + d]);
        if (!std::isfinite(got[d])) {
          ++r.not_finite;
          head_off = true;
          continue;
        }
        const double want = o[d] / sum, err = std::abs(got[d] - want);
        as_is = std::max(as_is, err);
        if (err > std::max(8e-4, rel * std::abs(want))) {
          ++r.off;
          if (dims.values++ == 0) dims.first = d;
          dims.last = d;
          head_off = true;
        }
        if (err > r.max_error) {
          r.max_error = err;
          r.worst_token = t, r.worst_head = h, r.worst_dim = d;
        }
      }
      if (head_off) {
        r.off_heads.emplace_back(t, h);
        r.off_dims.push_back(dims);
      }
      for (int64_t k = 0; k < end; ++k) {
        const float* vr = kvh + k * row;
        const bool seen = k < lim;
        const double wk = seen ? w[k] : 0, inv_z = 1 / (sum - wk + (seen ? z : 0)), inv_m = 1 / (sum - wk),
                     inv_d = 1 / (sum + wk);
        double ez = 0, em = 0, ed = 0;
        for (int d = 0; d < kV; ++d) {
          const double rest = o[d] - wk * vr[d];
          ez = std::max(ez, std::abs(got[d] - rest * inv_z));
          em = std::max(em, std::abs(got[d] - rest * inv_m));
          ed = std::max(ed, std::abs(got[d] - (o[d] + wk * vr[d]) * inv_d));
        }
        zeroed[k] = std::max(zeroed[k], ez);
        missing[k] = std::max(missing[k], em);
        doubled[k] = std::max(doubled[k], ed);
      }
      double ex = 0;
      for (int d = 0; d < kV; ++d) ex = std::max(ex, std::abs(got[d] - o[d] / (sum + z)));
      r.extra_zero_key_error = std::max(r.extra_zero_key_error, ex);
      for (int64_t p = 0; p < pages; ++p) {
        const double* po = page_o.data() + p * kV;
        const double inv = 1 / (sum - page_w[p] + page_n[p] * z);
        double e = 0;
        for (int d = 0; d < kV; ++d) e = std::max(e, std::abs(got[d] - (o[d] - po[d]) * inv));
        page_zeroed[p] = std::max(page_zeroed[p], e);
      }
      // Split-K: a partition's keys [a, b) as this token sees them ([a, min(b, lim))).
      prefix_w[0] = 0;
      std::fill(prefix_o.begin(), prefix_o.begin() + kV, 0.0);
      for (int64_t k = 0; k < lim; ++k) {
        const float* vr = kvh + k * row;
        const double* prev = prefix_o.data() + k * kV;
        double* next = prefix_o.data() + (k + 1) * kV;
        for (int d = 0; d < kV; ++d) next[d] = prev[d] + w[k] * vr[d];
        prefix_w[k + 1] = prefix_w[k] + w[k];
      }
      for (size_t i = 0; i < ranges.size(); ++i) {
        const int64_t a = std::min(ranges[i].first, lim), b = std::min(ranges[i].second, lim);
        double el = as_is, ev = as_is;
        const double wr = prefix_w[b] - prefix_w[a];
        if (b > a && sum - wr > 0) {
          const double *ob = prefix_o.data() + b * kV, *oa = prefix_o.data() + a * kV;
          const double inv_l = 1 / (sum - wr), inv_v = 1 / sum;
          double e1 = 0, e2 = 0;
          for (int d = 0; d < kV; ++d) {
            const double rest = o[d] - (ob[d] - oa[d]);
            e1 = std::max(e1, std::abs(got[d] - rest * inv_l));
            e2 = std::max(e2, std::abs(got[d] - rest * inv_v));
          }
          // Applied only where it explains this row better than the result as it is.
          if (head_off && e1 < el) el = e1, ++range_lost_rows[i];
          if (head_off && e2 < ev) ev = e2, ++range_values_rows[i];
        }
        range_lost[i] = std::max(range_lost[i], el);
        range_values[i] = std::max(range_values[i], ev);
      }
    }
  }
  auto best = [](const std::vector<double>& v) {
    return static_cast<int64_t>(std::min_element(v.begin(), v.end()) - v.begin());
  };
  r.zeroed_row = best(zeroed);
  r.zeroed_row_error = zeroed[r.zeroed_row];
  r.missing_row = best(missing);
  r.missing_row_error = missing[r.missing_row];
  r.doubled_row = best(doubled);
  r.doubled_row_error = doubled[r.doubled_row];
  r.zeroed_page = best(page_zeroed);
  r.zeroed_page_error = page_zeroed[r.zeroed_page];
  auto best_range = [&](const std::vector<double>& err, const std::vector<int>& rows) {
    Diagnosis::KeyRange kr;
    if (ranges.empty()) return kr;
    const size_t i = static_cast<size_t>(best(err));
    kr.begin = ranges[i].first, kr.end = ranges[i].second, kr.rows = rows[i], kr.error = err[i];
    return kr;
  };
  r.range_left_out = best_range(range_lost, range_lost_rows);
  r.range_values_lost = best_range(range_values, range_values_rows);
  return r;
}

std::string Reference::Diagnosis::ToString(int64_t end, int s_q) const {
  std::string s = absl::StrFormat("%d of %d values out of tolerance", off, values);
  if (not_finite > 0) absl::StrAppendFormat(&s, ", %d not finite (a poisoned or corrupt row was read)", not_finite);
  absl::StrAppendFormat(&s, "; max error %.3g at token %d head %d dim %d", max_error, worst_token, worst_head,
                        worst_dim);
  if (!off_heads.empty()) {
    absl::StrAppend(&s, "; (token, head) pairs off: ", off_heads.size(), " (");
    for (size_t i = 0; i < off_heads.size() && i < 8; ++i) {
      absl::StrAppend(&s, i ? "; " : "", off_heads[i].first, ",", off_heads[i].second);
      if (i < off_dims.size() && off_dims[i].values > 0)
        absl::StrAppend(&s, ": ", off_dims[i].values, " in dims ", off_dims[i].first, "-", off_dims[i].last);
    }
    absl::StrAppend(&s, off_heads.size() > 8 ? " ...)" : ")");
  }
  if (not_finite > 0) return s;  // NaN leaves every hypothesis's remainder NaN
  auto where = [&](int64_t k) {
    std::string r = absl::StrCat("key row ", k, " (page ", k / kernels::kPageSize, " row ", k % kernels::kPageSize);
    if (k >= end - s_q) absl::StrAppend(&r, ", a row of this step");
    return r + ")";
  };
  absl::StrAppendFormat(&s, "; best explanations: %s read as zeros leaves %.3g; %s left out leaves %.3g; %s "
                        "counted twice leaves %.3g; page %d read as zeros leaves %.3g; one zero key too many "
                        "leaves %.3g",
                        where(zeroed_row), zeroed_row_error, where(missing_row), missing_row_error,
                        where(doubled_row), doubled_row_error, zeroed_page, zeroed_page_error, extra_zero_key_error);
  for (const auto& [kr, what] : {std::make_pair(range_left_out, "left out of the split-K merge"),
                                 std::make_pair(range_values_lost, "with their values lost, weight kept,")}) {
    if (kr.begin >= 0)
      absl::StrAppendFormat(&s, "; keys [%d, %d) %s in %d (token, head) rows leave %.3g", kr.begin, kr.end, what,
                            kr.rows, kr.error);
  }
  return s;
}

absl::Status Reference::Check(const std::string& sequence_id, int layer, int64_t end, absl::string_view q, int s_q,
                              bool causal, const v1::StepResult& result) {
  if (result.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(result.code()),
                        absl::StrCat("step failed on the server: ", result.message()));
  }
  std::string out, lse;
  absl::Status st = Expected(sequence_id, layer, end, q, s_q, causal, &out, &lse);
  if (!st.ok()) return st;
  return Compare(result.out(), result.lse(), out, lse);
}

}  // namespace latentd::client
