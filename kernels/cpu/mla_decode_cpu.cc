// CPU MLA decode. Each work item is (sequence, KV head, key range): every query row
// sharing that KV head is processed against each KV row while the row is in cache, so
// the cache is read once per call. Long sequences are split over threads and combined
// exactly like the GPU's split-K.
#include "kernels/cpu/mla_decode_cpu.h"

#include "kernels/kv_fp8.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "kernels/cpu/half.h"

namespace latentd::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

const float* Fp16Table() {
  static const std::vector<float>* table = [] {
    auto* t = new std::vector<float>(65536);
    for (int i = 0; i < 65536; ++i) (*t)[i] = Fp16ToFloat(static_cast<uint16_t>(i));
    return t;
  }();
  return table->data();
}

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "kernels/cpu/attend_block.inc"
#pragma GCC pop_options
}  // namespace avx2

namespace generic {
#include "kernels/cpu/attend_block.inc"
}  // namespace generic

std::atomic<bool> g_force_generic{false};

bool HasAvx2Fma() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes && !g_force_generic.load(std::memory_order_relaxed);
}

void AttendBlock(const float* q, const float* k, int n, int rows, const int* visible, float* scores, float* m,
                 float* l, float* acc) {
  (HasAvx2Fma() ? avx2::AttendBlock : generic::AttendBlock)(q, k, n, rows, visible, scores, m, l, acc);
}

void ToFloatRows(DType dtype, const uint16_t* src, int64_t src_stride, int n, float* dst) {
  (HasAvx2Fma() ? avx2::ToFloatRows : generic::ToFloatRows)(dtype, src, src_stride, n, dst);
}

void Axpy512(float alpha, const float* __restrict x, float* __restrict y) {
  for (int d = 0; d < kHeadDimV; ++d) y[d] += alpha * x[d];
}


}  // namespace

void CpuMlaDecoder::ForceGenericCodeForTesting(bool force) { g_force_generic.store(force); }
bool CpuMlaDecoder::UsesAvx2() { return HasAvx2Fma(); }

CpuMlaDecoder::CpuMlaDecoder(int num_threads) {
  if (num_threads <= 0) num_threads = std::max(1u, std::thread::hardware_concurrency());
  scratch_.resize(num_threads);
  for (int t = 1; t < num_threads; ++t) {
    workers_.emplace_back([this, t] {
      char name[16];
      std::snprintf(name, sizeof(name), "latentd-cpu%d", t);
      pthread_setname_np(pthread_self(), name);  // for top -H and debuggers
      WorkerLoop(t);
    });
  }
  Fp16Table();
}

CpuMlaDecoder::~CpuMlaDecoder() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void CpuMlaDecoder::WorkerLoop(int thread) {
  int seen = 0;
  for (;;) {
    const std::function<void(int, int)>* job;
    int n;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_size_;
    }
    for (int i = next_.fetch_add(1); i < n; i = next_.fetch_add(1)) (*job)(i, thread);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--busy_ == 0) done_cv_.notify_all();
    }
  }
}

void CpuMlaDecoder::ParallelFor(int n, const std::function<void(int, int)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_size_ = n;
    next_.store(0);
    busy_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  start_cv_.notify_all();
  for (int i = next_.fetch_add(1); i < n; i = next_.fetch_add(1)) fn(i, 0);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return busy_ == 0; });
  job_ = nullptr;
}

Status CpuMlaDecoder::Run(const MlaDecodeParams& p) {
  Status st = ValidateParams(p);
  if (!st.ok()) return st;
  if (p.batch == 0) return Status::Ok();
  for (int b = 0; b < p.batch; ++b) {
    const int len = p.seqlens[b];
    if (len < 0 || int64_t{len} > int64_t{p.max_pages_per_seq} * kPageSize)
      return Status::Invalid("seqlens[" + std::to_string(b) + "]: expected 0.." +
                             std::to_string(int64_t{p.max_pages_per_seq} * kPageSize) + ", got " +
                             std::to_string(len));
    const int32_t* table = p.block_table + b * p.block_table_batch_stride;
    for (int j = 0; j < (len + kPageSize - 1) / kPageSize; ++j)
      if (table[j] < 0 || table[j] >= p.num_pages)
        return Status::Invalid("block_table[" + std::to_string(b) + "][" + std::to_string(j) +
                               "]: expected a page id in [0, " + std::to_string(p.num_pages) + "), got " +
                               std::to_string(table[j]));
  }

  // Split sequences when there are fewer (sequence, KV head) pairs than threads.
  const int pairs = p.batch * p.h_kv;
  const int threads = num_threads();
  int64_t total_keys = 0;
  for (int b = 0; b < p.batch; ++b) total_keys += p.seqlens[b];
  int64_t keys_per_split = std::numeric_limits<int>::max();
  if (pairs < threads && total_keys > 0) {
    keys_per_split = std::max<int64_t>(min_keys_per_split_, (total_keys * p.h_kv + threads - 1) / threads);
    keys_per_split = (keys_per_split + kPageSize - 1) / kPageSize * kPageSize;
  }
  const int rows = (p.h_q / p.h_kv) * p.s_q;

  items_.clear();
  combine_first_.assign(pairs, -1);
  combine_count_.assign(pairs, 0);
  int partials = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int len = p.seqlens[b];
    const int splits = len > keys_per_split ? static_cast<int>((len + keys_per_split - 1) / keys_per_split) : 1;
    for (int h = 0; h < p.h_kv; ++h) {
      if (splits == 1) {
        items_.push_back({b, h, 0, len, -1});
        continue;
      }
      combine_first_[b * p.h_kv + h] = partials;
      combine_count_[b * p.h_kv + h] = splits;
      for (int s = 0; s < splits; ++s) {
        const int begin = static_cast<int>(s * keys_per_split);
        const int end = static_cast<int>(std::min<int64_t>(len, (s + 1) * keys_per_split));
        items_.push_back({b, h, begin, end, partials++});
      }
    }
  }
  Grow(pairs, rows, partials, p.kv_dtype == KvDType::kFp8E4M3);
  ParallelFor(static_cast<int>(items_.size()), [&](int i, int t) { RunItem(p, items_[i], scratch_[t]); });
  if (partials > 0) {
    ParallelFor(pairs, [&](int i, int) {
      if (combine_first_[i] >= 0) CombineItem(p, i / p.h_kv, i % p.h_kv, combine_first_[i], combine_count_[i]);
    });
  }
  return Status::Ok();
}

