// latentd model-runner benchmark: R runners, each with B sequences over a prefix, step
// L layers per token the way an attention-disaggregated model runner does: one
// DecodeRequest of B steps per layer, wait for all B results, a barrier across runners,
// next layer. Reports the per-layer round trip (p50/p90/p99), layer-steps/s, responses
// per layer, and from the server's StepTiming where the round trip goes.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "clients/cpp/client.h"
#include "clients/cpp/reference.h"
#include "server/lock_order.h"
#include "proto/ring.h"
#include "tools/serving/device_region.h"
#include "tools/serving/result_checker.h"
#include "tools/serving/round_trip.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "latentd address");
ABSL_FLAG(int, runners, 1, "concurrent model runners (R), one Decode stream each");
ABSL_FLAG(int, batch, 64, "steps per message: sequences per runner (B)");
ABSL_FLAG(int, layers, 4, "layers per token (L; at most the server's num_layers)");
ABSL_FLAG(int, prefix_len, 4096, "prefix tokens uploaded per sequence and layer");
ABSL_FLAG(int, tokens, 50, "measured tokens (each is L layer round trips per runner)");
ABSL_FLAG(int, warmup_tokens, 5, "tokens run before measuring");
ABSL_FLAG(int, s_q, 1, "query tokens per step");
ABSL_FLAG(bool, causal, true, "causal masking for s_q > 1");
ABSL_FLAG(int, check_every, 50, "check every Nth result against the CPU implementation (0: none)");
ABSL_FLAG(int, messages_per_layer, 1,
          "DecodeRequests each layer's B steps are split into, sent back to back (1: one message per layer); "
          "more let the server work on the first while the rest cross the wire");
ABSL_FLAG(bool, trace, true, "ask the server for StepTiming and print the breakdown");
ABSL_FLAG(bool, shm, false,
          "same-host data plane: each runner's stream opens a shared region; q/kv are written there and "
          "out/lse read from there, and messages carry offsets only");
ABSL_FLAG(bool, ring, false,
          "with the shared region: steps go through the region's doorbell ring (DecodeRequest.region_ring_entries) "
          "and results come back on its completion queue, with no gRPC message per layer; with --cuda_region "
          "the ring is a host file of its own beside the device region");
ABSL_FLAG(int, ring_spin_us, 1000, "--ring: how long the runner spins on its completion queue before sleeping");
ABSL_FLAG(bool, cuda_region, false,
          "same-host data plane on the GPU: each runner's q/kv/out/lse live in a device allocation of its "
          "own, offered to its stream through CUDA IPC (open_cuda_region); each layer's inputs are copied "
          "there on the device from a pool, and messages carry offsets only");
ABSL_FLAG(int, cuda_device, 0,
          "--cuda_region: the CUDA device the runner's region lives on (the daemon's --device may differ: "
          "it then reads and writes the region over peer access)");
ABSL_FLAG(bool, layer_api, false,
          "the layer API: steps carry hidden states [s_q, hidden_size] and get the layer's output back (the "
          "daemon needs --model_dir with weights); prefixes are still uploaded as latent rows. Results are not "
          "checked (tests/integration/layer_api_test checks them against a float64 reference)");
ABSL_FLAG(std::string, auth_token, "", "bearer token");
ABSL_FLAG(uint64_t, seed, 1, "random seed");
ABSL_FLAG(int, prefix_pool_pages, 61,
          "prefixes are made of pages drawn from this many random pages, each sequence and layer "
          "starting at a page of its own, so a read of another sequence's page or of a stale one "
          "shows in the checks (0: one prefix shared by every sequence and layer)");

