// Host tier figures (docs/benchmarks.md "Host tier"), on the engine without gRPC:
//  1. restore: a LEN-token sequence on every layer is moved to the host tier and a
//     one-token step on layer 0 brings it back; offload time, step-with-restore time
//     and a resident step's time, medians over --repeats.
//  2. capacity: a pool of N pages serves --oversubscribe x N pages of sequences visited
//     round robin (least recently used first: each visit restores), one s_q 1 step per
//     layer per visit as one SubmitBatch; visit latency p50/p99 against the same visits
//     with every sequence resident in a pool large enough.
// Usage: host_tier_bench [--backend=cuda] [--layers=61] [--tokens=4096] [--heads=16]
//        [--kv_dtype=auto|fp8_e4m3] [--repeats=5] [--seqs=16] [--seq_tokens=1024]
//        [--oversubscribe=4] [--visits=64]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "engine/engine.h"
#include "kernels/kv_fp8.h"

ABSL_FLAG(std::string, backend, "cuda", "cuda or cpu");
ABSL_FLAG(int, layers, 61, "layers");
ABSL_FLAG(int, tokens, 4096, "restore: tokens per layer of the restored sequence");
ABSL_FLAG(int, heads, 16, "query heads");
ABSL_FLAG(std::string, kv_dtype, "auto", "auto (bf16) or fp8_e4m3");
ABSL_FLAG(int, repeats, 5, "restore: repetitions");
ABSL_FLAG(int, seqs, 16, "capacity: sequences");
ABSL_FLAG(int, seq_tokens, 1024, "capacity: prefix tokens per sequence and layer");
ABSL_FLAG(int, oversubscribe, 4, "capacity: sequences' pages over the pool's");
ABSL_FLAG(int, visits, 64, "capacity: visits measured");

namespace latentd::engine {
namespace {

class Waiter : public StepCallback {
 public:
  void StepDone(DecodeStep*, absl::Status status) override {
    absl::MutexLock lock(&mu_);
    if (!status.ok() && first_error_.ok()) first_error_ = status;
    ++done_;
  }
  absl::Status Wait(int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ >= n; };
    mu_.Await(absl::Condition(&reached));
    return first_error_;
  }