void CpuMlaDecoder::Reserve(int max_batch, int h_kv, int max_rows, bool fp8) {
  // A call splits only when it has fewer pairs than threads, into at most
  // threads + pairs partitions (each pair's ceil(len / keys_per_split) summed, with
  // keys_per_split >= total keys * h_kv / threads).
  const int pairs = std::max(1, max_batch * std::max(1, h_kv));
  Grow(pairs, max_rows, 2 * num_threads(), fp8);
}

// Grows (never shrinks) the plan and scratch buffers for a call of this shape; runs on
// the caller, so a worker taking its first item of a larger shape allocates nothing.
void CpuMlaDecoder::Grow(int pairs, int rows, int partials, bool fp8) {
  const size_t max_items = size_t(pairs) + size_t(std::max(partials, 0));
  if (items_.capacity() < max_items) items_.reserve(max_items);
  if (combine_first_.capacity() < size_t(pairs)) combine_first_.reserve(pairs);
  if (combine_count_.capacity() < size_t(pairs)) combine_count_.reserve(pairs);
  if (partials > 0) {
    const size_t acc_size = size_t(partials) * rows * kHeadDimV;
    if (partial_acc_.size() < acc_size) partial_acc_.resize(acc_size);
    if (partial_ml_.size() < size_t(partials) * rows * 2) partial_ml_.resize(size_t(partials) * rows * 2);
  }
  for (Scratch& s : scratch_) {
    const size_t n = size_t(rows);
    if (s.q.size() < n * kHeadDimQK) s.q.resize(n * kHeadDimQK);
    if (s.scores.size() < n * kPageSize) s.scores.resize(n * kPageSize);
    if (s.acc.capacity() < n * kHeadDimV) s.acc.reserve(n * kHeadDimV);
    if (s.m.capacity() < n) s.m.reserve(n);
    if (s.l.capacity() < n) s.l.reserve(n);
    if (s.limit.size() < n) s.limit.resize(n);
    if (s.visible.size() < n) s.visible.resize(n);
    if (s.k.size() < size_t(kPageSize) * kHeadDimQK) s.k.resize(size_t(kPageSize) * kHeadDimQK);
    if (fp8 && s.kv16.size() < size_t(kPageSize) * kHeadDimQK) s.kv16.resize(size_t(kPageSize) * kHeadDimQK);
  }
}

