// latentd load generator: creates sequences with random prefixes (AppendKv), streams
// synthetic decode steps from many concurrent Decode streams for a while, checks a
// sample of results against the CPU implementation, and reports steps/s and latency
// percentiles. Model shape comes from GetInfo.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "clients/cpp/client.h"
#include "clients/cpp/reference.h"
#include "server/lock_order.h"
#include "tools/serving/result_checker.h"
#include "tools/serving/round_trip.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "latentd address");
ABSL_FLAG(int, sequences, 64, "sequences to create (N)");
ABSL_FLAG(int, streams, 64, "concurrent Decode streams (M); sequences are spread over them");
ABSL_FLAG(int, prefix_len, 4096, "prefix tokens uploaded per sequence and layer");
ABSL_FLAG(double, duration_s, 30, "how long to stream decode steps");
ABSL_FLAG(int, layers, 1, "layers to drive per sequence (at most the server's num_layers; 0: all)");
ABSL_FLAG(double, check_fraction, 0.01, "fraction of steps checked against the CPU implementation");
ABSL_FLAG(int, s_q, 1, "query tokens per step");
ABSL_FLAG(bool, causal, true, "causal masking for s_q > 1");
ABSL_FLAG(int, window, 1, "steps in flight per stream (1: each stream waits for its result)");
ABSL_FLAG(int, check_threads, 4, "CPU threads for result checks");
ABSL_FLAG(uint64_t, seed, 1, "random seed");
ABSL_FLAG(std::string, auth_token, "", "bearer token");
ABSL_FLAG(bool, tls, false, "connect with TLS");
ABSL_FLAG(std::string, tls_root_certs, "", "PEM file of trusted roots for --tls (default: system roots)");
ABSL_FLAG(std::string, tls_server_name, "", "name expected in the server certificate");
ABSL_FLAG(int, connections, 8,
          "TCP connections the streams are spread over (each a client of its own, as separate "
          "clients would be)");
ABSL_FLAG(bool, release, true, "release the sequences at the end");
ABSL_FLAG(std::string, client_api, "callback",
          "callback: each stream is a gRPC callback reactor that writes its next step from the read "
          "callback (no load-generator thread in between); sync: a writer and a reader thread per stream "
          "(the blocking API, which costs the load generator more CPU than the daemon)");
ABSL_FLAG(int, trace_every, 0,
          "ask the server for StepTiming on every Nth step of each stream and print where the round trip "
          "goes (0: never)");

