// A fair share for every client, against the real daemon: a steady client's decode
// latency beside a client flooding steps, and beside a client uploading large AppendKv
// messages, each compared with the same client alone in the same test.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "kernels/params.h"
#include "tests/integration/daemon.h"
#include "tests/integration/tracker.h"

namespace latentd::testing {
namespace {

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

// Medians of the server's timestamps (StepTiming) of a steady client's steps, as
// phases of its round trip, so a slow case says where its time went.
struct Phases {
  static constexpr int kN = 9;
  std::vector<double> us[kN];
  void Add(absl::Time sent, absl::Time read, const v1::StepTiming& t) {
    const double at[kN + 1] = {absl::ToUnixMicros(sent) * 1.0, double(t.received_us()), double(t.parsed_us()),
                               double(t.submitted_us()), double(t.batched_us()), double(t.launched_us()),
                               double(t.finished_us()), double(t.completed_us()), double(t.response_us()),
                               absl::ToUnixMicros(read) * 1.0};
    for (int i = 0; i < kN; ++i) us[i].push_back(at[i + 1] - at[i]);
  }
  std::string Line() const {
    static const char* kNames[kN] = {"send->read", "parse", "->engine", "queue", "stage",
                                     "run",        "message", "build",   "write->client"};
    std::string out;
    for (int i = 0; i < kN; ++i) absl::StrAppend(&out, i ? " " : "", kNames[i], " ", Median(us[i]));
    return out;
  }
  static double Median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }
};

// One step at a time on one stream, each result checked, for n steps and then while
// `more` says so, but never more than max_steps; returns latencies in ms.
std::vector<double> Steady(Tracker* t, const std::string& seq, int n, Phases* phases = nullptr,
                           const std::function<bool()>& more = nullptr, int max_steps = 0) {
  auto stream = t->client()->OpenDecodeStream();
  std::vector<double> ms;
  for (int i = 0; (i < n || (more && more())) && (max_steps <= 0 || i < max_steps); ++i) {
    v1::DecodeRequest req;
    *req.add_steps() = t->Step(seq, 0);
    req.mutable_steps(0)->set_trace(phases != nullptr);
    const absl::Time start = absl::Now();
    EXPECT_TRUE(stream->Write(req));
    v1::DecodeResponse resp;
    EXPECT_TRUE(stream->Read(&resp));
    const absl::Time end = absl::Now();
    ms.push_back(absl::ToDoubleMilliseconds(end - start));
    for (const auto& r : resp.results()) {
      EXPECT_TRUE(t->Check(r).ok()) << t->Check(r);
      if (phases != nullptr && r.has_timing()) phases->Add(start, end, r.timing());
    }
  }
  stream->WritesDone();
  v1::DecodeResponse resp;
  while (stream->Read(&resp)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
  return ms;
}

// A client that sends 1000-step messages (see LATENTD_FLOOD_STEPS) as fast as its stream takes them, on its own
// connection, until stopped; counts its results.
class Flood {
 public:
  explicit Flood(const Daemon& daemon) {
    auto c = daemon.Connect();
    EXPECT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    for (int i = 0; i < 64; ++i) {
      auto s = client_->CreateSequence();
      EXPECT_TRUE(s.ok());
      seqs_.push_back(*s);
    }
    stream_ = client_->OpenDecodeStream();
    reader_ = std::thread([this] {
      v1::DecodeResponse resp;
      while (stream_->Read(&resp)) results_ += resp.results_size();
    });
    writer_ = std::thread([this] {
      const client::Shape& sh = client_->shape();
      v1::DecodeRequest req;
      // LATENTD_FLOOD_STEPS: steps per flood message (default 1000), for measuring how
      // message size matters.
      const char* steps_env = std::getenv("LATENTD_FLOOD_STEPS");
      const int steps = steps_env != nullptr ? std::max(1, std::atoi(steps_env)) : 1000;
      for (int i = 0; i < steps; ++i) {
        v1::DecodeStep* s = req.add_steps();
        s->set_sequence_id(seqs_[i % seqs_.size()]);
        s->set_q(std::string(static_cast<size_t>(sh.QBytes(1)), '\x01'));
        s->set_kv(std::string(static_cast<size_t>(sh.KvBytes(1)), '\x01'));
      }
      while (!stop_.load() && stream_->Write(req)) ++writes_;
      stream_->WritesDone();
    });
    // Measured only once the daemon serves the flood (a whole message answered) and two
    // more messages have been taken behind it: a backlog, however slow the machine is,
    // where a fixed wait could leave a slow machine measuring beside a flood not yet
    // queued.
    while (results_.load() == 0 || writes_.load() < 3) absl::SleepFor(absl::Milliseconds(10));
  }
  int Stop() {
    stop_.store(true);
    writer_.join();
    reader_.join();
    stream_->Finish();
    return results_.load();
  }

 private:
  std::unique_ptr<client::Client> client_;
  std::vector<std::string> seqs_;
  std::unique_ptr<client::DecodeStream> stream_;
  std::atomic<bool> stop_{false};
  std::atomic<int> results_{0};
  std::atomic<int> writes_{0};
  std::thread reader_, writer_;
};

// A client uploading large AppendKv messages (256 MiB: long enough that a copy made
// under one lock hold would stall decoding for tens of milliseconds) until stopped or
// until one fails (then it stops: the test reports the error instead of retrying
// forever).
constexpr int64_t kUploadBytes = int64_t{256} << 20;
class Uploader {
 public:
  explicit Uploader(const Daemon& daemon) {
    client::ClientOptions o;
    o.target = daemon.target();
    o.append_chunk_bytes = kUploadBytes;  // one message per upload
    o.max_send_bytes = kUploadBytes + (1 << 20);
    auto c = client::Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    const int64_t row = client_->shape().kv_row_bytes;
    rows_.assign(static_cast<size_t>(kUploadBytes / row * row), '\x02');
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        absl::Status st;
        if (auto s = client_->CreateSequence(); !s.ok()) {
          st = s.status();
        } else {
          auto r = client_->AppendKv(*s, 0, rows_);
          st = r.status();
          if (absl::Status released = client_->ReleaseSequence(*s).status(); st.ok()) st = released;
        }
        if (!st.ok()) {
          std::lock_guard<std::mutex> l(mu_);
          error_ = st;
          failed_.store(true);
          return;
        }
        ++uploads_;
      }
    });
    while (uploads_.load() == 0 && !failed_.load()) absl::SleepFor(absl::Milliseconds(10));
  }
  ~Uploader() { Stop(); }
  int Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
    return uploads_.load();
  }
  int uploads() const { return uploads_.load(); }
  bool failed() const { return failed_.load(); }
  absl::Status error() const {
    std::lock_guard<std::mutex> l(mu_);
    return error_;
  }
  int64_t rows() const { return static_cast<int64_t>(rows_.size()) / client_->shape().kv_row_bytes; }

 private:
  std::unique_ptr<client::Client> client_;
  std::string rows_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::atomic<int> uploads_{0};
  mutable std::mutex mu_;
  absl::Status error_;
  std::thread thread_;
};

