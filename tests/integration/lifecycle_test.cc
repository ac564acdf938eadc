// The daemon's life cycle end to end: a client killed mid-stream corrupts nothing and
// its sequences expire after the TTL; SIGTERM loses no accepted step while health reads
// NOT_SERVING and new work is refused; a stream whose client stops reading is
// cancelled; the bearer token and TLS paths.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/integration/daemon.h"
#include "tests/integration/tls_cert.h"
#include "tests/integration/tracker.h"

namespace latentd::testing {
namespace {

using absl::StatusCode;

std::string ReadAll(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(LifecycleTest, KilledClientCorruptsNothingAndItsSequencesExpire) {
  Daemon daemon({"--num_layers=1", "--num_heads_q=32", "--sequence_ttl_s=2"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  auto mine = tracker.NewSequence({300});
  ASSERT_TRUE(mine.ok()) << mine.status();

  // The doomed client: 3 sequences, 300 steps in flight, then SIGKILL.
  const std::string dir = TempDir("crash");
  const std::string log = dir + "/crash.log";
  const pid_t pid = Spawn(RunfilePath("tests/integration/crash_client"),
                          {"--target=" + daemon.target(), "--sequences=3", "--prefix_len=1500", "--steps=300"}, log);
  ASSERT_GT(pid, 0);
  const absl::Time deadline = absl::Now() + HangGuard(absl::Seconds(60));
  while (!absl::StrContains(ReadAll(log), "READY") && absl::Now() < deadline) {
    // Our own sequence keeps working while the other client loads the server.
    auto r = (*c)->DecodeAll({tracker.Step(*mine, 0)});
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(tracker.Check(r->begin()->second).ok()) << tracker.Check(r->begin()->second);
  }
  ASSERT_TRUE(absl::StrContains(ReadAll(log), "READY")) << ReadAll(log);
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  std::vector<std::string> doomed;
  for (absl::string_view line : absl::StrSplit(ReadAll(log), '\n')) {
    if (absl::StartsWith(line, "SEQ ")) doomed.emplace_back(line.substr(4));
  }
  ASSERT_EQ(doomed.size(), 3u);

  // Within a few TTLs the doomed sequences are released; ours, in use, stays correct.
  int64_t sequences = -1;
  const absl::Time ttl_deadline = absl::Now() + HangGuard(absl::Seconds(20));
  while (absl::Now() < ttl_deadline) {
    auto r = (*c)->DecodeAll({tracker.Step(*mine, 0)});
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(tracker.Check(r->begin()->second).ok()) << tracker.Check(r->begin()->second);
    auto info = (*c)->GetInfo();
    ASSERT_TRUE(info.ok());
    sequences = info->sequences();
    if (sequences == 1) break;
    absl::SleepFor(absl::Milliseconds(300));
  }
  EXPECT_EQ(sequences, 1) << daemon.Log();
  for (const auto& id : doomed) {
    EXPECT_EQ((*c)->ReleaseSequence(id).status().code(), StatusCode::kNotFound) << id;
  }
  auto info = (*c)->GetInfo();
  ASSERT_TRUE(info.ok());
  const int64_t my_pages = (tracker.reference().Length(*mine, 0) + 63) / 64;
  EXPECT_EQ(info->free_pages(), info->total_pages() - my_pages);
  EXPECT_TRUE(daemon.Running());
}

TEST(LifecycleTest, SigtermLosesNoAcceptedStep) {
  Daemon daemon({"--num_layers=1", "--num_heads_q=32", "--max_batch_size=8", "--drain_timeout_s=120"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  constexpr int kStreams = 4, kSteps = 120, kLate = 5;
  std::vector<std::string> seqs;
  for (int i = 0; i < kStreams; ++i) {
    auto s = tracker.NewSequence({1500});
    ASSERT_TRUE(s.ok()) << s.status();
    seqs.push_back(*s);
  }
  // Probe steps during the drain go to a sequence of their own (never checked).
  auto probe = tracker.NewSequence({10});
  ASSERT_TRUE(probe.ok()) << probe.status();
  ASSERT_EQ(*(*c)->Health(), "SERVING");

  std::vector<std::atomic<int>> received(kStreams);
  std::atomic<bool> signalled{false};
  std::vector<std::map<uint64_t, v1::StepResult>> results(kStreams);
  std::vector<std::vector<uint64_t>> sent(kStreams);
  std::vector<grpc::Status> status(kStreams);
  std::vector<std::thread> threads;
  for (int t = 0; t < kStreams; ++t) {
    threads.emplace_back([&, t] {
      auto stream = (*c)->OpenDecodeStream();
      std::thread reader([&] {
        v1::DecodeResponse resp;
        while (stream->Read(&resp)) {
          for (const auto& r : resp.results()) results[t][r.request_id()] = r;
          received[t] += resp.results_size();
        }
      });
      v1::DecodeRequest req;
      for (int i = 0; i < kSteps; ++i) {
        *req.add_steps() = tracker.Step(seqs[t], 0);
        sent[t].push_back(req.steps().rbegin()->request_id());
        if (req.steps_size() == 10) {
          stream->Write(req);
          req.Clear();
        }
      }
      // After SIGTERM: steps on an open stream are refused one by one.
      while (!signalled) absl::SleepFor(absl::Milliseconds(1));
      for (int i = 0; i < kLate; ++i) {
        *req.add_steps() = tracker.Step(seqs[t], 0);
        sent[t].push_back(req.steps().rbegin()->request_id());
      }
      stream->Write(req);
      stream->WritesDone();
      reader.join();
      status[t] = stream->Finish();
    });
  }
  // Signal once every stream has results back, so each has accepted steps behind it;
  // how many of its 120 steps the server has read by then depends on scheduling.
  for (int t = 0; t < kStreams; ++t) {
    while (received[t] < 10) absl::SleepFor(absl::Milliseconds(2));
  }
  daemon.Signal(SIGTERM);
  signalled = true;

  // While the accepted steps drain: health NOT_SERVING, new work UNAVAILABLE.
  bool saw_not_serving = false, refused_create = false, refused_stream = false;
  int probe_ok = 0;  // a probe may slip in between the signal and the drain starting
  while (daemon.Running() && !(saw_not_serving && refused_create && refused_stream)) {
    auto h = (*c)->Health();
    if (h.ok() && *h == "NOT_SERVING") saw_not_serving = true;
    auto created = (*c)->CreateSequence();
    if (created.status().code() == StatusCode::kUnavailable &&
        absl::StrContains(created.status().message(), "shutting down")) {
      refused_create = true;
    }
    auto r = (*c)->DecodeAll({tracker.Step(*probe, 0)});
    if (r.status().code() == StatusCode::kUnavailable && absl::StrContains(r.status().message(), "shutting down")) {
      refused_stream = true;
    }
    if (r.ok()) {
      for (const auto& [id, res] : *r) probe_ok += res.code() == 0;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(saw_not_serving);
  EXPECT_TRUE(refused_create);
  EXPECT_TRUE(refused_stream);
  for (auto& t : threads) t.join();
  EXPECT_EQ(daemon.Wait(absl::Seconds(60)), 0) << daemon.Log();

  // A stream's steps that got no result form a suffix that the server never read: the
  // stream then ended UNAVAILABLE. Every result before it is in order and correct, and
  // a late step (written after the signal) runs only if it beat the drain's start.
  int ok = 0;
  for (int t = 0; t < kStreams; ++t) {
    EXPECT_TRUE(status[t].ok() || status[t].error_code() == grpc::StatusCode::UNAVAILABLE)
        << status[t].error_message();
    bool refused_seen = false;
    int stream_ok = 0;
    for (size_t i = 0; i < sent[t].size(); ++i) {
      auto it = results[t].find(sent[t][i]);
      if (it == results[t].end()) {
        EXPECT_EQ(status[t].error_code(), grpc::StatusCode::UNAVAILABLE) << "step " << i << " of stream " << t;
        refused_seen = true;
        continue;
      }
      EXPECT_TRUE(it->second.code() != 0 || !refused_seen)
          << "step " << i << " of stream " << t << " ran after an earlier one was refused or never read";
      const v1::StepResult& r = it->second;
      if (r.code() == 0) {
        ++ok;
        ++stream_ok;
        if (i % 8 == 0 || i == kSteps - 1) {
          EXPECT_TRUE(tracker.Check(r).ok()) << tracker.Check(r);
        }
      } else {
        EXPECT_EQ(r.code(), static_cast<int>(StatusCode::kUnavailable)) << r.message();
        refused_seen = true;
      }
    }
    EXPECT_GE(stream_ok, 10) << "stream " << t;
  }
  // The daemon counted exactly the steps that reached clients.
  const std::string log = daemon.Log();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, std::regex("drained in [0-9.]+s: ([0-9]+) steps completed"))) << log;
  EXPECT_EQ(std::stoi(m[1]), ok + probe_ok) << log;
}

TEST(LifecycleTest, StreamWhoseClientStopsReadingIsCancelled) {
  // 128 heads: 128 KiB of output per step, so unread results soon fill the flow-control
  // window and the server's write stays pending.
  Daemon daemon({"--num_layers=1", "--num_heads_q=128", "--stream_stall_timeout_s=1"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  auto stalled_seq = tracker.NewSequence({64});
  auto other = tracker.NewSequence({200});
  ASSERT_TRUE(stalled_seq.ok() && other.ok());

  auto stream = (*c)->OpenDecodeStream();
  constexpr int kSteps = 400;  // about 50 MiB of results
  int sent = 0;
  for (int i = 0; i < kSteps; i += 10) {
    v1::DecodeRequest req;
    for (int j = 0; j < 10; ++j) *req.add_steps() = tracker.Step(*stalled_seq, 0);
    // On a slow host the server may cancel the stream while this is still blocked in a
    // write (flow control): the write then fails, which is the cancellation below.
    if (!stream->Write(req)) break;
    sent += 10;
  }
  ASSERT_GT(sent, 0);
  // Read nothing. Within a few seconds the server gives up on the stream.
  const absl::Time deadline = absl::Now() + HangGuard(absl::Seconds(30));
  while (!absl::StrContains(daemon.Log(), "cancelled 1 Decode streams") && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(100));
  ASSERT_TRUE(absl::StrContains(daemon.Log(), "cancelled 1 Decode streams")) << daemon.Log();
  v1::DecodeResponse resp;
  int results = 0;
  while (stream->Read(&resp)) results += resp.results_size();
  EXPECT_LE(results, sent);
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);

  // Everyone else is served as before, and the stream's resources are gone.
  auto r = (*c)->DecodeAll({tracker.Step(*other, 0)});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(tracker.Check(r->begin()->second).ok()) << tracker.Check(r->begin()->second);
  auto info = (*c)->GetInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->sequences(), 2);
  EXPECT_TRUE(daemon.Running());
}

TEST(LifecycleTest, TakenPortFailsTheStart) {
  Daemon first;
  ASSERT_TRUE(first.Start()) << first.Log();
  Daemon second({"--listen=127.0.0.1:" + std::to_string(first.port())});
  EXPECT_FALSE(second.Start(absl::Seconds(30)));
  EXPECT_NE(second.Wait(absl::Seconds(30)), 0);
  EXPECT_NE(second.Log().find("--listen: cannot serve on"), std::string::npos) << second.Log();
  auto c = first.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
}

// --kv_dtype takes auto, the model dtype's own name or fp8_e4m3; anything else stops
// the start with a message naming the allowed values.
TEST(LifecycleTest, KvDtypeFlag) {
  struct Bad {
    std::vector<std::string> flags;
    std::string expect;
  };
  for (const Bad& b : {Bad{{"--kv_dtype=int8"}, "--kv_dtype: 'int8'; expected auto, bf16 (the model dtype) or fp8_e4m3"},
                       Bad{{"--dtype=fp16", "--kv_dtype=bf16"},
                           "--kv_dtype: 'bf16'; expected auto, fp16 (the model dtype) or fp8_e4m3"}}) {
    Daemon daemon(b.flags);
    EXPECT_FALSE(daemon.Start(absl::Seconds(30))) << b.expect;
    EXPECT_EQ(daemon.Wait(absl::Seconds(30)), 2) << b.expect << "\n" << daemon.Log();
    EXPECT_TRUE(absl::StrContains(daemon.Log(), b.expect)) << b.expect << "\n" << daemon.Log();
  }
  struct Good {
    std::vector<std::string> flags;
    std::string kv_dtype;
    int64_t bytes_per_token;
  };
  for (const Good& g : {Good{{"--kv_dtype=bf16", "--num_layers=2"}, "bf16", 2 * 1152},
                        Good{{"--dtype=fp16"}, "fp16", 1152},
                        Good{{"--kv_dtype=FP8_E4M3", "--num_layers=3", "--num_heads_q=32", "--num_heads_kv=2"},
                             "fp8_e4m3", 3 * 2 * 656}}) {
    Daemon daemon(g.flags);
    ASSERT_TRUE(daemon.Start()) << daemon.Log();
    auto c = daemon.Connect();
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ((*c)->info().kv_dtype(), g.kv_dtype);
    EXPECT_EQ((*c)->info().kv_bytes_per_token(), g.bytes_per_token);
    // The start-up line says which cache this is.
    EXPECT_TRUE(absl::StrContains(daemon.Log(), "kv dtype " + g.kv_dtype)) << daemon.Log();
  }
}

TEST(LifecycleTest, BearerTokenIsRequired) {
  Daemon daemon({"--auth_token=s3cret-token"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  client::ClientOptions none;
  EXPECT_EQ(daemon.Connect(none).status().code(), StatusCode::kUnauthenticated);
  client::ClientOptions wrong;
  wrong.auth_token = "s3cret-tokeN";
  auto w = daemon.Connect(wrong);
  EXPECT_EQ(w.status().code(), StatusCode::kUnauthenticated);
  EXPECT_TRUE(absl::StrContains(w.status().message(), "authorization")) << w.status();

  client::ClientOptions right;
  right.auth_token = "s3cret-token";
  auto c = daemon.Connect(right);
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  auto seq = tracker.NewSequence({80});
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto r = (*c)->DecodeAll({tracker.Step(*seq, 0), tracker.Step(*seq, 0, 2, true)});
  ASSERT_TRUE(r.ok()) << r.status();
  for (const auto& [id, res] : *r) EXPECT_TRUE(tracker.Check(res).ok()) << tracker.Check(res);

  // Every RPC without the header is refused (same channel, bare contexts).
  v1::DecodeService::Stub* stub = (*c)->stub();
  {
    grpc::ClientContext ctx;
    v1::CreateSequenceResponse resp;
    EXPECT_EQ(stub->CreateSequence(&ctx, v1::CreateSequenceRequest(), &resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    v1::ForkSequenceRequest req;
    req.set_sequence_id(*seq);
    v1::ForkSequenceResponse resp;
    EXPECT_EQ(stub->ForkSequence(&ctx, req, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    v1::ReleaseSequenceRequest req;
    req.set_sequence_id(*seq);
    v1::ReleaseSequenceResponse resp;
    EXPECT_EQ(stub->ReleaseSequence(&ctx, req, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    v1::AppendKvResponse resp;
    auto writer = stub->AppendKv(&ctx, &resp);
    v1::AppendKvRequest req;
    req.set_sequence_id(*seq);
    req.set_kv(tracker.RandomRows(1));
    writer->Write(req);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    auto rw = stub->Decode(&ctx);
    v1::DecodeRequest req;
    *req.add_steps() = tracker.Step(*seq, 0);
    rw->Write(req);
    rw->WritesDone();
    v1::DecodeResponse resp;
    EXPECT_FALSE(rw->Read(&resp));
    EXPECT_EQ(rw->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
    tracker.Refused(req.steps(0).request_id());
  }
  // Nothing refused changed the sequence.
  auto again = (*c)->DecodeAll({tracker.Step(*seq, 0)});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(tracker.Check(again->begin()->second).ok()) << tracker.Check(again->begin()->second);
  EXPECT_EQ(*(*c)->Health(), "SERVING");  // health probes need no token
}

void WriteFile(const std::string& path, const std::string& data) { std::ofstream(path) << data; }

TEST(LifecycleTest, TlsWithSelfSignedCertificate) {
  const std::string dir = TempDir("tls");
  std::string cert, key, error;
  ASSERT_TRUE(MakeSelfSignedCertificate(&cert, &key, &error)) << error;
  WriteFile(dir + "/cert.pem", cert);
  WriteFile(dir + "/key.pem", key);
  Daemon daemon({"--tls_cert=" + dir + "/cert.pem", "--tls_key=" + dir + "/key.pem", "--auth_token=tls-token"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  EXPECT_TRUE(absl::StrContains(daemon.Log(), "tls on")) << daemon.Log();

  client::ClientOptions plain;
  plain.auth_token = "tls-token";
  auto refused = client::Client::Connect([&] {
    plain.target = daemon.target();
    return plain;
  }(), absl::Seconds(1));
  EXPECT_FALSE(refused.ok()) << "a plaintext client reached a TLS server";

  client::ClientOptions tls;
  tls.auth_token = "tls-token";
  tls.tls = true;
  tls.tls_root_certs_pem = cert;
  tls.tls_server_name = "localhost";
  auto c = daemon.Connect(tls);
  ASSERT_TRUE(c.ok()) << c.status() << daemon.Log();
  Tracker tracker(c->get());
  auto seq = tracker.NewSequence({129});
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto r = (*c)->DecodeAll({tracker.Step(*seq, 0, 2, true)});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(tracker.Check(r->begin()->second).ok()) << tracker.Check(r->begin()->second);

  // A certificate the client does not trust fails the handshake.
  std::string other_cert, other_key;
  ASSERT_TRUE(MakeSelfSignedCertificate(&other_cert, &other_key, &error)) << error;
  client::ClientOptions untrusted = tls;
  untrusted.tls_root_certs_pem = other_cert;
  untrusted.target = daemon.target();
  EXPECT_FALSE(client::Client::Connect(untrusted, absl::Seconds(1)).ok());
}

}  // namespace
}  // namespace latentd::testing
