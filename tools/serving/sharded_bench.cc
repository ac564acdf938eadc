// latentd scale-out benchmark: R runners, each stepping B sequences over L layers through
// one ShardedClient (client-side hashing over every daemon, or one proxy with --via_proxy),
// one DecodeBatch per layer. Reports layer-steps/s, the per-layer round trip, results per
// daemon, and, when a daemon is lost mid-run, how its sequences failed (UNAVAILABLE, and
// how long a layer took to say so) while every sampled result of the others is checked.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "clients/cpp/reference.h"
#include "clients/cpp/sharded_client.h"
#include "tools/serving/result_checker.h"

ABSL_FLAG(std::string, targets, "", "comma-separated host:port of every daemon (or of the proxy with --via_proxy)");
ABSL_FLAG(std::string, targets_file, "",
          "a file of host:port lines instead of --targets (scripts/cluster.sh writes RUN_DIR/targets and RUN_DIR/proxy)");
ABSL_FLAG(bool, via_proxy, false, "one target, a proxy hashing on x-latentd-route (deploy/nginx)");
ABSL_FLAG(int, runners, 1, "concurrent model runners (R), one ShardedClient each");
ABSL_FLAG(int, batch, 64, "sequences per runner (B): one DecodeBatch of B steps per layer");
ABSL_FLAG(int, layers, 4, "layers per token (L; at most the servers' num_layers)");
ABSL_FLAG(int, prefix_len, 4096, "prefix tokens uploaded per sequence and layer");
ABSL_FLAG(double, duration_s, 30, "measured time");
ABSL_FLAG(int, check_every, 50, "check every Nth OK result against the CPU implementation (0: none)");
ABSL_FLAG(double, batch_timeout_s, 10, "deadline of one DecodeBatch: a lost daemon's steps fail UNAVAILABLE within it");
ABSL_FLAG(double, after_unavailable_s, -1,
          "stop this long after the first UNAVAILABLE result (a daemon lost mid-run), if before --duration_s "
          "(negative: run the whole --duration_s)");
ABSL_FLAG(std::string, auth_token, "", "bearer token");
ABSL_FLAG(uint64_t, seed, 1, "random seed");

namespace latentd::tools {
namespace {

struct RunnerStats {
  std::vector<double> layer_us;
  uint64_t ok = 0, unavailable = 0, other = 0, layers = 0;
  double slowest_failing_layer_us = 0;  // the longest layer that had an UNAVAILABLE step
  std::map<int, uint64_t> ok_per_target;
  std::string first_other;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

absl::StatusOr<std::vector<std::string>> Targets() {
  std::vector<std::string> out;
  if (!absl::GetFlag(FLAGS_targets_file).empty()) {
    std::ifstream in(absl::GetFlag(FLAGS_targets_file));
    if (!in) return absl::NotFoundError("--targets_file: cannot open " + absl::GetFlag(FLAGS_targets_file));
    for (std::string line; std::getline(in, line);) {
      absl::string_view t = absl::StripAsciiWhitespace(line);
      if (!t.empty()) out.emplace_back(t);
    }
  } else {
    for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_targets), ',', absl::SkipWhitespace()))
      out.emplace_back(absl::StripAsciiWhitespace(t));
  }
  if (out.empty()) return absl::InvalidArgumentError("--targets or --targets_file: expected at least one host:port");
  if (absl::GetFlag(FLAGS_via_proxy) && out.size() != 1)
    return absl::InvalidArgumentError("--via_proxy: expected exactly one target, the proxy");
  return out;
}