// Each test compares the steady client beside the heavy one on the same daemon with the
// steady client beside the same heavy client on another daemon of the same host. On a
// machine with few cores, the heavy client's CPU use slows everyone whichever daemon it
// talks to; the control run measures that, and the bound is on what sharing the daemon
// adds to it.
TEST(FairnessTest, AFloodDoesNotStarveASteadyClient) {
  // Default batch size: on the CPU backend, 2 per CPU thread (see --max_batch_size).
  Daemon daemon({"--num_layers=1", "--num_heads_q=16", "--kv_pages=4096"});
  Daemon other({"--num_layers=1", "--num_heads_q=16", "--kv_pages=4096"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  ASSERT_TRUE(other.Start()) << other.Log();
  auto steady_client = daemon.Connect();
  ASSERT_TRUE(steady_client.ok());
  Tracker steady(steady_client->get(), 21);
  auto mine = steady.NewSequence({64});
  ASSERT_TRUE(mine.ok());
  Steady(&steady, *mine, 20);  // warm-up
  Phases alone_phases, control_phases, beside_phases;
  const std::vector<double> alone = Steady(&steady, *mine, 200, &alone_phases);

  Flood elsewhere(other);
  const std::vector<double> control = Steady(&steady, *mine, 200, &control_phases);
  const int control_results = elsewhere.Stop();

  Flood beside_flood(daemon);
  const std::vector<double> beside = Steady(&steady, *mine, 200, &beside_phases);
  const int flood_results = beside_flood.Stop();

  const double p50_alone = Percentile(alone, 0.5), p50_control = Percentile(control, 0.5),
               p50_beside = Percentile(beside, 0.5);
  std::printf(
      "steady client p50: %.2f ms alone, %.2f ms beside a flood on another daemon (%d flood results), %.2f ms "
      "beside a flood on its own daemon (%d flood results)\n",
      p50_alone, p50_control, control_results, p50_beside, flood_results);
  std::printf("steady client's round trip, medians in us:\n  alone:  %s\n  other:  %s\n  beside: %s\n",
              alone_phases.Line().c_str(), control_phases.Line().c_str(), beside_phases.Line().c_str());
  EXPECT_GT(flood_results, 1000) << "the flood must have been served too";
  // A timed test asserts a loose bound that a shared FIFO (a step queued behind the
  // flood's backlog: 100x) or a scheduler without fair shares fails by far; the 2x target
  // is measured by repeated runs and recorded in docs/benchmarks.md.
  EXPECT_LE(p50_beside, 4 * p50_control);
}

TEST(FairnessTest, ALargeUploadDoesNotStallADecoder) {
  // Both windows span the same number of whole uploads, at least kMinWindowSteps and at
  // most kMaxWindowSteps decode steps. The decoder appends a row per step, so the cap is
  // what bounds its sequence however slow the uploads run beside it, and the pool holds
  // one upload beside the longest the decoder's sequence can grow: a machine too slow for
  // kWindowUploads uploads in kMaxWindowSteps steps measures shorter windows (still all
  // beside uploads in progress) instead of running out of pages.
  constexpr int kWindowUploads = 3, kMinWindowSteps = 400, kMaxWindowSteps = 4000;
  constexpr int kPrefix = 64, kWarmUp = 20, kAlone = 400;
  constexpr int64_t kRowBytes = 576 * 2;  // one bf16 KV head (checked below)
  constexpr int64_t kUploadPages = (kUploadBytes / kRowBytes + kernels::kPageSize - 1) / kernels::kPageSize;
  constexpr int64_t kDecoderRows = kPrefix + kWarmUp + kAlone + 2 * kMaxWindowSteps;
  // +1: a step reserves its row's page before the previous page is full.
  constexpr int64_t kDecoderPages = (kDecoderRows + kernels::kPageSize - 1) / kernels::kPageSize + 1;
  const std::vector<std::string> flags = {"--num_layers=1", "--num_heads_q=16",
                                          absl::StrCat("--kv_pages=", kUploadPages + kDecoderPages),
                                          "--max_message_bytes=272629760"};
  Daemon daemon(flags);
  Daemon other(flags);
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  ASSERT_TRUE(other.Start()) << other.Log();
  auto steady_client = daemon.Connect();
  ASSERT_TRUE(steady_client.ok());
  ASSERT_EQ((*steady_client)->shape().kv_row_bytes, kRowBytes) << "the pool is sized for this row";
  Tracker steady(steady_client->get(), 23);
  auto mine = steady.NewSequence({kPrefix});
  ASSERT_TRUE(mine.ok());
  Steady(&steady, *mine, kWarmUp);
  const std::vector<double> alone = Steady(&steady, *mine, kAlone);

  auto window = [&](const Uploader& u) {
    const int until = u.uploads() + kWindowUploads + 1;  // the upload in progress, then whole ones
    return Steady(&steady, *mine, kMinWindowSteps, nullptr,
                  [&] { return u.uploads() < until && !u.failed(); }, kMaxWindowSteps);
  };
  Uploader elsewhere(other);
  ASSERT_FALSE(elsewhere.failed()) << elsewhere.error();
  const std::vector<double> control = window(elsewhere);
  const int control_uploads = elsewhere.Stop();
  ASSERT_FALSE(elsewhere.failed()) << elsewhere.error();

  Uploader beside_uploads(daemon);
  ASSERT_FALSE(beside_uploads.failed()) << beside_uploads.error();
  const std::vector<double> beside = window(beside_uploads);
  const int uploads = beside_uploads.Stop();
  ASSERT_FALSE(beside_uploads.failed()) << beside_uploads.error();
  ASSERT_EQ(beside_uploads.rows(), kUploadBytes / kRowBytes);

  const double p99_alone = Percentile(alone, 0.99), p99_control = Percentile(control, 0.99),
               p99_beside = Percentile(beside, 0.99);
  const double p95_control = Percentile(control, 0.95), p95_beside = Percentile(beside, 0.95);
  std::printf(
      "decoder p99: %.2f ms alone, %.2f ms beside 256 MiB uploads to another daemon (%zu steps), %.2f ms beside "
      "them on its own daemon (%zu steps); p95 %.2f / %.2f / %.2f ms; p50 %.2f / %.2f / %.2f ms; max %.2f / %.2f / "
      "%.2f ms; %d and %d uploads in all\n",
      p99_alone, p99_control, control.size(), p99_beside, beside.size(), Percentile(alone, 0.95), p95_control,
      p95_beside, Percentile(alone, 0.5), Percentile(control, 0.5), Percentile(beside, 0.5), Percentile(alone, 1),
      Percentile(control, 1), Percentile(beside, 1), control_uploads, uploads);
  // Loose, as above: it fails where most steps queue behind the uploads' processing; the
  // 2x target is measured, not asserted here. One stall per upload (the KV lock held for a
  // whole copy) moves no percentile of ~1000 steps; engine_test checks that a decode step
  // runs between two chunks of an upload instead. p95, not p99: on a 2-core machine the
  // daemon's own parsing and copying of each 256 MiB message puts a few steps per upload
  // at 20-90 ms, so in a 5-run sample p99 beside the uploads read 2-3.7x the control's and
  // p95 1.55-1.86x.
  EXPECT_LE(p95_beside, 4 * p95_control);
}

}  // namespace
}  // namespace latentd::testing
