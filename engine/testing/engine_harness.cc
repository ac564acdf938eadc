// Engine test harness; see engine_harness.h.
#include "engine/testing/engine_harness.h"

#include <pthread.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/half.h"
#include "kernels/cpu/mla_decode_cpu.h"
#include "kernels/kv_fp8.h"

namespace latentd::engine::testing {

using kernels::kHeadDimQK;
using kernels::kHeadDimV;
using kernels::kPageSize;

Harness::Harness(Engine* engine, uint64_t seed)
    : engine_(engine), model_(engine->Info().model), kv_dtype_(engine->Info().kv_dtype), rng_(seed) {}

Harness::~Harness() { HoldCallbacks(false); }

std::string Harness::RandomRows(int n) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::string bytes(size_t(n) * model_.num_heads_kv * kHeadDimQK * 2, '\0');
  auto* v = reinterpret_cast<uint16_t*>(bytes.data());
  for (size_t i = 0; i < bytes.size() / 2; ++i) v[i] = kernels::FloatToHalf(model_.dtype, normal(rng_));
  return bytes;
}

std::string Harness::NewSequence(int prefix, const std::string& id) {
  auto created = engine_->CreateSequence(id);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return "";
  Shadow& sh = shadows_[*created];
  sh.layers.resize(model_.num_layers);
  for (int l = 0; l < model_.num_layers && prefix > 0; ++l) {
    const std::string rows = RandomRows(prefix);
    auto appended = engine_->AppendKv(*created, l, rows);
    EXPECT_TRUE(appended.ok()) << appended.status();
    const auto* v = reinterpret_cast<const uint16_t*>(rows.data());
    sh.layers[l].assign(v, v + rows.size() / 2);
  }
  return *created;
}

std::string Harness::Fork(const std::string& id) {
  auto forked = engine_->ForkSequence(id, "");
  EXPECT_TRUE(forked.ok()) << forked.status();
  if (!forked.ok()) return "";
  Shadow copy = shadows_[id];
  shadows_[*forked] = std::move(copy);
  return *forked;
}

void Harness::Adopt(const Harness& from, const std::string& from_id, const std::string& id) {
  auto it = from.shadows_.find(from_id);
  ASSERT_NE(it, from.shadows_.end()) << "no rows recorded for " << from_id;
  shadows_[id] = it->second;
}

Harness::Pending* Harness::MakeStep(const std::string& id, int layer, int s_q, bool causal) {
  auto p = std::make_unique<Pending>();
  std::normal_distribution<float> normal(0.f, 1.f);
  p->q.resize(size_t(s_q) * model_.num_heads_q * kHeadDimQK * 2);
  auto* q = reinterpret_cast<uint16_t*>(p->q.data());
  for (size_t i = 0; i < p->q.size() / 2; ++i) q[i] = kernels::FloatToHalf(model_.dtype, normal(rng_));
  p->kv = RandomRows(s_q);
  p->out.assign(size_t(s_q) * model_.num_heads_q * kHeadDimV, 0x7fc1);  // poisoned (NaN)
  p->lse.assign(size_t(s_q) * model_.num_heads_q, std::numeric_limits<float>::quiet_NaN());
  auto& rows = shadows_[id].layers;
  if (layer >= 0 && layer < static_cast<int>(rows.size())) {
    const auto* v = reinterpret_cast<const uint16_t*>(p->kv.data());
    rows[layer].insert(rows[layer].end(), v, v + p->kv.size() / 2);
    p->context = rows[layer];
  }
  p->context_len = static_cast<int64_t>(p->context.size() / (size_t(model_.num_heads_kv) * kHeadDimQK));
  DecodeStep& s = p->step;
  s.request_id = steps_.size();
  s.sequence_id = id;
  s.layer = layer;
  s.s_q = s_q;
  s.causal = causal;
  s.q = TensorLocation::Host(p->q.data(), p->q.size());
  s.kv = TensorLocation::Host(p->kv.data(), p->kv.size());
  s.out = TensorLocation::Host(p->out.data(), p->out.size() * sizeof(p->out[0]));
  s.lse = TensorLocation::Host(p->lse.data(), p->lse.size() * sizeof(float));
  s.cancelled = &p->cancelled;
  s.callback = this;
  // StepDone looks steps up from the engine's thread while earlier steps are in flight.
  absl::MutexLock lock(&mu_);
  steps_.push_back(std::move(p));
  return steps_.back().get();
}

void Harness::Rollback(Pending* p) {
  auto it = shadows_.find(p->step.sequence_id);
  if (it == shadows_.end() || p->step.layer < 0 || p->step.layer >= static_cast<int>(it->second.layers.size()))
    return;
  auto& rows = it->second.layers[p->step.layer];
  rows.resize(rows.size() - p->kv.size() / 2);
}

absl::Status Harness::Submit(Pending* p) {
  {
    absl::MutexLock lock(&mu_);
    ++submitted_;
  }
  absl::Status st = engine_->Submit(&p->step);
  if (!st.ok()) {
    Rollback(p);
    absl::MutexLock lock(&mu_);
    --submitted_;
  }
  return st;
}

absl::Status Harness::SubmitBatch(const std::vector<Pending*>& ps) {
  {
    absl::MutexLock lock(&mu_);
    submitted_ += static_cast<int>(ps.size());
  }
  std::vector<DecodeStep*> steps;
  for (Pending* p : ps) steps.push_back(&p->step);
  std::vector<absl::Status> statuses(ps.size());
  engine_->SubmitBatch(steps.data(), static_cast<int>(steps.size()), statuses.data());
  absl::Status first;
  for (size_t i = 0; i < ps.size(); ++i) {
    if (statuses[i].ok()) continue;
    if (first.ok()) first = statuses[i];
    Rollback(ps[i]);
    absl::MutexLock lock(&mu_);
    --submitted_;
  }
  return first;
}