namespace latentd::loadgen {
namespace {

using client::Client;
using tools::ResultChecker;
using Clock = std::chrono::steady_clock;

struct Pending {
  Clock::time_point sent;
  int64_t sent_unix_us = 0;  // for traced steps: the clock StepTiming uses
  int seq = 0;
  int layer = 0;
  int64_t end = 0;  // layer length after the step
  int q_index = -1;  // into the q pool when checked, else -1
};

struct Totals {
  std::atomic<uint64_t> ok{0}, failed{0};
  std::mutex mu;
  std::vector<float> latency_us;  // merged at the end
  std::map<int, uint64_t> failures_by_code;
  std::string first_failure;
  latentd::tools::RoundTripBreakdown breakdown;  // traced steps, merged at the end
};

double Percentile(std::vector<float>& v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

// One stream's steps: its sequences in turn, layer after layer, random inputs from the
// pools; records each step as pending (and in the reference, which checks need).
struct StepMaker {
  int t = 0;  // the stream's index
  std::vector<int> mine;  // its sequences
  std::vector<std::vector<int64_t>> length;
  std::mt19937_64 rng;
  std::uniform_real_distribution<double> coin{0, 1};
  uint64_t counter = 0;
  size_t next = 0;
  int layers = 1, s_q = 1, trace_every = 0;
  double check_fraction = 0;
  const std::vector<std::string>* ids = nullptr;
  const std::vector<std::string>* q_pool = nullptr;
  const std::vector<std::string>* kv_pool = nullptr;
  client::Reference* ref = nullptr;

  // Fills `step` with the next step and returns its pending record.
  Pending Make(v1::DecodeStep* step, uint64_t* id) {
    const size_t k = next % mine.size();
    const int layer = static_cast<int>((next / mine.size()) % layers);
    ++next;
    const int pool_index = static_cast<int>(rng() % q_pool->size());
    const bool check = ref != nullptr && coin(rng) < check_fraction;
    *id = (uint64_t(t) << 40) | counter++;
    step->set_request_id(*id);
    step->set_sequence_id((*ids)[mine[k]]);
    step->set_layer(layer);
    step->set_q((*q_pool)[pool_index]);
    step->set_kv((*kv_pool)[pool_index]);
    if (ref != nullptr) ref->Append((*ids)[mine[k]], layer, (*kv_pool)[pool_index]);
    length[k][layer] += s_q;
    const bool trace = trace_every > 0 && counter % trace_every == 0;
    step->set_trace(trace);
    return Pending{Clock::now(), trace ? absl::ToUnixMicros(absl::Now()) : 0, mine[k], layer, length[k][layer],
                   check ? pool_index : -1};
  }
};

// A stream's results: latency, trace and checks, as both client APIs record them.
struct StreamResults {
  // Where a checked step's sequence id and q are (the maker's), and the checker (null
  // when nothing is checked).
  const std::vector<std::string>* ids = nullptr;
  const std::vector<std::string>* q_pool = nullptr;
  ResultChecker* checker = nullptr;
  std::vector<float> lat;
  latentd::tools::RoundTripBreakdown traced;

  void Add(const v1::StepResult& r, const Pending& p, Clock::time_point now, Totals* totals) {
    if (r.code() != 0) {
      ++totals->failed;
      std::lock_guard<std::mutex> l(totals->mu);
      ++totals->failures_by_code[r.code()];
      if (totals->first_failure.empty()) totals->first_failure = r.message();
      return;
    }
    ++totals->ok;
    lat.push_back(std::chrono::duration<float, std::micro>(now - p.sent).count());
    if (r.has_timing()) traced.Add(p.sent_unix_us, r.timing(), absl::ToUnixMicros(absl::Now()));
    if (p.q_index >= 0) checker->Push({(*ids)[p.seq], p.layer, p.end, (*q_pool)[p.q_index], r});
  }
  void MergeInto(Totals* totals) {
    std::lock_guard<std::mutex> l(totals->mu);
    totals->latency_us.insert(totals->latency_us.end(), lat.begin(), lat.end());
    totals->breakdown.Merge(traced);
  }
};

// One Decode stream on gRPC's callback API: a result's read callback writes the stream's
// next step itself, so no thread of the load generator wakes between a result and the
// next step. At most one write is outstanding; up to `window` steps are in flight.
class CallbackStream final : public grpc::ClientBidiReactor<v1::DecodeRequest, v1::DecodeResponse> {
 public:
  CallbackStream(Client* conn, StepMaker maker, int window, bool causal, const std::atomic<bool>* stop,
                 Totals* totals, ResultChecker* checker)
      : maker_(std::move(maker)),
        window_(window),
        stop_(stop),
        totals_(totals),
        results_{maker_.ids, maker_.q_pool, checker, {}, {}} {
    req_.add_steps()->set_causal(causal);
    conn->Prepare(&ctx_);
    conn->stub()->async()->Decode(&ctx_, this);
    StartRead(&resp_);
    TryWrite();
    StartCall();
  }
  // Blocks until the stream has ended; merges its figures into the totals.
  void Wait() {
    std::unique_lock<std::mutex> l(mu_);
    done_cv_.wait(l, [&] { return done_; });
    if (!status_.ok()) {
      std::lock_guard<std::mutex> t(totals_->mu);
      if (totals_->first_failure.empty()) totals_->first_failure = "stream: " + status_.error_message();
      totals_->failed += pending_.size();
    }
    results_.MergeInto(totals_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream is over; OnDone follows
    const Clock::time_point now = Clock::now();
    {
      // One lock pass for the response (results_ too: the waiting thread reads it, and
      // gRPC's hand-offs between callbacks are invisible to TSan).
      std::lock_guard<std::mutex> l(mu_);
      for (const v1::StepResult& r : resp_.results()) {
        auto it = pending_.find(r.request_id());
        if (it == pending_.end()) continue;
        const Pending p = it->second;
        pending_.erase(it);
        results_.Add(r, p, now, totals_);
      }
    }
    TryWrite();
    StartRead(&resp_);
  }
  void OnWriteDone(bool ok) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      writing_ = false;
      if (!ok) broken_ = true;  // the stream failed: reads end it
    }
    TryWrite();
  }
  void OnDone(const grpc::Status& status) override {
    std::lock_guard<std::mutex> l(mu_);
    status_ = status;
    done_ = true;
    done_cv_.notify_all();
  }

 private:
  // Writes the next step while the window has room, or half-closes once stopped and
  // every step is answered. Called from the constructor and the callbacks.
  void TryWrite() {
    enum { kNothing, kWrite, kWritesDone } act = kNothing;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (writing_ || closed_ || broken_) return;
      if (stop_->load(std::memory_order_relaxed)) {
        if (pending_.empty()) {
          closed_ = true;
          act = kWritesDone;
        }
      } else if (pending_.size() < static_cast<size_t>(window_)) {
        uint64_t id = 0;
        Pending p = maker_.Make(req_.mutable_steps(0), &id);
        pending_[id] = p;
        writing_ = true;
        act = kWrite;
      }
    }
    if (act == kWrite) StartWrite(&req_);
    if (act == kWritesDone) StartWritesDone();
  }