namespace latentd::runner_bench {
namespace {

using client::Client;
using tools::ResultChecker;

int64_t NowUs() { return absl::ToUnixMicros(absl::Now()); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait() {
    std::unique_lock<std::mutex> l(mu_);
    const uint64_t gen = gen_;
    if (++waiting_ == n_) {
      waiting_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(l, [&] { return gen_ != gen; });
  }

 private:
  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int waiting_ = 0;
  uint64_t gen_ = 0;
};

struct RunnerStats {
  std::vector<double> layer_us;
  absl::Time end;  // after the runner's last layer, before its stream and sequences are torn down
  tools::RoundTripBreakdown breakdown;
  uint64_t responses = 0, layers = 0, failed = 0;
  std::string first_error;
};

int Main() {
  client::ClientOptions co;
  co.target = absl::GetFlag(FLAGS_target);
  co.auth_token = absl::GetFlag(FLAGS_auth_token);
  auto connected = Client::Connect(co);
  if (!connected.ok()) {
    std::fprintf(stderr, "runner_bench: %s\n", connected.status().ToString().c_str());
    return 2;
  }
  std::unique_ptr<Client> c = std::move(*connected);
  const v1::ServerInfo info = c->info();
  const client::Shape shape = c->shape();
  const kernels::DType dtype = client::DTypeOf(info);
  const int R = std::max(1, absl::GetFlag(FLAGS_runners));
  const int B = std::max(1, absl::GetFlag(FLAGS_batch));
  const int L = std::min(std::max(1, absl::GetFlag(FLAGS_layers)), info.num_layers());
  const int prefix = absl::GetFlag(FLAGS_prefix_len);
  const int tokens = absl::GetFlag(FLAGS_tokens), warmup = absl::GetFlag(FLAGS_warmup_tokens);
  const int s_q = absl::GetFlag(FLAGS_s_q);
  const bool causal = absl::GetFlag(FLAGS_causal);
  const bool layer_api = absl::GetFlag(FLAGS_layer_api);
  const int check_every = layer_api ? 0 : absl::GetFlag(FLAGS_check_every);
  const bool trace = absl::GetFlag(FLAGS_trace);
  const bool cuda_region = absl::GetFlag(FLAGS_cuda_region);
  const bool use_ring = absl::GetFlag(FLAGS_ring);
  const bool shm = absl::GetFlag(FLAGS_shm) || cuda_region || use_ring;  // offsets, not bytes, either way
  if (layer_api && (!info.layer_api() || cuda_region)) {
    std::fprintf(stderr, "runner_bench: --layer_api needs a daemon serving the layer API (ServerInfo.layer_api), "
                         "and a host region (not --cuda_region)\n");
    return 2;
  }
  // A layer step's input and output per token: its hidden state either way.
  const int64_t hidden_bytes = int64_t{info.hidden_size()} * 2 * s_q;
  if (s_q < 1 || s_q > std::max(1, info.max_s_q()) || prefix < 0 || tokens < 1) {
    std::fprintf(stderr, "runner_bench: need 1 <= --s_q <= %d, --prefix_len >= 0, --tokens >= 1\n", info.max_s_q());
    return 2;
  }
  std::printf("runner_bench: %s backend %s, h_q %d h_kv %d %s, kv %s; R=%d B=%d L=%d s_q=%d prefix %d, %d tokens, %d message(s) per layer%s\n",
              co.target.c_str(), info.backend().c_str(), info.num_heads_q(), info.num_heads_kv(),
              dtype == kernels::DType::kBF16 ? "bf16" : "fp16",
              info.kv_dtype().empty() ? "model dtype" : info.kv_dtype().c_str(), R, B, L, s_q, prefix, tokens,
              std::clamp(absl::GetFlag(FLAGS_messages_per_layer), 1, B), cuda_region ? (use_ring ? ", CUDA region with doorbell ring" : ", CUDA region") : use_ring ? ", shared region with doorbell ring" : shm ? ", shared region" : "");
  std::fflush(stdout);

  client::Reference ref(info, 4);
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  // Pools of random inputs, reused across steps (the server cannot tell).
  constexpr int kPool = 16;
  std::vector<std::string> q_pool, kv_pool;
  if (layer_api) {
    std::printf("layer API: hidden_size %d, tensor rank %d of %d; per layer %.1f KB in + %.1f KB out per step "
                "(kernel-level: %.1f KB + %.1f KB)\n",
                info.hidden_size(), info.tensor_rank(), std::max(1, info.tensor_parallel()), hidden_bytes / 1e3,
                hidden_bytes / 1e3, (shape.QBytes(s_q) + shape.KvBytes(s_q)) / 1e3,
                (shape.OutBytes(s_q) + shape.LseBytes(s_q)) / 1e3);
  }
  for (int i = 0; i < kPool; ++i) {
    // With --layer_api the q pool holds hidden states (random values of unit scale).
    q_pool.push_back(client::RandomHalves(
        rng, static_cast<size_t>((layer_api ? hidden_bytes : shape.QBytes(s_q)) / 2), dtype));
    kv_pool.push_back(client::RandomHalves(rng, static_cast<size_t>(shape.KvBytes(s_q) / 2), dtype));
  }

  // Setup: R * B sequences, each with `prefix` rows on every driven layer.
  std::vector<std::vector<std::string>> ids(R, std::vector<std::string>(B));
  // Prefix rows: one page pool, each (sequence, layer) reading it from a page of its own
  // (or, with --prefix_pool_pages=0, every one the same pages in the same order).
  const int rotate = std::max(0, absl::GetFlag(FLAGS_prefix_pool_pages));
  const int pool_pages = rotate > 0 ? rotate : std::max(1, (prefix + 63) / 64);
  const size_t page_bytes = static_cast<size_t>(shape.KvBytes(64)), prefix_bytes = static_cast<size_t>(shape.KvBytes(prefix));
  const std::string page_pool = client::RandomHalves(rng, page_bytes * pool_pages / 2, dtype);
  auto prefix_of = [&](int seq, int layer) {
    std::string rows;
    rows.reserve(prefix_bytes);
    const int first = rotate > 0 ? 7 * seq + 13 * layer : 0;
    for (int j = 0; rows.size() < prefix_bytes; ++j)
      rows.append(page_pool, static_cast<size_t>((first + j) % pool_pages) * page_bytes,
                  std::min(page_bytes, prefix_bytes - rows.size()));
    return rows;
  };
  const absl::Time setup_start = absl::Now();
  {
    std::vector<std::thread> threads;
    std::atomic<bool> failed{false};
    for (int r = 0; r < R; ++r)
      threads.emplace_back([&, r] {
        for (int b = 0; b < B && !failed; ++b) {
          auto id = c->CreateSequence();
          if (!id.ok()) {
            std::fprintf(stderr, "runner_bench: CreateSequence: %s\n", id.status().ToString().c_str());
            failed = true;
            return;
          }
          ids[r][b] = *id;
          std::vector<std::string> rows(static_cast<size_t>(L));
          std::vector<absl::string_view> per_layer(static_cast<size_t>(L));
          for (int l = 0; l < L; ++l) per_layer[l] = rows[l] = prefix_of(r * B + b, l);
          if (prefix > 0) {
            auto up = c->AppendKvLayers(*id, per_layer);
            if (!up.ok()) {
              std::fprintf(stderr, "runner_bench: AppendKv: %s\n", up.status().ToString().c_str());
              failed = true;
              return;
            }
          }
          for (int l = 0; l < L; ++l) ref.Append(*id, l, rows[l]);
        }
      });
    for (auto& t : threads) t.join();
    if (failed) return 1;
  }
  std::printf("setup: %d sequences x %d layers x %d rows in %.1f s\n", R * B, L, prefix,
              absl::ToDoubleSeconds(absl::Now() - setup_start));
  std::fflush(stdout);

  // Every sampled result is checked (none dropped), and the first four mismatches are
  // described.
  ResultChecker::Options check_options;
  check_options.max_queue = 0;
  check_options.max_described = 4;
  ResultChecker checker(ResultChecker::AgainstReference(&ref, s_q, causal), check_options);
  Barrier barrier(R);
  std::vector<RunnerStats> stats(R);
  std::atomic<uint64_t> result_counter{0};
  absl::Time measure_start;
  std::mutex measure_mu;
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      RunnerStats& st = stats[r];
      // Each runner is a client of its own, on its own connection, as separate model
      // runners are.
      auto own = Client::Connect(co);
      if (!own.ok()) {
        std::fprintf(stderr, "runner_bench: runner %d: %s\n", r, own.status().ToString().c_str());
        std::exit(2);
      }
      std::unique_ptr<Client> mine = std::move(*own);
      auto stream = mine->OpenDecodeStream();
      // Region layout: step b's q, kv, out and lse in slot b.
      // --ring: the ring takes the region's first bytes; slots follow.
      uint32_t ring_entries = 1;
      while (ring_entries < static_cast<uint32_t>(B)) ring_entries *= 2;
      // (A CUDA region's ring is a host file of its own.)
      const uint64_t ring_at = use_ring && !cuda_region ? ring::RingBytes(ring_entries) : 0;
      // --layer_api: [hidden | out], both [s_q, hidden_size].
      const uint64_t q_at = ring_at, kv_at = q_at + (layer_api ? hidden_bytes : shape.QBytes(s_q)),
                     out_at = layer_api ? kv_at : kv_at + shape.KvBytes(s_q),
                     lse_at = out_at + (layer_api ? hidden_bytes : shape.OutBytes(s_q)),
                     slot = (lse_at - ring_at + (layer_api ? 0 : shape.LseBytes(s_q)) + 255) / 256 * 256;
      // --cuda_region lays the region out tensor by tensor: all q, then all kv, out, lse.
      struct {
        uint64_t q, kv, out, lse, bytes;
      } dev;
      dev.q = 0;
      dev.kv = uint64_t(B) * shape.QBytes(s_q);
      dev.out = dev.kv + uint64_t(B) * shape.KvBytes(s_q);
      dev.lse = dev.out + uint64_t(B) * shape.OutBytes(s_q);
      dev.bytes = dev.lse + uint64_t(B) * shape.LseBytes(s_q);
      auto q_off = [&](int b) { return cuda_region ? dev.q + b * shape.QBytes(s_q) : slot * b + q_at; };
      auto kv_off = [&](int b) { return cuda_region ? dev.kv + b * shape.KvBytes(s_q) : slot * b + kv_at; };
      auto out_off = [&](int b) { return cuda_region ? dev.out + b * shape.OutBytes(s_q) : slot * b + out_at; };
      auto lse_off = [&](int b) { return cuda_region ? dev.lse + b * shape.LseBytes(s_q) : slot * b + lse_at; };
      int layer_count = 0;
      std::unique_ptr<client::SharedRegion> region;
      std::unique_ptr<client::Ring> doorbell;  // --ring
      std::vector<client::Ring::Step> ring_steps(static_cast<size_t>(B));
      std::vector<client::Ring::Completion> completions;
      std::unique_ptr<tools::DeviceRegion> device;  // --cuda_region: pool [q_pool, kv_pool]
      bool broken = false;  // the stream failed: keep meeting the barrier, send nothing
      if (cuda_region) {
        // Pool entry p: the q of step b is q_pool[(p + b) % kPool], back to back (entry
        // kPool + p: their kv rows), so a layer's inputs are two device copies, as a
        // model's batched q would be.
        std::vector<std::string> pool(2 * kPool);
        for (int p = 0; p < kPool; ++p)
          for (int b = 0; b < B; ++b) {
            pool[p] += q_pool[(p + b) % kPool];
            pool[kPool + p] += kv_pool[(p + b + 3) % kPool];
          }
        auto made = tools::DeviceRegion::Create(absl::GetFlag(FLAGS_cuda_device), dev.bytes, pool);
        absl::Status opened = made.status();
        if (opened.ok()) {
          device = std::move(*made);
          if (use_ring) {
            auto ring_file = stream->OpenCudaRegionWithRing(device->IpcHandle(), 0, dev.bytes, ring_entries);
            opened = ring_file.status();
            if (opened.ok()) {
              region = std::move(*ring_file);
              doorbell = std::make_unique<client::Ring>(region.get(), ring_entries, absl::GetFlag(FLAGS_ring_spin_us));
            }
          } else {
            opened = stream->OpenCudaRegion(device->IpcHandle(), 0, dev.bytes);
          }
        }
        if (!opened.ok()) {
          st.first_error = opened.ToString();
          st.failed += 1;
          broken = true;
        }
      } else if (shm) {
        auto opened = stream->OpenRegion(ring_at + slot * B, use_ring ? ring_entries : 0);
        if (opened.ok()) {
          region = std::move(*opened);
          if (use_ring) doorbell = std::make_unique<client::Ring>(region.get(), ring_entries, absl::GetFlag(FLAGS_ring_spin_us));
        } else {
          st.first_error = opened.status().ToString();
          st.failed += 1;
          broken = true;
        }
      }
      std::vector<int64_t> length(static_cast<size_t>(B) * L, prefix);
      std::vector<int> q_of(static_cast<size_t>(B));
      uint64_t next_id = 1;
      // Step b goes in message b / per_msg of each layer.
      const int n_msgs = std::clamp(absl::GetFlag(FLAGS_messages_per_layer), 1, B);
      const int per_msg = (B + n_msgs - 1) / n_msgs;
      std::vector<v1::DecodeRequest> reqs(static_cast<size_t>((B + per_msg - 1) / per_msg));
      auto step_of = [&](int b) { return reqs[b / per_msg].mutable_steps(b % per_msg); };
      for (int b = 0; b < B; ++b) {
        v1::DecodeStep* s = reqs[b / per_msg].add_steps();
        s->set_sequence_id(ids[r][b]);
        s->set_causal(causal);
        s->set_trace(trace);
        if (shm && layer_api) {
          v1::RegionTensors* t = s->mutable_region();
          t->set_s_q(s_q);
          t->set_layer_step(true);
          t->set_hidden_offset(q_off(b));
          t->set_out_offset(out_off(b));
        } else if (shm) {
          v1::RegionTensors* t = s->mutable_region();
          t->set_s_q(s_q);
          t->set_q_offset(q_off(b));
          t->set_kv_offset(kv_off(b));
          t->set_out_offset(out_off(b));
          t->set_lse_offset(lse_off(b));
        }
      }
      std::vector<ResultChecker::Item> to_check;  // a layer's sampled results, read back after its time is taken
      std::vector<int> to_check_slot;
      std::vector<int> appended;  // a layer's steps whose kv row the server appended
      to_check.reserve(static_cast<size_t>(B));
      to_check_slot.reserve(static_cast<size_t>(B));
      appended.reserve(static_cast<size_t>(B));
      for (int tok = 0; tok < warmup + tokens; ++tok) {
        if (tok == warmup) {
          barrier.Wait();
          std::lock_guard<std::mutex> l(measure_mu);
          if (measure_start == absl::Time()) measure_start = absl::Now();
        }
        const bool measured = tok >= warmup;
        for (int l = 0; l < L; ++l) {
          if (broken) {
            barrier.Wait();
            continue;
          }
          // Step b of this layer has request id first_id + b.
          const uint64_t first_id = next_id;
          to_check.clear();
          to_check_slot.clear();
          appended.clear();
          for (int b = 0; b < B; ++b) {
            v1::DecodeStep* s = step_of(b);
            const int qi = device != nullptr ? (layer_count + b) % kPool : static_cast<int>((next_id * 7 + b) % kPool);
            q_of[b] = qi;
            s->set_request_id(next_id++);
            s->set_layer(l);
          }
          const int64_t sent = NowUs();
          for (int b = 0; b < B; ++b) {  // producing the inputs is part of the round trip
            const std::string& q = q_pool[q_of[b]];
            const std::string& kv = kv_pool[(q_of[b] + 3) % kPool];
            if (device != nullptr) {
              if (b == 0) {  // the whole batch's q and kv at once
                device->CopyFromPool(dev.q, layer_count % kPool);
                device->CopyFromPool(dev.kv, kPool + layer_count % kPool);
              }
            } else if (shm && region != nullptr) {
              std::memcpy(region->data() + slot * b + q_at, q.data(), q.size());
              if (!layer_api) std::memcpy(region->data() + slot * b + kv_at, kv.data(), kv.size());
            } else if (layer_api) {
              step_of(b)->set_hidden(q);
            } else {
              step_of(b)->set_q(q);
              step_of(b)->set_kv(kv);
            }
          }
          if (device != nullptr && !device->Sync().ok()) {  // the inputs are complete before the send
            st.first_error = "device copies failed";
            st.failed += B;
            broken = true;
            barrier.Wait();
            continue;
          }
          bool written = true;
          if (doorbell != nullptr) {
            for (int b = 0; b < B; ++b) {
              const v1::DecodeStep* s = step_of(b);
              client::Ring::Step& rs = ring_steps[b];
              rs.request_id = s->request_id();
              rs.sequence_id = ids[r][b];
              rs.layer = s->layer();
              rs.s_q = static_cast<uint32_t>(s_q);
              rs.causal = causal;
              rs.trace = trace;
              rs.q_offset = q_off(b);
              rs.kv_offset = kv_off(b);
              rs.out_offset = out_off(b);
              rs.lse_offset = lse_off(b);
              if (layer_api) {
                rs.layer_step = true;
                rs.hidden_offset = q_off(b);
                rs.q_offset = rs.kv_offset = rs.lse_offset = 0;
              }
            }
            for (int m = 0; m < B && written; m += per_msg) {
              absl::Status sub = doorbell->Submit(&ring_steps[m], static_cast<size_t>(std::min(per_msg, B - m)));
              if (!sub.ok()) {
                st.first_error = sub.ToString();
                written = false;
              }
            }
          } else {
            for (const v1::DecodeRequest& req : reqs) written = written && stream->Write(req);
          }
          if (!written) {
            st.first_error = "stream write failed";
            st.failed += B;
            broken = true;
            barrier.Wait();
            continue;
          }
          int got = 0;
          // One result: counted, its row appended to the reference later, sampled for a
          // check (only then is a StepResult built), its timing added to the breakdown.
          auto take = [&](uint64_t request_id, int32_t code, const std::string& message,
                          const v1::StepTiming* timing, v1::StepResult* result, int64_t received) {
            if (request_id < first_id || request_id >= first_id + static_cast<uint64_t>(B)) return;
            const int b = static_cast<int>(request_id - first_id);
            ++got;
            const size_t key = static_cast<size_t>(b) * L + l;
            if (code != 0) {
              ++st.failed;
              if (st.first_error.empty()) st.first_error = absl::StrCat("code ", code, ": ", message);
              return;
            }
            length[key] += s_q;
            appended.push_back(b);
            if (check_every > 0 && result_counter.fetch_add(1) % check_every == 0) {
              // Read back (in place) after the layer's time is taken: the check is
              // the benchmark's own work, not the round trip's.
              ResultChecker::Item c{ids[r][b], l, length[key], q_pool[q_of[b]], {}};
              if (result != nullptr) c.result = std::move(*result);
              c.result.set_request_id(request_id);
              to_check.push_back(std::move(c));
              to_check_slot.push_back(b);
            }
            if (measured && timing != nullptr) st.breakdown.Add(sent, *timing, received);
          };
          if (doorbell != nullptr) {
            // A runner reads its completions straight off the ring: no response to build.
            completions.clear();
            absl::Status w = doorbell->Wait(static_cast<size_t>(B), &completions, absl::Seconds(60));
            if (!w.ok() && st.first_error.empty()) st.first_error = w.ToString();
            const int64_t received = NowUs();
            if (measured) ++st.responses;
            for (const client::Ring::Completion& c : completions)
              take(c.request_id, c.code, c.message, c.has_timing ? &c.timing : nullptr, nullptr, received);
          } else {
            v1::DecodeResponse resp;
            while (got < B && stream->Read(&resp)) {
              const int64_t received = NowUs();
              if (measured) ++st.responses;
              for (v1::StepResult& res : *resp.mutable_results())
                take(res.request_id(), res.code(), res.message(), res.has_timing() ? &res.timing() : nullptr, &res,
                     received);
            }
          }
          const int64_t finished = NowUs();
          if (got < B) {
            st.first_error = absl::StrCat("stream ended with ", got, " of ", B, " results");
            st.failed += B - got;
            broken = true;
          }
          if (measured && !broken) {
            st.layer_us.push_back(static_cast<double>(finished - sent));
            ++st.layers;
          }
          // The reference's rows, also after the time is taken: a check copies a
          // sequence's rows under the reference's lock, which would hold this thread up.
          if (!layer_api)
            for (int b : appended) ref.Append(ids[r][b], l, kv_pool[(q_of[b] + 3) % kPool]);
          for (size_t k = 0; k < to_check.size(); ++k) {
            ResultChecker::Item& c = to_check[k];
            const int b = to_check_slot[k];
            if (device != nullptr) {  // in place, on the device
              c.result.set_out(device->Read(out_off(b), shape.OutBytes(s_q)));
              c.result.set_lse(device->Read(lse_off(b), shape.LseBytes(s_q)));
            } else if (shm) {  // the results are in the region, in place
              c.result.set_out(std::string(region->data() + slot * b + out_at, shape.OutBytes(s_q)));
              c.result.set_lse(std::string(region->data() + slot * b + lse_at, shape.LseBytes(s_q)));
            }
            checker.Push(std::move(c));
          }
          ++layer_count;
          barrier.Wait();
        }
      }
      st.end = absl::Now();
      if (broken) stream->Cancel();
      stream->WritesDone();
      v1::DecodeResponse drain;
      while (stream->Read(&drain)) {
      }
      stream->Finish();
    });
  for (auto& t : threads) t.join();
  for (const auto& per_runner : ids)
    for (const std::string& id : per_runner)
      if (!id.empty()) (void)c->ReleaseSequence(id);
  // The measured span ends with the last runner's last layer: closing streams and
  // releasing sequences (hundreds of RPCs) is not decoding.
  absl::Time measure_end = measure_start;
  for (const auto& st : stats) measure_end = std::max(measure_end, st.end);
  const double seconds = absl::ToDoubleSeconds(measure_end - measure_start);