void CpuMlaDecoder::RunItem(const MlaDecodeParams& p, const WorkItem& item, Scratch& s) {
  const int group = p.h_q / p.h_kv;
  const int rows = group * p.s_q;  // row r = query token (r / group), head (kv_head * group + r % group)
  const int len = p.seqlens[item.batch];
  s.q.resize(size_t(rows) * kHeadDimQK);
  s.k.resize(size_t(kPageSize) * kHeadDimQK);
  s.scores.resize(size_t(rows) * kPageSize);
  s.acc.assign(size_t(rows) * kHeadDimV, 0.f);
  s.m.assign(rows, kNegInf);
  s.l.assign(rows, 0.f);

  const auto* q = static_cast<const uint16_t*>(p.q);
  int max_limit = 0;
  s.limit.resize(rows);
  s.visible.resize(rows);
  int* limit = s.limit.data();
  int* visible = s.visible.data();
  for (int r = 0; r < rows; ++r) {
    const int i = r / group, h = item.kv_head * group + r % group;
    const uint16_t* src = q + item.batch * p.q_batch_stride + i * p.q_seq_stride + h * p.q_head_stride;
    float* dst = s.q.data() + size_t(r) * kHeadDimQK;
    ToFloatRows(p.dtype, src, kHeadDimQK, 1, dst);
    for (int d = 0; d < kHeadDimQK; ++d) dst[d] *= p.softmax_scale;
    int lim = p.causal ? len - p.s_q + i + 1 : len;
    lim = std::clamp(lim, 0, len);
    limit[r] = std::min(lim, item.key_end);
    max_limit = std::max(max_limit, limit[r]);
  }

  const int32_t* table = p.block_table + item.batch * p.block_table_batch_stride;
  const int end = std::min(item.key_end, max_limit);
  const bool fp8 = p.kv_dtype == KvDType::kFp8E4M3;
  if (fp8) s.kv16.resize(size_t(kPageSize) * kHeadDimQK);
  for (int k0 = item.key_begin; k0 < end;) {
    const int page_idx = k0 / kPageSize;
    const int k1 = std::min(end, (page_idx + 1) * kPageSize);
    const int n = k1 - k0;
    if (fp8) {
      // Dequantized to the 16-bit values the GPU kernel computes with, then as below.
      const auto* page = static_cast<const uint8_t*>(p.kv) + int64_t{table[page_idx]} * p.kv_page_stride +
                         item.kv_head * p.kv_head_stride;
      for (int j = 0; j < n; ++j)
        DequantizeKvRowFp8(p.dtype, page + int64_t(k0 % kPageSize + j) * p.kv_row_stride,
                           s.kv16.data() + size_t(j) * kHeadDimQK);
      ToFloatRows(p.dtype, s.kv16.data(), kHeadDimQK, n, s.k.data());
    } else {
      const uint16_t* page = static_cast<const uint16_t*>(p.kv) + int64_t{table[page_idx]} * p.kv_page_stride +
                             item.kv_head * p.kv_head_stride;
      ToFloatRows(p.dtype, page + int64_t(k0 % kPageSize) * p.kv_row_stride, p.kv_row_stride, n, s.k.data());
    }
    for (int r = 0; r < rows; ++r) visible[r] = limit[r] - k0;
    AttendBlock(s.q.data(), s.k.data(), n, rows, visible, s.scores.data(), s.m.data(), s.l.data(), s.acc.data());
    k0 = k1;
  }

  if (item.partial >= 0) {
    float* acc_out = partial_acc_.data() + size_t(item.partial) * rows * kHeadDimV;
    float* ml = partial_ml_.data() + size_t(item.partial) * rows * 2;
    std::copy(s.acc.begin(), s.acc.begin() + size_t(rows) * kHeadDimV, acc_out);
    for (int r = 0; r < rows; ++r) {
      ml[2 * r] = s.m[r];
      ml[2 * r + 1] = s.l[r];
    }
    return;
  }
  auto* out = static_cast<uint16_t*>(p.out);
  for (int r = 0; r < rows; ++r) {
    const int i = r / group, h = item.kv_head * group + r % group;
    uint16_t* o = out + item.batch * p.out_batch_stride + i * p.out_seq_stride + h * p.out_head_stride;
    const float inv = s.l[r] > 0.f ? 1.f / s.l[r] : 0.f;
    const float* acc = s.acc.data() + size_t(r) * kHeadDimV;
    for (int d = 0; d < kHeadDimV; ++d) o[d] = FloatToHalf(p.dtype, acc[d] * inv);
    p.lse[item.batch * p.lse_batch_stride + h * p.lse_head_stride + i] =
        s.l[r] > 0.f ? std::log(s.l[r]) + s.m[r] : kNegInf;
  }
}

void CpuMlaDecoder::CombineItem(const MlaDecodeParams& p, int batch, int kv_head, int first, int count) {
  const int group = p.h_q / p.h_kv;
  const int rows = group * p.s_q;
  auto* out = static_cast<uint16_t*>(p.out);
  float acc[kHeadDimV];
  for (int r = 0; r < rows; ++r) {
    float m = kNegInf;
    for (int s = 0; s < count; ++s) m = std::max(m, partial_ml_[(size_t(first + s) * rows + r) * 2]);
    std::fill(acc, acc + kHeadDimV, 0.f);
    float l = 0.f;
    if (m != kNegInf) {
      for (int s = 0; s < count; ++s) {
        const float* ml = &partial_ml_[(size_t(first + s) * rows + r) * 2];
        if (ml[1] == 0.f) continue;
        const float w = std::exp(ml[0] - m);
        l += ml[1] * w;
        Axpy512(w, partial_acc_.data() + (size_t(first + s) * rows + r) * kHeadDimV, acc);
      }
    }
    const int i = r / group, h = kv_head * group + r % group;
    uint16_t* o = out + batch * p.out_batch_stride + i * p.out_seq_stride + h * p.out_head_stride;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int d = 0; d < kHeadDimV; ++d) o[d] = FloatToHalf(p.dtype, acc[d] * inv);
    p.lse[batch * p.lse_batch_stride + h * p.lse_head_stride + i] = l > 0.f ? std::log(l) + m : kNegInf;
  }
}

}  // namespace latentd::kernels