  grpc::ClientContext ctx_;
  StepMaker maker_;  // under mu_
  const int window_;
  const std::atomic<bool>* const stop_;
  Totals* const totals_;
  v1::DecodeRequest req_;    // the write in flight (one at a time)
  v1::DecodeResponse resp_;  // the read in flight
  StreamResults results_;    // under mu_
  std::mutex mu_;
  std::condition_variable done_cv_;
  std::unordered_map<uint64_t, Pending> pending_;
  bool writing_ = false, closed_ = false, broken_ = false, done_ = false;
  grpc::Status status_;
};

int Main() {
  client::ClientOptions co;
  co.target = absl::GetFlag(FLAGS_target);
  co.auth_token = absl::GetFlag(FLAGS_auth_token);
  co.tls = absl::GetFlag(FLAGS_tls);
  if (const std::string roots = absl::GetFlag(FLAGS_tls_root_certs); !roots.empty()) {
    std::ifstream f(roots);
    std::stringstream ss;
    ss << f.rdbuf();
    co.tls_root_certs_pem = ss.str();
  }
  co.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  auto connected = Client::Connect(co);
  if (!connected.ok()) {
    std::fprintf(stderr, "loadgen: %s\n", connected.status().ToString().c_str());
    return 2;
  }
  std::unique_ptr<Client> c = std::move(*connected);
  // Stream t uses conns[t % n]; conns[0] is c, which also sets up and releases.
  std::vector<std::unique_ptr<Client>> extra;
  std::vector<Client*> conns = {c.get()};
  for (int i = 1; i < std::max(1, absl::GetFlag(FLAGS_connections)); ++i) {
    auto more = Client::Connect(co);
    if (!more.ok()) {
      std::fprintf(stderr, "loadgen: %s\n", more.status().ToString().c_str());
      return 2;
    }
    extra.push_back(std::move(*more));
    conns.push_back(extra.back().get());
  }
  const v1::ServerInfo info = c->info();
  const client::Shape shape = c->shape();
  const kernels::DType dtype = client::DTypeOf(info);
  const int n_seq = absl::GetFlag(FLAGS_sequences);
  const int n_streams = std::max(1, std::min(absl::GetFlag(FLAGS_streams), n_seq));
  const int prefix = absl::GetFlag(FLAGS_prefix_len);
  int layers = absl::GetFlag(FLAGS_layers);
  if (layers <= 0 || layers > info.num_layers()) layers = info.num_layers();
  const int s_q = absl::GetFlag(FLAGS_s_q);
  const bool causal = absl::GetFlag(FLAGS_causal);
  const int window = std::max(1, absl::GetFlag(FLAGS_window));
  const int trace_every = std::max(0, absl::GetFlag(FLAGS_trace_every));
  const double check_fraction = absl::GetFlag(FLAGS_check_fraction);
  const absl::Duration duration = absl::Seconds(absl::GetFlag(FLAGS_duration_s));
  if (n_seq < 1 || prefix < 0 || s_q < 1 || s_q > std::max(1, info.max_s_q())) {
    std::fprintf(stderr, "loadgen: need --sequences >= 1, --prefix_len >= 0, 1 <= --s_q <= %d\n", info.max_s_q());
    return 2;
  }
  // The KV dtype says which cache a run measured (and what the checks dequantize).
  std::printf("loadgen: %s backend %s, layers %d h_q %d h_kv %d %s, kv %s (%ld bytes/token), pool %ld pages (%ld free)\n",
              co.target.c_str(), info.backend().c_str(), info.num_layers(), info.num_heads_q(),
              info.num_heads_kv(), dtype == kernels::DType::kBF16 ? "bf16" : "fp16",
              info.kv_dtype().empty() ? "model dtype" : info.kv_dtype().c_str(),
              static_cast<long>(info.kv_bytes_per_token()), static_cast<long>(info.total_pages()),
              static_cast<long>(info.free_pages()));
  std::fflush(stdout);

  std::unique_ptr<client::Reference> ref;
  if (check_fraction > 0) ref = std::make_unique<client::Reference>(info, absl::GetFlag(FLAGS_check_threads));
  const bool tty = isatty(STDERR_FILENO);

  // Setup: sequences and prefixes, uploaded from n_streams threads.
  std::vector<std::string> ids(n_seq);
  std::atomic<int> uploaded{0};
  std::atomic<bool> setup_failed{false};
  std::string setup_error;
  std::mutex setup_mu;
  const absl::Time setup_start = absl::Now();
  {
    std::vector<std::thread> threads;
    for (int t = 0; t < n_streams; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(absl::GetFlag(FLAGS_seed) * 7919 + t);
        for (int i = t; i < n_seq && !setup_failed; i += n_streams) {
          auto id = c->CreateSequence();
          absl::Status st = id.status();
          if (st.ok()) {
            ids[i] = *id;
            std::vector<std::string> rows(layers);
            std::vector<absl::string_view> views(layers);
            for (int l = 0; l < layers; ++l) {
              rows[l] = client::RandomHalves(rng, static_cast<size_t>(prefix) * shape.h_kv * 576, dtype);
              views[l] = rows[l];
              if (ref) ref->Append(ids[i], l, rows[l]);
            }
            if (prefix > 0) st = c->AppendKvLayers(ids[i], views).status();
          }
          if (!st.ok()) {
            std::lock_guard<std::mutex> l(setup_mu);
            setup_error = st.ToString();
            setup_failed = true;
          }
          ++uploaded;
        }
      });
    }
    absl::Time shown = absl::InfinitePast();
    while (uploaded.load() < n_seq && !setup_failed) {
      if (absl::Now() - shown > (tty ? absl::Milliseconds(200) : absl::Seconds(5))) {
        shown = absl::Now();
        std::fprintf(stderr, "%ssetup: %d/%d sequences with %d-token prefixes%s", tty ? "\r" : "", uploaded.load(),
                     n_seq, prefix, tty ? "" : "\n");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    for (auto& t : threads) t.join();
  }
  if (setup_failed) {
    std::fprintf(stderr, "\nloadgen: setup failed: %s\n", setup_error.c_str());
    return 1;
  }
  std::fprintf(stderr, "%ssetup: %d sequences x %d layer(s) x %d tokens in %.1f s\n", tty ? "\r" : "", n_seq, layers,
               prefix, absl::ToDoubleSeconds(absl::Now() - setup_start));

  // Pools of random q and kv inputs, reused by every step (checked steps record which).
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  constexpr int kPool = 64;
  std::vector<std::string> q_pool(kPool), kv_pool(kPool);
  for (int i = 0; i < kPool; ++i) {
    q_pool[i] = client::RandomHalves(rng, static_cast<size_t>(shape.QBytes(s_q) / 2), dtype);
    kv_pool[i] = client::RandomHalves(rng, static_cast<size_t>(shape.KvBytes(s_q) / 2), dtype);
  }

  Totals totals;
  // A checker far behind drops what is sampled (counted as skipped) rather than queue it.
  std::unique_ptr<ResultChecker> checker;
  if (ref) {
    ResultChecker::Options options;
    options.max_queue = 256;
    options.max_described = 1;
    checker = std::make_unique<ResultChecker>(ResultChecker::AgainstReference(ref.get(), s_q, causal), options);
  }
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> sent_total{0};
  const absl::Time start = absl::Now();
  const bool callback_api = absl::GetFlag(FLAGS_client_api) != "sync";
  auto maker_for = [&](int t) {
    StepMaker m;
    m.t = t;
    for (int i = t; i < n_seq; i += n_streams) m.mine.push_back(i);
    m.length.assign(m.mine.size(), std::vector<int64_t>(layers, prefix));
    m.rng.seed(absl::GetFlag(FLAGS_seed) * 104729 + t);
    m.layers = layers;
    m.s_q = s_q;
    m.trace_every = trace_every;
    m.check_fraction = check_fraction;
    m.ids = &ids;
    m.q_pool = &q_pool;
    m.kv_pool = &kv_pool;
    m.ref = ref.get();
    return m;
  };
  std::vector<std::unique_ptr<CallbackStream>> reactors;
  std::vector<std::thread> workers;
  for (int t = 0; t < n_streams; ++t) {
    if (callback_api) {
      reactors.push_back(std::make_unique<CallbackStream>(conns[t % conns.size()], maker_for(t), window, causal,
                                                          &stop, &totals, checker.get()));
      continue;
    }
    workers.emplace_back([&, t] {
      StepMaker maker = maker_for(t);
      std::mutex mu;
      std::condition_variable cv;
      std::unordered_map<uint64_t, Pending> pending;
      StreamResults results{maker.ids, maker.q_pool, checker.get(), {}, {}};
      auto stream = conns[t % conns.size()]->OpenDecodeStream();
      std::thread reader([&] {
        v1::DecodeResponse resp;
        while (stream->Read(&resp)) {
          const Clock::time_point now = Clock::now();
          for (const v1::StepResult& r : resp.results()) {
            Pending p;
            {
              std::lock_guard<std::mutex> l(mu);
              auto it = pending.find(r.request_id());
              if (it == pending.end()) continue;
              p = it->second;
              pending.erase(it);
            }
            cv.notify_one();
            results.Add(r, p, now, &totals);
          }
        }
      });
      v1::DecodeRequest req;
      v1::DecodeStep* step = req.add_steps();
      step->set_causal(causal);
      while (!stop.load(std::memory_order_relaxed)) {
        {
          std::unique_lock<std::mutex> l(mu);
          cv.wait(l, [&] { return pending.size() < static_cast<size_t>(window) || stop.load(); });
          if (stop) break;
        }
        uint64_t id = 0;
        Pending p = maker.Make(step, &id);
        {
          std::lock_guard<std::mutex> l(mu);
          pending[id] = p;
        }
        if (!stream->Write(req)) break;
        ++sent_total;
      }
      stream->WritesDone();
      reader.join();
      grpc::Status st = stream->Finish();
      if (!st.ok()) {
        std::lock_guard<std::mutex> l(totals.mu);
        if (totals.first_failure.empty()) totals.first_failure = "stream: " + st.error_message();
        totals.failed += pending.size();
      }
      results.MergeInto(&totals);
    });
  }

  auto checked = [&]() -> uint64_t { return checker ? checker->checked() : 0; };
  auto mismatched = [&]() -> uint64_t { return checker ? checker->mismatched() : 0; };
  uint64_t last_ok = 0;
  absl::Time last = start;
  while (absl::Now() - start < duration) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const absl::Time now = absl::Now();
    if (now - last < (tty ? absl::Milliseconds(500) : absl::Seconds(5))) continue;
    const uint64_t ok = totals.ok.load();
    std::fprintf(stderr, "%s[%5.1f/%.0f s] %lu steps, %.0f steps/s now, %lu failed, %lu checked (%lu bad)   %s",
                 tty ? "\r" : "", absl::ToDoubleSeconds(now - start), absl::ToDoubleSeconds(duration),
                 static_cast<unsigned long>(ok), (ok - last_ok) / std::max(1e-9, absl::ToDoubleSeconds(now - last)),
                 static_cast<unsigned long>(totals.failed.load()), static_cast<unsigned long>(checked()),
                 static_cast<unsigned long>(mismatched()), tty ? "" : "\n");
    last_ok = ok;
    last = now;
  }
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  const uint64_t ok_at_stop = totals.ok.load();
  stop = true;
  for (auto& w : workers) w.join();
  for (auto& r : reactors) r->Wait();
  if (checker) {
    checker->Flush();  // the queued checks
    // A failed step or stream is the first problem; else the first mismatch.
    if (totals.first_failure.empty()) totals.first_failure = checker->failures();
  }
  if (tty) std::fprintf(stderr, "\n");