 private:
  absl::Mutex mu_;
  int done_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
};

// Buffers of one s_q 1 step.
struct Step {
  DecodeStep step;
  std::vector<uint16_t> q, kv, out;
  std::vector<float> lse;
};

std::vector<uint16_t> RandomBf16(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) {
    float f = d(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    x = static_cast<uint16_t>(u >> 16);
  }
  return v;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

class Bench {
 public:
  Bench(int layers, int heads) : layers_(layers), heads_(heads) {}

  absl::StatusOr<std::unique_ptr<Engine>> Make(int64_t pages, int64_t host_bytes) {
    EngineOptions o;
    o.backend = absl::GetFlag(FLAGS_backend) == "cpu" ? BackendKind::kCpu : BackendKind::kCuda;
    o.model.num_layers = layers_;
    o.model.num_heads_q = heads_;
    o.kv_dtype = absl::GetFlag(FLAGS_kv_dtype) == "fp8_e4m3" ? kernels::KvDType::kFp8E4M3 : kernels::KvDType::kModel;
    o.kv_pages = pages;
    o.host_kv_bytes = host_bytes;
    o.max_sequences = 0;
    return Engine::Create(o);
  }

  absl::Status Fill(Engine* e, const std::string& id, int tokens) {
    if (rows_.size() < size_t(tokens) * 576) rows_ = RandomBf16(size_t(tokens) * 576, 7);
    auto created = e->CreateSequence(id);
    if (!created.ok()) return created.status();
    const absl::string_view bytes(reinterpret_cast<const char*>(rows_.data()), size_t(tokens) * 576 * 2);
    for (int l = 0; l < layers_; ++l) {
      auto st = e->AppendKv(id, l, bytes);
      if (!st.ok()) return st.status();
    }
    return absl::OkStatus();
  }

  // One s_q 1 step on each of `layers` layers of `id`, as one SubmitBatch; waits.
  absl::Status Visit(Engine* e, const std::string& id, int layers) {
    steps_.resize(layers);
    Waiter w;
    std::vector<DecodeStep*> ptrs;
    for (int l = 0; l < layers; ++l) {
      Step& s = steps_[l];
      if (s.q.empty()) {
        s.q = RandomBf16(size_t(heads_) * 576, 100 + l);
        s.kv = RandomBf16(576, 200 + l);
        s.out.resize(size_t(heads_) * 512);
        s.lse.resize(heads_);
      }
      s.step = DecodeStep();
      s.step.sequence_id = id;
      s.step.layer = l;
      s.step.s_q = 1;
      s.step.q = TensorLocation::Host(s.q.data(), s.q.size() * 2);
      s.step.kv = TensorLocation::Host(s.kv.data(), s.kv.size() * 2);
      s.step.out = TensorLocation::Host(s.out.data(), s.out.size() * 2);
      s.step.lse = TensorLocation::Host(s.lse.data(), s.lse.size() * 4);
      s.step.callback = &w;
      ptrs.push_back(&s.step);
    }
    std::vector<absl::Status> statuses(layers);
    e->SubmitBatch(ptrs.data(), layers, statuses.data());
    for (const auto& st : statuses)
      if (!st.ok()) return st;
    return w.Wait(layers);
  }

 private:
  const int layers_, heads_;
  std::vector<uint16_t> rows_;
  std::vector<Step> steps_;
};

int64_t RowBytes() { return absl::GetFlag(FLAGS_kv_dtype) == "fp8_e4m3" ? 656 : 1152; }

int Restore() {
  const int layers = absl::GetFlag(FLAGS_layers), tokens = absl::GetFlag(FLAGS_tokens);
  Bench b(layers, absl::GetFlag(FLAGS_heads));
  const int64_t pages = (tokens + 64 + 63) / 64 + 4;
  const int64_t bytes = int64_t(layers) * ((tokens + 1 + 63) / 64 + 1) * 64 * RowBytes();
  auto e = b.Make(pages, bytes + (int64_t(64) << 20));
  if (!e.ok()) {
    std::fprintf(stderr, "engine: %s\n", e.status().ToString().c_str());
    return 1;
  }
  if (auto st = b.Fill(e->get(), "r", tokens); !st.ok()) {
    std::fprintf(stderr, "fill: %s\n", st.ToString().c_str());
    return 1;
  }
  std::vector<double> offload_ms, restore_ms, resident_ms;
  for (int r = 0; r < absl::GetFlag(FLAGS_repeats) + 1; ++r) {
    absl::Time t0 = absl::Now();
    if (auto st = b.Visit(e->get(), "r", 1); !st.ok()) {
      std::fprintf(stderr, "step: %s\n", st.ToString().c_str());
      return 1;
    }
    const double resident = absl::ToDoubleMilliseconds(absl::Now() - t0);
    t0 = absl::Now();
    if ((*e)->OffloadIdleSequences(absl::ZeroDuration()) != 1) {
      std::fprintf(stderr, "offload: the sequence did not move\n");
      return 1;
    }
    const double offload = absl::ToDoubleMilliseconds(absl::Now() - t0);
    t0 = absl::Now();
    if (auto st = b.Visit(e->get(), "r", 1); !st.ok()) {
      std::fprintf(stderr, "restore step: %s\n", st.ToString().c_str());
      return 1;
    }
    const double restore = absl::ToDoubleMilliseconds(absl::Now() - t0);
    if (r == 0) continue;  // warm-up
    resident_ms.push_back(resident);
    offload_ms.push_back(offload);
    restore_ms.push_back(restore);
  }
  auto info = (*e)->GetSequence("r");
  int64_t rows = 0;
  for (int64_t n : info->lengths) rows += n;
  const double mb = double(rows) * RowBytes() / 1e6;
  std::printf("restore: %d layers x %lld rows, %.1f MB stored (%s), %s backend\n", layers,
              static_cast<long long>(info->lengths[0]), mb, absl::GetFlag(FLAGS_kv_dtype).c_str(),
              absl::GetFlag(FLAGS_backend).c_str());
  std::printf("  offload           median %8.2f ms  (%.1f GB/s)\n", Median(offload_ms), mb / Median(offload_ms));
  std::printf("  step with restore median %8.2f ms  (%.1f GB/s restore)\n", Median(restore_ms),
              mb / std::max(1e-3, Median(restore_ms) - Median(resident_ms)));
  std::printf("  resident step     median %8.2f ms\n", Median(resident_ms));
  const EngineMetrics m = (*e)->Metrics();
  std::printf("  engine: %llu offloads, %llu restores, %.2f ms mean restore (engine-side)\n",
              static_cast<unsigned long long>(m.host_offloads), static_cast<unsigned long long>(m.host_restores),
              m.host_restores ? 1e3 * m.host_restore_seconds / m.host_restores : 0.0);
  return 0;
}

int Capacity() {
  const int layers = absl::GetFlag(FLAGS_layers), seqs = absl::GetFlag(FLAGS_seqs);
  const int tokens = absl::GetFlag(FLAGS_seq_tokens), visits = absl::GetFlag(FLAGS_visits);
  const int64_t per_seq = (tokens + absl::GetFlag(FLAGS_visits) / seqs + 2 + 63) / 64;  // pages incl. decode rows
  const int64_t all_pages = per_seq * seqs;
  const int64_t pool = std::max<int64_t>(per_seq * 2, all_pages / absl::GetFlag(FLAGS_oversubscribe));
  const int64_t host = int64_t(layers) * all_pages * 64 * RowBytes();
  std::printf("capacity: %d sequences x %d tokens x %d layers = %lld pages; pool %lld pages, host tier %.1f GB\n",
              seqs, tokens, layers, static_cast<long long>(all_pages), static_cast<long long>(pool), host / 1e9);
  for (const bool tiered : {false, true}) {
    Bench b(layers, absl::GetFlag(FLAGS_heads));
    auto e = tiered ? b.Make(pool, host) : b.Make(all_pages + 8, 0);
    if (!e.ok()) {
      std::fprintf(stderr, "engine: %s\n", e.status().ToString().c_str());
      return 1;
    }
    for (int i = 0; i < seqs; ++i) {
      if (auto st = b.Fill(e->get(), absl::StrCat("c", i), tokens); !st.ok()) {
        std::fprintf(stderr, "fill %d: %s\n", i, st.ToString().c_str());
        return 1;
      }
    }
    std::vector<double> ms;
    for (int v = 0; v < visits + seqs; ++v) {
      const absl::Time t0 = absl::Now();
      if (auto st = b.Visit(e->get(), absl::StrCat("c", v % seqs), layers); !st.ok()) {
        std::fprintf(stderr, "visit %d: %s\n", v, st.ToString().c_str());
        return 1;
      }
      if (v >= seqs) ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));  // first round: warm-up
    }
    const EngineMetrics m = (*e)->Metrics();
    std::printf("  %-22s visit (%d layer steps) p50 %8.2f ms  p99 %8.2f ms  offloads %llu restores %llu\n",
                tiered ? "pool 1/N + host tier:" : "all resident:", layers, Percentile(ms, 0.5), Percentile(ms, 0.99),
                static_cast<unsigned long long>(m.host_offloads), static_cast<unsigned long long>(m.host_restores));
  }
  return 0;
}

}  // namespace
}  // namespace latentd::engine

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (int rc = latentd::engine::Restore(); rc != 0) return rc;
  return latentd::engine::Capacity();
}
