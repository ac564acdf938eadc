// Heavy and hostile traffic against the real daemon, each case bounded in time: stream
// churn beside hundreds of idle streams, drain during churn, messages that try to make
// the server hold more than its limits, thousands of streams, and the daemon's memory
// after each. A checked client's results stay correct throughout.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/generic/generic_stub.h"
#include "tests/integration/daemon.h"
#include "tests/integration/tracker.h"

namespace latentd::testing {
namespace {

// Resident set of a process in bytes (0 if unreadable).
int64_t RssBytes(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      int64_t kb = 0;
      std::string digits;
      for (char c : line)
        if (c >= '0' && c <= '9') digits += c;
      if (absl::SimpleAtoi(digits, &kb)) return kb * 1024;
    }
  }
  return 0;
}

constexpr int64_t kMiB = 1 << 20;

// Sanitizer builds (the daemon is built the same way as the test) use their own
// allocators, which keep freed memory in quarantine and do not return it on
// malloc_trim: memory that must go back to the system is checked in plain builds only.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitizerAllocator = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitizerAllocator = true;
#else
constexpr bool kSanitizerAllocator = false;
#endif
#else
constexpr bool kSanitizerAllocator = false;
#endif

// Sends raw bytes as one message on a Decode stream and collects what comes back.
struct RawOutcome {
  grpc::Status status;
  std::vector<v1::StepResult> results;
};
RawOutcome RawDecode(client::Client* c, const std::string& bytes) {
  grpc::GenericStub stub(c->channel());
  grpc::ClientContext ctx;
  c->Prepare(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, "/latentd.v1.DecodeService/Decode", &cq);
  RawOutcome out;
  void* tag = nullptr;
  bool ok = false;
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer req(&slice, 1);
  call->Write(req, reinterpret_cast<void*>(2));
  cq.Next(&tag, &ok);
  call->WritesDone(reinterpret_cast<void*>(3));
  cq.Next(&tag, &ok);
  for (;;) {
    grpc::ByteBuffer resp;
    call->Read(&resp, reinterpret_cast<void*>(4));
    cq.Next(&tag, &ok);
    if (!ok) break;
    std::vector<grpc::Slice> slices;
    resp.Dump(&slices);
    std::string s;
    for (auto& sl : slices) s.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    v1::DecodeResponse r;
    EXPECT_TRUE(r.ParseFromString(s));
    for (auto& x : r.results()) out.results.push_back(x);
  }
  call->Finish(&out.status, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  return out;
}

// Opens Decode streams and closes them every way a client can, as fast as it can:
// a step and a clean close, a step and a cancel, a cancel before anything is sent.
// Opens and ends streams until `stop` is set.
void Churn(client::Client* c, const std::string& seq, const std::atomic<bool>* stop, std::atomic<int>* streams,
           uint64_t seed) {
  std::mt19937_64 rng(seed);
  const client::Shape& sh = c->shape();
  while (!stop->load()) {
    auto stream = c->OpenDecodeStream();
    const int mode = static_cast<int>(rng() % 3);
    if (mode != 2) {
      v1::DecodeRequest req;
      v1::DecodeStep* s = req.add_steps();
      s->set_request_id(rng());
      s->set_sequence_id(seq);
      s->set_q(std::string(static_cast<size_t>(sh.QBytes(1)), '\x01'));
      s->set_kv(std::string(static_cast<size_t>(sh.KvBytes(1)), '\x01'));
      stream->Write(req);
    }
    if (mode == 0) {
      stream->WritesDone();
    } else {
      stream->Cancel();
    }
    v1::DecodeResponse resp;
    while (stream->Read(&resp)) {
      for (const auto& r : resp.results()) {
        if (r.code() == 0) {
          EXPECT_EQ(static_cast<int64_t>(r.out().size()), sh.OutBytes(1));
        }
      }
    }
    stream->Finish();
    streams->fetch_add(1);
  }
}

TEST(StressTest, ChurnBesideIdleStreamsAndDrain) {
  // Stall checks every 125 ms visit every open stream while streams come and go.
  Daemon daemon({"--num_layers=1", "--num_heads_q=16", "--kv_pages=1024", "--stream_stall_timeout_s=1",
                 "--drain_timeout_s=20"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto checked = daemon.Connect();
  ASSERT_TRUE(checked.ok()) << checked.status();
  Tracker tracker(checked->get(), 3);
  auto mine = tracker.NewSequence({200});
  ASSERT_TRUE(mine.ok()) << mine.status();

  // A few hundred streams that sit idle.
  auto idle_client = daemon.Connect();
  ASSERT_TRUE(idle_client.ok());
  std::vector<std::unique_ptr<client::DecodeStream>> idle;
  for (int i = 0; i < 300; ++i) idle.push_back((*idle_client)->OpenDecodeStream());

  constexpr int kChurners = 4;
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::string> seqs;
  for (int i = 0; i < kChurners; ++i) {
    auto c = daemon.Connect();
    ASSERT_TRUE(c.ok());
    auto s = (*c)->CreateSequence();
    ASSERT_TRUE(s.ok());
    seqs.push_back(*s);
    clients.push_back(std::move(*c));
  }
  // At least 8 s and at least kMinChurned streams: a slow machine churns longer instead
  // of failing the count (HangGuard bounds the wait for a daemon that stopped serving).
  constexpr int kMinChurned = 100;
  std::atomic<int> churned{0};
  std::atomic<bool> stop{false};
  const absl::Time until = absl::Now() + absl::Seconds(8);
  const absl::Time give_up = absl::Now() + HangGuard(absl::Seconds(120));
  std::vector<std::thread> threads;
  for (int i = 0; i < kChurners; ++i) {
    threads.emplace_back([&, i] { Churn(clients[i].get(), seqs[i], &stop, &churned, 100 + i); });
  }
  int results = 0;
  while ((absl::Now() < until || churned.load() <= kMinChurned) && absl::Now() < give_up) {
    auto r = (*checked)->DecodeAll({tracker.Step(*mine, 0)});
    if (!r.ok()) {
      ADD_FAILURE() << r.status() << "\n" << daemon.Log();
      break;
    }
    for (const auto& [id, res] : *r) {
      EXPECT_TRUE(tracker.Check(res).ok()) << tracker.Check(res);
      ++results;
    }
  }
  stop.store(true);
  for (auto& t : threads) t.join();
  ASSERT_FALSE(::testing::Test::HasFailure());
  std::printf("%d streams churned beside 300 idle ones; %d checked results\n", churned.load(), results);
  EXPECT_GT(churned.load(), kMinChurned);
  ASSERT_TRUE(daemon.Running()) << daemon.Log();

  // Drain while streams churn: the daemon exits by itself, not by a signal.
  // The signal comes once the churn is under way (streams have ended since it started),
  // and the churners stop once the daemon has gone.
  std::atomic<int> churned2{0};
  std::atomic<bool> stop2{false};
  threads.clear();
  for (int i = 0; i < kChurners; ++i) {
    threads.emplace_back([&, i] { Churn(clients[i].get(), seqs[i], &stop2, &churned2, 200 + i); });
  }
  while (churned2.load() < kChurners && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(10));
  daemon.Signal(SIGTERM);
  const int code = daemon.Wait(absl::Seconds(40));
  stop2.store(true);
  for (auto& t : threads) t.join();
  idle.clear();
  EXPECT_GE(code, 0) << daemon.Log();
  EXPECT_LT(code, 128) << "killed by a signal\n" << daemon.Log();
  EXPECT_TRUE(absl::StrContains(daemon.Log(), "drain")) << daemon.Log();
}

TEST(StressTest, OneMessageCannotMakeTheServerHoldMore) {
  // The engine queue holds 150 steps: a stream that put a whole message's 300 steps in
  // at once would see half of them refused.
  Daemon daemon({"--num_layers=1", "--num_heads_q=16", "--kv_pages=512", "--max_stream_inflight=100",
                 "--max_queue=150"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get(), 5);
  auto seq = tracker.NewSequence({100});
  ASSERT_TRUE(seq.ok());
  absl::SleepFor(absl::Milliseconds(200));
  const int64_t rss0 = RssBytes(daemon.pid());
  ASSERT_GT(rss0, 0);

  // 4M empty steps in 8 MiB: refused as a whole before any step is copied.
  std::string empty_steps;
  empty_steps.reserve(8 * kMiB);
  for (int i = 0; i < 4000000; ++i) empty_steps.append("\x0a\x00", 2);
  RawOutcome big = RawDecode(c->get(), empty_steps);
  EXPECT_EQ(big.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << big.status.error_message();
  EXPECT_TRUE(absl::StrContains(big.status.error_message(), "--max_steps_per_message"))
      << big.status.error_message();
  EXPECT_TRUE(big.results.empty());
  const int64_t rss1 = RssBytes(daemon.pid());
  std::printf("RSS %.1f MiB before, %.1f MiB after an 8 MiB message of 4M empty steps\n",
              double(rss0) / kMiB, double(rss1) / kMiB);
  EXPECT_LT(rss1 - rss0, 64 * kMiB);

  // 300 valid steps in one message with room for 100: they go into the engine 100 at a
  // time, and all of them run.
  v1::DecodeRequest req;
  std::vector<std::string> seqs;
  for (int i = 0; i < 300; ++i) {
    auto s = tracker.NewSequence({10});
    ASSERT_TRUE(s.ok()) << s.status();
    *req.add_steps() = tracker.Step(*s, 0);
  }
  RawOutcome some = RawDecode(c->get(), req.SerializeAsString());
  EXPECT_TRUE(some.status.ok()) << some.status.error_message();
  ASSERT_EQ(some.results.size(), 300u);
  int ok = 0;
  for (const auto& r : some.results) {
    EXPECT_EQ(r.code(), 0) << r.message();
    if (r.code() == 0) {
      EXPECT_TRUE(tracker.Check(r).ok()) << tracker.Check(r);
      ++ok;
    }
  }
  EXPECT_EQ(ok, 300);
  ASSERT_TRUE(daemon.Running()) << daemon.Log();
}

TEST(StressTest, StepBuffersAreBoundedServerWide) {
  // 4 MiB of step buffers: about 28 steps of h_q 64 (q, kv, out and lse: ~140 KiB each).
  Daemon daemon({"--num_layers=1", "--num_heads_q=64", "--kv_pages=256", "--max_inflight_bytes=4194304"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get(), 13);
  std::vector<std::string> seqs;
  v1::DecodeRequest req;
  for (int i = 0; i < 100; ++i) {
    auto s = tracker.NewSequence({4});
    ASSERT_TRUE(s.ok());
    *req.add_steps() = tracker.Step(*s, 0);
  }
  RawOutcome out = RawDecode(c->get(), req.SerializeAsString());
  EXPECT_TRUE(out.status.ok()) << out.status.error_message();
  ASSERT_EQ(out.results.size(), 100u);
  int ok = 0, busy = 0;
  for (const auto& r : out.results) {
    if (r.code() == 0) {
      EXPECT_TRUE(tracker.Check(r).ok()) << tracker.Check(r);
      ++ok;
    } else {
      EXPECT_EQ(r.code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED)) << r.message();
      EXPECT_TRUE(absl::StrContains(r.message(), "--max_inflight_bytes")) << r.message();
      ++busy;
      tracker.Refused(r.request_id());
    }
  }
  std::printf("%d steps ran and %d were refused under a 4 MiB step-buffer budget\n", ok, busy);
  EXPECT_GT(ok, 10);
  EXPECT_LT(ok, 40);
  EXPECT_EQ(ok + busy, 100);
  ASSERT_TRUE(daemon.Running()) << daemon.Log();
}

TEST(StressTest, StreamMemoryShrinksAfterABurst) {
  Daemon daemon({"--num_layers=1", "--num_heads_q=64", "--kv_pages=256", "--max_stream_inflight=1024"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get(), 9);
  std::vector<std::string> seqs;
  for (int i = 0; i < 50; ++i) {
    auto s = tracker.NewSequence({8});
    ASSERT_TRUE(s.ok());
    seqs.push_back(*s);
  }
  auto stream = (*c)->OpenDecodeStream();
  // Warm the stream up with one step so its fixed costs are in the baseline.
  v1::DecodeRequest one;
  *one.add_steps() = tracker.Step(seqs[0], 0);
  ASSERT_TRUE(stream->Write(one));
  v1::DecodeResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  absl::SleepFor(absl::Seconds(1));
  const int64_t rss0 = RssBytes(daemon.pid());

  // A burst of 1000 steps (about 140 MiB of inputs and results), all in flight at once.
  int expected = 0;
  for (int m = 0; m < 4; ++m) {
    v1::DecodeRequest req;
    for (int i = 0; i < 250; ++i) *req.add_steps() = tracker.Step(seqs[(m * 250 + i) % seqs.size()], 0);
    ASSERT_TRUE(stream->Write(req));
    expected += 250;
  }
  int got = 0;
  while (got < expected && stream->Read(&resp)) {
    for (const auto& r : resp.results()) {
      EXPECT_EQ(r.code(), 0) << r.message();
      ++got;
    }
  }
  ASSERT_EQ(got, expected);
  const int64_t rss_peak = RssBytes(daemon.pid());
  // The stream stays open and idle: housekeeping (once a second) trims it. Polled until
  // trimmed (or HangGuard(30 s)), not read after a fixed wait a loaded machine may not
  // give housekeeping its turn in.
  constexpr int64_t kTrimmedBound = 48 * kMiB;
  int64_t rss1 = RssBytes(daemon.pid());
  for (const absl::Time give_up = absl::Now() + HangGuard(absl::Seconds(30));
       !kSanitizerAllocator && rss1 - rss0 >= kTrimmedBound && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(100));
    rss1 = RssBytes(daemon.pid());
  }
  std::printf("RSS %.1f MiB before a 1000-step burst, %.1f MiB after it, %.1f MiB once idle\n",
              double(rss0) / kMiB, double(rss_peak) / kMiB, double(rss1) / kMiB);
  // A stream that kept its 1000 slots stays ~110 MiB above rss0 (measured with the spare
  // slots kept). Trimmed, 2-25 MiB stay (gRPC's call arena and heap pages malloc_trim
  // cannot return; 25 MiB seen with other tests running beside this one), so the bound
  // sits between the two rather than at the edge of the trimmed spread.
  if (!kSanitizerAllocator) {
    EXPECT_LT(rss1 - rss0, kTrimmedBound);
  }
  stream->WritesDone();
  while (stream->Read(&resp)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
}

TEST(StressTest, ThousandsOfStreamsAndTheStreamLimit) {
  // One client connection carries them all: its own limit is raised out of the way.
  Daemon daemon({"--num_layers=1", "--num_heads_q=16", "--kv_pages=256", "--max_streams=1500",
                 "--max_streams_per_connection=4000"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get(), 11);
  auto seq = tracker.NewSequence({64});
  ASSERT_TRUE(seq.ok());
  const int64_t rss0 = RssBytes(daemon.pid());

  // 2000 streams at once over a few connections: 1500 are served, the rest refused.
  constexpr int kStreams = 2000;
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int i = 0; i < 4; ++i) {
    client::ClientOptions o;
    o.target = daemon.target();
    auto cc = client::Client::Connect(o);
    ASSERT_TRUE(cc.ok());
    clients.push_back(std::move(*cc));
  }
  std::vector<std::unique_ptr<client::DecodeStream>> streams;
  for (int i = 0; i < kStreams; ++i) streams.push_back(clients[i % clients.size()]->OpenDecodeStream());
  absl::SleepFor(absl::Seconds(1));  // every call has reached the server before any ends
  // Each served stream sends one step to a sequence of their own (checked for code and
  // shape only; the tracker's sequence stays as the tracker knows it).
  auto bulk = (*c)->CreateSequence();
  ASSERT_TRUE(bulk.ok());
  const client::Shape& sh = (*c)->shape();
  v1::DecodeRequest req;
  v1::DecodeStep* s = req.add_steps();
  s->set_sequence_id(*bulk);
  s->set_q(std::string(static_cast<size_t>(sh.QBytes(1)), '\x01'));
  s->set_kv(std::string(static_cast<size_t>(sh.KvBytes(1)), '\x01'));
  for (auto& st : streams) {
    st->Write(req);
    st->WritesDone();
  }
  int served = 0, refused = 0, other = 0;
  for (auto& st : streams) {
    v1::DecodeResponse resp;
    int results = 0;
    while (st->Read(&resp)) results += resp.results_size();
    const grpc::Status status = st->Finish();
    if (status.ok() && results == 1) {
      ++served;
    } else if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
               absl::StrContains(status.error_message(), "--max_streams")) {
      ++refused;
    } else {
      ++other;
      ADD_FAILURE() << status.error_code() << " " << status.error_message();
    }
  }
  std::printf("%d streams served, %d refused over --max_streams, RSS %.1f -> %.1f MiB\n", served, refused,
              double(rss0) / kMiB, double(RssBytes(daemon.pid())) / kMiB);
  EXPECT_GE(served, 1500 - 1);  // all open at once: exactly the limit (one test stream aside)
  EXPECT_GT(refused, 0);
  EXPECT_EQ(served + refused + other, kStreams);
  streams.clear();
  // Once they are gone, new streams are served again.
  auto r = (*c)->DecodeAll({tracker.Step(*seq, 0)});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(daemon.Running()) << daemon.Log();
}

}  // namespace
}  // namespace latentd::testing
