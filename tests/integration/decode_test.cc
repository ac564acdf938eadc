// End-to-end correctness: the real daemon (CPU backend) driven by the C++ client from
// many threads, every result checked against the CPU implementation: several layers,
// s_q 1 and 2 (causal and not), h_q 16 and 32, varied prefixes, forked sequences, and
// an fp8 KV cache (checked against the rows quantized and dequantized as the server
// stores them).
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "clients/cpp/client.h"
#include "clients/cpp/reference.h"
#include "tests/integration/daemon.h"
#include "tests/integration/tracker.h"

namespace latentd::testing {
namespace {

struct Shape {
  int layers, h_q, h_kv;
  const char* dtype;
  int threads;
  const char* kv_dtype = "auto";  // --kv_dtype
};

void PrintTo(const Shape& s, std::ostream* os) {
  *os << "layers " << s.layers << " h_q " << s.h_q << " h_kv " << s.h_kv << " " << s.dtype << ", kv " << s.kv_dtype
      << ", " << s.threads << " threads";
}

// Steps one thread sends per round, and rounds (a fork happens after the first).
constexpr int kStepsPerRound = 12;
constexpr int kRounds = 3;

class DecodeTest : public ::testing::TestWithParam<Shape> {};

TEST_P(DecodeTest, ResultsMatchCpuImplementation) {
  const Shape shape = GetParam();
  Daemon daemon({absl::StrCat("--num_layers=", shape.layers), absl::StrCat("--num_heads_q=", shape.h_q),
                 absl::StrCat("--num_heads_kv=", shape.h_kv), absl::StrCat("--dtype=", shape.dtype),
                 absl::StrCat("--kv_dtype=", shape.kv_dtype), "--kv_pages=4096", "--batch_window_us=200"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  // Two channels, so streams share connections in different ways.
  auto c1 = daemon.Connect();
  auto c2 = daemon.Connect();
  ASSERT_TRUE(c1.ok() && c2.ok()) << daemon.Log();
  const v1::ServerInfo info = (*c1)->info();
  ASSERT_EQ(info.num_layers(), shape.layers);
  ASSERT_EQ(info.num_heads_q(), shape.h_q);
  ASSERT_EQ(info.num_heads_kv(), shape.h_kv);
  const bool fp8 = std::string(shape.kv_dtype) == "fp8_e4m3";
  EXPECT_EQ(info.kv_dtype(), fp8 ? "fp8_e4m3" : shape.dtype);
  EXPECT_EQ(info.kv_bytes_per_token(), int64_t{shape.layers} * shape.h_kv * (fp8 ? 656 : 1152));
  const kernels::DType dtype = client::DTypeOf(info);
  // The reference mirrors what the server stores (fp8: quantized, then dequantized).
  ASSERT_EQ(client::KvDTypeOf(info), fp8 ? kernels::KvDType::kFp8E4M3 : kernels::KvDType::kModel);
  client::Reference ref(info, 1);
  const client::Shape sz((*c1)->info());

  std::vector<std::string> failures(shape.threads);
  std::vector<int> checked(shape.threads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < shape.threads; ++t) {
    threads.emplace_back([&, t] {
      client::Client* c = (t % 2 == 0 ? *c1 : *c2).get();
      std::string& fail = failures[t];
      std::mt19937_64 rng(1000 + t);
      const int prefixes[] = {0, 1, 63, 64, 65, 130, 257, 700};
      std::vector<std::string> seqs;
      std::map<std::pair<std::string, int>, int64_t> length;
      for (int i = 0; i < 2; ++i) {
        auto id = c->CreateSequence(i == 0 ? absl::StrCat("thread-", t, "-seq-", i) : "");
        if (!id.ok()) {
          fail = id.status().ToString();
          return;
        }
        seqs.push_back(*id);
        std::vector<std::string> rows(shape.layers);
        std::vector<absl::string_view> views(shape.layers);
        for (int l = 0; l < shape.layers; ++l) {
          const int n = prefixes[rng() % 8];
          rows[l] = client::RandomHalves(rng, size_t(n) * shape.h_kv * 576, dtype);
          views[l] = rows[l];
          ref.Append(*id, l, rows[l]);
          length[{*id, l}] = n;
        }
        auto appended = c->AppendKvLayers(*id, views);
        if (!appended.ok()) {
          fail = "AppendKv: " + appended.status().ToString();
          return;
        }
        for (int l = 0; l < shape.layers; ++l) {
          if (appended->lengths(l) != length[{*id, l}]) {
            fail = absl::StrCat("AppendKv lengths[", l, "] = ", appended->lengths(l), ", expected ",
                                length[{*id, l}]);
            return;
          }
        }
      }
      auto stream = c->OpenDecodeStream();
      uint64_t next_id = uint64_t(t) << 32;
      for (int round = 0; round < kRounds && fail.empty(); ++round) {
        if (round == 1) {
          // Fork mid-page; both sequences then grow apart.
          auto fork = c->ForkSequence(seqs[0], absl::StrCat("thread-", t, "-fork"));
          if (!fork.ok()) {
            fail = "ForkSequence: " + fork.status().ToString();
            break;
          }
          ref.Fork(seqs[0], *fork);
          for (int l = 0; l < shape.layers; ++l) length[{*fork, l}] = length[{seqs[0], l}];
          seqs.push_back(*fork);
        }
        struct Sent {
          std::string seq;
          int layer, s_q;
          bool causal;
          int64_t end;
          std::string q;
        };
        std::map<uint64_t, Sent> sent;
        v1::DecodeRequest req;
        for (int k = 0; k < kStepsPerRound; ++k) {
          Sent s;
          s.seq = seqs[rng() % seqs.size()];
          s.layer = static_cast<int>(rng() % shape.layers);
          s.s_q = 1 + static_cast<int>(rng() % 2);
          s.causal = s.s_q == 2 && rng() % 4 != 0;
          s.q = client::RandomHalves(rng, size_t(sz.QBytes(s.s_q) / 2), dtype);
          std::string kv = client::RandomHalves(rng, size_t(sz.KvBytes(s.s_q) / 2), dtype);
          ref.Append(s.seq, s.layer, kv);
          s.end = (length[{s.seq, s.layer}] += s.s_q);
          v1::DecodeStep* step = req.add_steps();
          step->set_request_id(next_id);
          step->set_sequence_id(s.seq);
          step->set_layer(s.layer);
          step->set_q(s.q);
          step->set_kv(kv);
          step->set_causal(s.causal);
          sent[next_id++] = std::move(s);
          // Messages of 1 to 4 steps.
          if (req.steps_size() >= 1 + static_cast<int>(rng() % 4) || k + 1 == kStepsPerRound) {
            if (!stream->Write(req)) {
              fail = "stream closed while writing";
              break;
            }
            req.Clear();
          }
        }
        size_t received = 0;
        v1::DecodeResponse resp;
        while (fail.empty() && received < sent.size() && stream->Read(&resp)) {
          for (const v1::StepResult& r : resp.results()) {
            ++received;
            auto it = sent.find(r.request_id());
            if (it == sent.end()) {
              fail = absl::StrCat("unexpected request_id ", r.request_id());
              break;
            }
            const Sent& s = it->second;
            absl::Status st = ref.Check(s.seq, s.layer, s.end, s.q, s.s_q, s.causal, r);
            if (!st.ok()) {
              fail = absl::StrCat("step ", r.request_id(), " (", s.seq, " layer ", s.layer, " s_q ", s.s_q,
                                  s.causal ? " causal" : "", " keys ", s.end, "): ", st.ToString());
              break;
            }
            ++checked[t];
          }
        }
        if (fail.empty() && received != sent.size()) {
          fail = absl::StrCat("got ", received, " results for ", sent.size(), " steps");
        }
      }
      stream->WritesDone();
      v1::DecodeResponse drain;
      while (stream->Read(&drain)) {
      }
      grpc::Status st = stream->Finish();
      if (fail.empty() && !st.ok()) fail = "stream status: " + st.error_message();
      for (const auto& s : seqs) {
        auto freed = c->ReleaseSequence(s);
        if (fail.empty() && !freed.ok()) fail = "ReleaseSequence: " + freed.status().ToString();
      }
    });
  }
  for (auto& t : threads) t.join();
  int total = 0;
  for (int t = 0; t < shape.threads; ++t) {
    EXPECT_EQ(failures[t], "") << "thread " << t;
    total += checked[t];
  }
  EXPECT_EQ(total, shape.threads * kRounds * kStepsPerRound);
  // Everything released: the pool is whole again.
  auto after = (*c1)->GetInfo();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->free_pages(), after->total_pages());
  EXPECT_EQ(after->sequences(), 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, DecodeTest,
                         ::testing::Values(Shape{3, 16, 1, "bf16", 8}, Shape{2, 32, 1, "bf16", 4},
                                           Shape{2, 32, 2, "fp16", 3}, Shape{3, 16, 1, "bf16", 4, "fp8_e4m3"},
                                           Shape{2, 32, 2, "fp16", 3, "fp8_e4m3"}),
                         [](const ::testing::TestParamInfo<Shape>& p) {
                           return absl::StrCat("layers", p.param.layers, "_hq", p.param.h_q, "_hkv", p.param.h_kv,
                                               "_", p.param.dtype, "_kv_", p.param.kv_dtype);
                         });

}  // namespace
}  // namespace latentd::testing

namespace latentd::testing {
namespace {

// A stream that sends far more than --max_stream_inflight: the server pauses reading it
// (gRPC flow control holds the client back) and resumes as results drain; nothing is
// lost, reordered within a (sequence, layer), or wrong.
TEST(DecodeFlowControlTest, StreamBeyondItsInflightLimit) {
  Daemon daemon({"--num_layers=2", "--max_stream_inflight=3"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  std::vector<std::string> seqs;
  for (int i = 0; i < 4; ++i) {
    auto s = tracker.NewSequence({50 * i, 7});
    ASSERT_TRUE(s.ok()) << s.status();
    seqs.push_back(*s);
  }
  std::vector<v1::DecodeStep> steps;
  for (int i = 0; i < 80; ++i) steps.push_back(tracker.Step(seqs[i % 4], (i / 4) % 2, 1 + i % 2, i % 3 == 0));
  auto results = (*c)->DecodeAll(steps, 1);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), steps.size());
  for (const auto& [id, r] : *results) EXPECT_TRUE(tracker.Check(r).ok()) << tracker.Check(r);
}

// Steps' inputs take the path the flags ask for, as the server counts it: into the
// stream's pinned-input buffer with --pinned_step_inputs=always (or auto on a CUDA
// engine), not at all with off or auto on the CPU engine (which registers no memory),
// and read by the device in place only where the engine registered that buffer.
TEST(DecodeInputPathTest, StepsTakeThePathTheFlagsAsk) {
  const std::string extra = std::getenv("LATENTD_DAEMON_FLAGS") != nullptr ? std::getenv("LATENTD_DAEMON_FLAGS") : "";
  const auto has = [&](const char* flag) { return extra.find(flag) != std::string::npos; };
  const bool cuda = has("--backend=cuda");
  const bool pinned =
      has("--pinned_step_inputs=always") || (cuda && !has("--pinned_step_inputs=off"));
  Daemon daemon({"--num_layers=2"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  std::vector<std::string> seqs;
  for (int i = 0; i < 3; ++i) {
    auto s = tracker.NewSequence({40 + 30 * i, 9});
    ASSERT_TRUE(s.ok()) << s.status();
    seqs.push_back(*s);
  }
  // Six messages of four steps, each answered before the next is sent, so the stream
  // reuses its slots (and their pinned buffers) instead of opening new ones.
  constexpr int kMessages = 6, kSteps = 4;
  auto stream = (*c)->OpenDecodeStream();
  for (int m = 0; m < kMessages; ++m) {
    v1::DecodeRequest req;
    for (int i = 0; i < kSteps; ++i) *req.add_steps() = tracker.Step(seqs[(m + i) % 3], m % 2, 2, i % 2 == 0);
    ASSERT_TRUE(stream->Write(req));
    v1::DecodeResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    ASSERT_EQ(resp.results_size(), kSteps);
    for (const v1::StepResult& r : resp.results()) ASSERT_TRUE(tracker.Check(r).ok()) << tracker.Check(r);
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  const uint64_t total = kMessages * kSteps;
  auto info = (*c)->GetInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->steps_completed(), total);
  if (pinned) {
    // A slot's first step is read the ordinary way while its buffer is made, so the
    // first message's steps are not counted; reused slots' steps are.
    EXPECT_GE(info->steps_inputs_pinned(), total / 2) << extra;
    EXPECT_LE(info->steps_inputs_pinned(), total - kSteps) << extra;
  } else {
    EXPECT_EQ(info->steps_inputs_pinned(), 0u) << extra;
  }
  if (cuda) {
    EXPECT_EQ(info->steps_inputs_device_direct(), info->steps_inputs_pinned()) << extra;
  } else {
    EXPECT_EQ(info->steps_inputs_device_direct(), 0u) << extra;
  }
}

// One DecodeRequest is one unit: its results (an invalid step's included) come back in
// one response once all are answered, and traced steps carry the server's timestamps
// in order.
TEST(DecodeMessageTest, ResultsOfAMessageComeBackTogether) {
  Daemon daemon({"--num_layers=2", "--batch_window_us=0"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  std::vector<std::string> seqs;
  for (int i = 0; i < 12; ++i) {
    auto s = tracker.NewSequence({30 + 20 * i, 5 + i});
    ASSERT_TRUE(s.ok()) << s.status();
    seqs.push_back(*s);
  }
  auto stream = (*c)->OpenDecodeStream();
  for (int round = 0; round < 3; ++round) {
    v1::DecodeRequest req;
    for (int i = 0; i < 12; ++i) {
      *req.add_steps() = tracker.Step(seqs[i], round % 2, 1 + (i % 2), i % 3 == 0);
      req.mutable_steps(i)->set_trace(true);
    }
    v1::DecodeStep* bad = req.add_steps();  // answered at once, but sent with the rest
    bad->set_request_id(999000 + round);
    bad->set_sequence_id(seqs[0]);
    bad->set_layer(7);
    ASSERT_TRUE(stream->Write(req));
    v1::DecodeResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    ASSERT_EQ(resp.results_size(), 13) << "round " << round << ": the message's results were split";
    for (const v1::StepResult& r : resp.results()) {
      if (r.request_id() == 999000u + round) {
        EXPECT_EQ(r.code(), 3) << r.message();
        EXPECT_NE(r.message().find("layer"), std::string::npos) << r.message();
        continue;
      }
      ASSERT_TRUE(tracker.Check(r).ok()) << tracker.Check(r);
      ASSERT_TRUE(r.has_timing());
      const v1::StepTiming& t = r.timing();
      const int64_t stamps[] = {t.received_us(), t.parsed_us(),   t.submitted_us(), t.batched_us(),
                                t.launched_us(), t.finished_us(), t.completed_us(), t.response_us()};
      for (int k = 0; k < 8; ++k) EXPECT_GT(stamps[k], 0) << "stamp " << k;
      for (int k = 1; k < 8; ++k) EXPECT_LE(stamps[k - 1], stamps[k]) << "stamp " << k;
    }
  }
  stream->WritesDone();
  v1::DecodeResponse extra;
  EXPECT_FALSE(stream->Read(&extra));
  EXPECT_TRUE(stream->Finish().ok());
}

}  // namespace
}  // namespace latentd::testing