void Harness::StepDone(DecodeStep* step, absl::Status status) {
  absl::MutexLock lock(&mu_);
  Pending* p = steps_[step->request_id].get();
  while (hold_) cv_.Wait(&mu_);
  p->status = status;
  p->done = true;
  p->completion_rank = completed_++;
  char name[16] = {};
  pthread_getname_np(pthread_self(), name, sizeof(name));
  p->completed_on = name;
  cv_.SignalAll();
}

void Harness::HoldCallbacks(bool hold) {
  absl::MutexLock lock(&mu_);
  hold_ = hold;
  cv_.SignalAll();
}

bool Harness::WaitAll(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (completed_ < submitted_)
    if (cv_.WaitWithDeadline(&mu_, deadline)) return completed_ >= submitted_;
  return true;
}

int Harness::completed() const {
  absl::MutexLock lock(&mu_);
  return completed_;
}

::testing::AssertionResult Harness::Check(const Pending& p, bool exact) const {
  if (!p.done) return ::testing::AssertionFailure() << "step " << p.step.request_id << " never completed";
  if (!p.status.ok()) return ::testing::AssertionFailure() << "step failed: " << p.status;
  const int h_q = model_.num_heads_q, h_kv = model_.num_heads_kv, s_q = p.step.s_q;
  const int64_t len = p.context_len;
  const int pages = static_cast<int>(std::max<int64_t>(1, (len + kPageSize - 1) / kPageSize));
  std::vector<uint16_t> kv(size_t(pages) * kPageSize * h_kv * kHeadDimQK,
                           kernels::FloatToHalf(model_.dtype, std::numeric_limits<float>::quiet_NaN()));
  std::copy(p.context.begin(), p.context.end(), kv.begin());
  if (kv_dtype_ == kernels::KvDType::kFp8E4M3) {
    // What the engine stored of each row, read back as every decoder reads it.
    uint8_t stored[kernels::kFp8RowBytes];
    for (size_t r = 0; r < p.context.size() / kHeadDimQK; ++r) {
      kernels::QuantizeKvRowFp8(model_.dtype, kv.data() + r * kHeadDimQK, stored);
      kernels::DequantizeKvRowFp8(model_.dtype, stored, kv.data() + r * kHeadDimQK);
    }
  }
  std::vector<int32_t> table(pages);
  for (int i = 0; i < pages; ++i) table[i] = i;
  const int32_t seqlen = static_cast<int32_t>(len);
  std::vector<uint16_t> out(size_t(s_q) * h_q * kHeadDimV);
  std::vector<float> lse(size_t(s_q) * h_q);
  kernels::MlaDecodeParams prm;
  prm.dtype = model_.dtype;
  prm.batch = 1;
  prm.s_q = s_q;
  prm.h_q = h_q;
  prm.h_kv = h_kv;
  prm.num_pages = pages;
  prm.max_pages_per_seq = pages;
  prm.softmax_scale = model_.softmax_scale;
  prm.causal = p.step.causal && s_q > 1;
  kernels::SetContiguousStrides(&prm);
  prm.q = p.q.data();
  prm.kv = kv.data();
  prm.block_table = table.data();
  prm.seqlens = &seqlen;
  prm.out = out.data();
  prm.lse = lse.data();
  kernels::CpuMlaDecoder oracle(1);  // one thread: never splits, like a batched engine call
  const auto st = oracle.Run(prm);
  if (!st.ok()) return ::testing::AssertionFailure() << "oracle: " << st.message;
  // The GPU kernel rounds softmax probabilities to the 16-bit type before P @ V, an
  // error of up to 2^-8 of each weight: with few keys it does not average out, so the
  // tolerance carries a term scaled by the row's largest output.
  std::vector<float> row_max(size_t(s_q) * h_q, 0.f);
  for (size_t i = 0; i < out.size(); ++i)
    row_max[i / kHeadDimV] = std::max(row_max[i / kHeadDimV], std::abs(kernels::HalfToFloat(model_.dtype, out[i])));
  for (size_t i = 0; i < out.size(); ++i) {
    const float got = kernels::HalfToFloat(model_.dtype, p.out[i]);
    const float want = kernels::HalfToFloat(model_.dtype, out[i]);
    const bool ok = exact ? p.out[i] == out[i]
                          : std::abs(got - want) <= 8e-4f + std::abs(want) * (2.f / 128) + row_max[i / kHeadDimV] / 256;
    if (!ok)
      return ::testing::AssertionFailure() << "step " << p.step.request_id << " out[" << i << "] = " << got
                                           << ", oracle " << want << " (context " << len << ")";
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    const bool both_inf = std::isinf(lse[i]) && std::isinf(p.lse[i]) && lse[i] < 0 && p.lse[i] < 0;
    const bool ok = both_inf || (exact ? std::memcmp(&lse[i], &p.lse[i], 4) == 0
                                       : std::abs(lse[i] - p.lse[i]) <= std::max(1e-6f, std::abs(lse[i]) * 8.f / 65536));
    if (!ok)
      return ::testing::AssertionFailure() << "step " << p.step.request_id << " lse[" << i << "] = " << p.lse[i]
                                           << ", oracle " << lse[i];
  }
  return ::testing::AssertionSuccess();
}

}  // namespace latentd::engine::testing