  if (absl::GetFlag(FLAGS_release)) {
    for (const std::string& id : ids) (void)c->ReleaseSequence(id);
  }
  std::vector<float>& lat = totals.latency_us;
  const double p50 = Percentile(lat, 0.50) / 1000, p90 = Percentile(lat, 0.90) / 1000,
               p99 = Percentile(lat, 0.99) / 1000;
  const double max = lat.empty() ? 0 : *std::max_element(lat.begin(), lat.end()) / 1000;
  std::printf("loadgen: %d streams over %zu connections (%s API), %d sequences x %d-token prefixes, %d layer(s), s_q %d%s, window %d, %.1f s\n",
              n_streams, conns.size(), callback_api ? "callback" : "sync", n_seq, prefix, layers, s_q,
              s_q > 1 && causal ? " causal" : "", window, elapsed);
  std::printf("steps: %lu ok, %lu failed; %.1f steps/s\n", static_cast<unsigned long>(totals.ok.load()),
              static_cast<unsigned long>(totals.failed.load()), ok_at_stop / elapsed);
  std::printf("latency ms: p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n", p50, p90, p99, max);
  totals.breakdown.Print(stdout);
  std::printf("checked %lu steps against the CPU implementation: %lu ok, %lu mismatched (%lu sampled but skipped: "
              "checker behind)\n",
              static_cast<unsigned long>(checked()), static_cast<unsigned long>(checked() - mismatched()),
              static_cast<unsigned long>(mismatched()),
              static_cast<unsigned long>(checker ? checker->skipped() : 0));
  for (const auto& [code, n] : totals.failures_by_code) {
    std::printf("failed with code %d: %lu\n", code, static_cast<unsigned long>(n));
  }
  if (!totals.first_failure.empty()) std::printf("first problem: %s\n", totals.first_failure.c_str());
  return mismatched() == 0 && totals.failed.load() == 0 && totals.ok.load() > 0 ? 0 : 1;
}

}  // namespace
}  // namespace latentd::loadgen

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("latentd load generator: decode steps from many streams, steps/s and latency.");
  absl::ParseCommandLine(argc, argv);
  latentd::server::SetLockOrderChecks(false);  // server/lock_order.h: a global lock per Mutex::Lock otherwise
  return latentd::loadgen::Main();
}