int Main() {
  auto targets = Targets();
  if (!targets.ok()) {
    std::fprintf(stderr, "sharded_bench: %s\n", targets.status().ToString().c_str());
    return 2;
  }
  client::ShardedClientOptions so;
  so.targets = *targets;
  so.via_proxy = absl::GetFlag(FLAGS_via_proxy);
  so.client.auth_token = absl::GetFlag(FLAGS_auth_token);
  so.batch_timeout = absl::Seconds(absl::GetFlag(FLAGS_batch_timeout_s));
  auto connected = client::ShardedClient::Connect(so);
  if (!connected.ok()) {
    std::fprintf(stderr, "sharded_bench: %s\n", connected.status().ToString().c_str());
    return 2;
  }
  std::unique_ptr<client::ShardedClient> setup_client = std::move(*connected);
  const v1::ServerInfo info = setup_client->info();
  const client::Shape shape = setup_client->shape();
  const kernels::DType dtype = client::DTypeOf(info);
  const int R = std::max(1, absl::GetFlag(FLAGS_runners));
  const int B = std::max(1, absl::GetFlag(FLAGS_batch));
  const int L = std::min(std::max(1, absl::GetFlag(FLAGS_layers)), info.num_layers());
  const int prefix = std::max(0, absl::GetFlag(FLAGS_prefix_len));
  const int check_every = absl::GetFlag(FLAGS_check_every);
  std::printf("sharded_bench: %zu target(s)%s, backend %s, h_q %d h_kv %d; R=%d B=%d L=%d prefix %d\n",
              targets->size(), so.via_proxy ? " (proxy)" : "", info.backend().c_str(), info.num_heads_q(),
              info.num_heads_kv(), R, B, L, prefix);
  std::fflush(stdout);

  client::Reference ref(info, 4);
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  constexpr int kPool = 16;  // random inputs reused across steps (the server cannot tell)
  std::vector<std::string> q_pool, kv_pool;
  for (int i = 0; i < kPool; ++i) {
    q_pool.push_back(client::RandomHalves(rng, static_cast<size_t>(shape.QBytes(1) / 2), dtype));
    kv_pool.push_back(client::RandomHalves(rng, static_cast<size_t>(shape.KvBytes(1) / 2), dtype));
  }
  // Every (sequence, layer) reads its prefix from its own offset into one pool of pages.
  constexpr int kPoolPages = 61;
  const size_t page_bytes = static_cast<size_t>(shape.KvBytes(64)), prefix_bytes = static_cast<size_t>(shape.KvBytes(prefix));
  const std::string page_pool = client::RandomHalves(rng, page_bytes * kPoolPages / 2, dtype);
  auto prefix_of = [&](int seq, int layer) {
    std::string rows;
    rows.reserve(prefix_bytes);
    for (int j = 0; rows.size() < prefix_bytes; ++j)
      rows.append(page_pool, static_cast<size_t>((7 * seq + 13 * layer + j) % kPoolPages) * page_bytes,
                  std::min(page_bytes, prefix_bytes - rows.size()));
    return rows;
  };

  std::vector<std::vector<std::string>> ids(R, std::vector<std::string>(B));
  const absl::Time setup_start = absl::Now();
  {
    std::vector<std::thread> threads;
    std::atomic<bool> failed{false};
    for (int r = 0; r < R; ++r)
      threads.emplace_back([&, r] {
        for (int b = 0; b < B && !failed; ++b) {
          auto id = setup_client->CreateSequence();
          std::vector<std::string> rows(static_cast<size_t>(L));
          std::vector<absl::string_view> per_layer(static_cast<size_t>(L));
          for (int l = 0; l < L; ++l) per_layer[l] = rows[l] = prefix_of(r * B + b, l);
          absl::Status st = id.status();
          if (st.ok() && prefix > 0) st = setup_client->AppendKvLayers(*id, per_layer).status();
          if (!st.ok()) {
            std::fprintf(stderr, "sharded_bench: setup: %s\n", st.ToString().c_str());
            failed = true;
            return;
          }
          ids[r][b] = *id;
          for (int l = 0; l < L; ++l) ref.Append(*id, l, rows[l]);
        }
      });
    for (auto& t : threads) t.join();
    if (failed) return 1;
  }
  std::printf("setup: %d sequences x %d layers x %d rows in %.1f s\n", R * B, L, prefix,
              absl::ToDoubleSeconds(absl::Now() - setup_start));
  std::fflush(stdout);

  ResultChecker::Options check_options;
  check_options.max_described = 4;
  ResultChecker checker(ResultChecker::AgainstReference(&ref, 1, true), check_options);
  std::vector<RunnerStats> stats(R);
  const absl::Time start = absl::Now();
  // The window's end, moved earlier by the first UNAVAILABLE result with --after_unavailable_s.
  std::atomic<int64_t> stop_ns{absl::ToUnixNanos(start + absl::Seconds(absl::GetFlag(FLAGS_duration_s)))};
  const double after_unavailable = absl::GetFlag(FLAGS_after_unavailable_s);
  auto running = [&] { return absl::ToUnixNanos(absl::Now()) < stop_ns.load(std::memory_order_relaxed); };
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      RunnerStats& st = stats[r];
      auto own = client::ShardedClient::Connect(so);  // separate runners, separate clients
      if (!own.ok()) {
        st.first_other = own.status().ToString();
        ++st.other;
        return;
      }
      std::vector<bool> live(static_cast<size_t>(B), true);
      std::vector<int> target_of(static_cast<size_t>(B));
      for (int b = 0; b < B; ++b) target_of[b] = (*own)->Locate(ids[r][b]);
      uint64_t n = 0;
      for (int token = 0; running(); ++token)
        for (int l = 0; l < L; ++l) {
          std::vector<v1::DecodeStep> steps;
          std::vector<int> pool_of(static_cast<size_t>(B));
          for (int b = 0; b < B; ++b) {
            if (!live[b]) continue;
            pool_of[b] = (token * 7 + b + l) % kPool;
            v1::DecodeStep& s = steps.emplace_back();
            s.set_request_id(static_cast<uint64_t>(b));
            s.set_sequence_id(ids[r][b]);
            s.set_layer(l);
            s.set_q(q_pool[pool_of[b]]);
            s.set_kv(kv_pool[pool_of[b]]);
            s.set_causal(true);
          }
          if (steps.empty()) return;  // every sequence of this runner was lost
          const absl::Time t0 = absl::Now();
          auto results = (*own)->DecodeBatch(std::move(steps));
          const double us = absl::ToDoubleMicroseconds(absl::Now() - t0);
          st.layer_us.push_back(us);
          ++st.layers;
          if (!results.ok()) {
            ++st.other;
            if (st.first_other.empty()) st.first_other = results.status().ToString();
            continue;
          }
          bool had_unavailable = false;
          for (auto& [b64, res] : *results) {
            const int b = static_cast<int>(b64);
            if (res.code() == 0) {
              ++st.ok;
              ++st.ok_per_target[target_of[b]];
              ref.Append(ids[r][b], l, kv_pool[pool_of[b]]);
              if (check_every > 0 && ++n % static_cast<uint64_t>(check_every) == 0) {
                ResultChecker::Item item;
                item.sequence_id = ids[r][b];
                item.layer = l;
                item.end = ref.Length(ids[r][b], l);
                item.q = q_pool[pool_of[b]];
                item.result = std::move(res);
                checker.Push(std::move(item));
              }
            } else if (res.code() == 14) {  // UNAVAILABLE: the sequence's daemon is lost
              ++st.unavailable;
              had_unavailable = true;
              if (after_unavailable >= 0) {
                const int64_t until = absl::ToUnixNanos(absl::Now() + absl::Seconds(after_unavailable));
                int64_t cur = stop_ns.load();
                while (until < cur && !stop_ns.compare_exchange_weak(cur, until)) {
                }
              }
              live[b] = false;
            } else {
              ++st.other;
              if (st.first_other.empty()) st.first_other = res.message();
              live[b] = false;
            }
          }
          if (had_unavailable) st.slowest_failing_layer_us = std::max(st.slowest_failing_layer_us, us);
        }
    });
  for (auto& t : threads) t.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  checker.Flush();

  RunnerStats all;
  for (const RunnerStats& st : stats) {
    all.layer_us.insert(all.layer_us.end(), st.layer_us.begin(), st.layer_us.end());
    all.ok += st.ok;
    all.unavailable += st.unavailable;
    all.other += st.other;
    all.slowest_failing_layer_us = std::max(all.slowest_failing_layer_us, st.slowest_failing_layer_us);
    for (auto [t, k] : st.ok_per_target) all.ok_per_target[t] += k;
    if (all.first_other.empty()) all.first_other = st.first_other;
  }
  std::printf("layer-steps/s %.0f over %.1f s; per layer p50 %.3f ms, p99 %.3f ms\n", all.ok / seconds, seconds,
              Percentile(all.layer_us, 0.5) / 1e3, Percentile(all.layer_us, 0.99) / 1e3);
  for (auto [t, k] : all.ok_per_target)
    std::printf("  %s: %llu OK results\n", setup_client->target(so.via_proxy ? 0 : t).c_str(),
                static_cast<unsigned long long>(k));
  std::printf("results: %llu OK, %llu UNAVAILABLE (slowest layer with one: %.1f ms), %llu other%s%s\n",
              static_cast<unsigned long long>(all.ok), static_cast<unsigned long long>(all.unavailable),
              all.slowest_failing_layer_us / 1e3, static_cast<unsigned long long>(all.other),
              all.first_other.empty() ? "" : "; first: ", all.first_other.c_str());
  std::printf("checked %llu sampled results, %llu wrong%s%s\n", static_cast<unsigned long long>(checker.checked()),
              static_cast<unsigned long long>(checker.mismatched()), checker.mismatched() ? ":\n  " : "",
              checker.failures().c_str());
  // Success: no wrong result and no failure but UNAVAILABLE (a lost daemon's sequences).
  return checker.mismatched() == 0 && all.other == 0 ? 0 : 1;
}

}  // namespace
}  // namespace latentd::tools

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("latentd scale-out benchmark over a ShardedClient (tools/serving/sharded_bench.cc)");
  absl::ParseCommandLine(argc, argv);
  return latentd::tools::Main();
}