  std::vector<double> all_layers;
  tools::RoundTripBreakdown breakdown;
  uint64_t responses = 0, layer_count = 0, failed = 0;
  std::string first_error;
  for (auto& st : stats) {
    all_layers.insert(all_layers.end(), st.layer_us.begin(), st.layer_us.end());
    breakdown.Merge(st.breakdown);
    responses += st.responses;
    layer_count += st.layers;
    failed += st.failed;
    if (first_error.empty()) first_error = st.first_error;
  }
  std::printf("per-layer round trip: p50 %.3f ms  p90 %.3f ms  p99 %.3f ms  (%zu layers)\n",
              Percentile(all_layers, 0.5) / 1e3, Percentile(all_layers, 0.9) / 1e3, Percentile(all_layers, 0.99) / 1e3,
              all_layers.size());
  std::printf("layer-steps/s: %.0f  responses per layer: %.2f  failed steps: %lu\n",
              static_cast<double>(layer_count) * B / std::max(seconds, 1e-9),
              layer_count ? static_cast<double>(responses) / static_cast<double>(layer_count) : 0.0,
              static_cast<unsigned long>(failed));
  breakdown.Print(stdout);
  checker.Flush();
  std::printf("checked %lu results, mismatched %lu\n", static_cast<unsigned long>(checker.checked()),
              static_cast<unsigned long>(checker.mismatched()));
  if (!first_error.empty()) std::printf("first error: %s\n", first_error.c_str());
  if (const std::string ff = checker.failures(); !ff.empty()) std::printf("first mismatch: %s\n", ff.c_str());
  return (failed > 0 || checker.mismatched() > 0) ? 1 : 0;
}

}  // namespace
}  // namespace latentd::runner_bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("latentd model-runner benchmark: per-layer round trips of B steps per message");
  absl::ParseCommandLine(argc, argv);
  latentd::server::SetLockOrderChecks(false);  // server/lock_order.h: a global lock per Mutex::Lock otherwise
  return latentd::runner_bench::Main();
}
