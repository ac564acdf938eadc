// Every error status of the API, end to end against the real daemon: each names the
// field and what was expected; a bad step fails alone while its stream goes on; bad
// input leaves other sequences (and the daemon) untouched.
#include <gtest/gtest.h>

#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/integration/daemon.h"
#include "tests/integration/tracker.h"

namespace latentd::testing {
namespace {

using absl::StatusCode;

// The status has the code and its message mentions the text.
#define EXPECT_ERROR(expr, want_code, want_text)                                                   \
  do {                                                                                             \
    const absl::Status st_ = (expr);                                                               \
    EXPECT_EQ(st_.code(), want_code) << #expr << ": " << st_;                                     \
    EXPECT_TRUE(absl::StrContains(st_.message(), want_text))                                       \
        << #expr << ": '" << st_.message() << "' does not mention '" << want_text << "'";          \
  } while (0)

class ErrorsTest : public ::testing::Test {
 protected:
  void StartDaemon(std::vector<std::string> flags) {
    daemon_ = std::make_unique<Daemon>(std::move(flags));
    ASSERT_TRUE(daemon_->Start()) << daemon_->Log();
    auto c = daemon_->Connect(options_);
    ASSERT_TRUE(c.ok()) << c.status() << daemon_->Log();
    client_ = std::move(*c);
    tracker_ = std::make_unique<Tracker>(client_.get());
  }
  void TearDown() override {
    if (daemon_ != nullptr) {
      EXPECT_TRUE(daemon_->Running()) << "the daemon died:\n" << daemon_->Log();
    }
  }

  client::ClientOptions options_;
  std::unique_ptr<Daemon> daemon_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<Tracker> tracker_;
};

TEST_F(ErrorsTest, UnaryAndAppendKvErrorsNameTheField) {
  StartDaemon({"--num_layers=2"});
  client::Client& c = *client_;
  auto good = tracker_->NewSequence({70, 5}, "good-seq");
  ASSERT_TRUE(good.ok()) << good.status();

  // INVALID_ARGUMENT: malformed ids, layers, byte sizes, empty streams.
  EXPECT_ERROR(c.CreateSequence("has space").status(), StatusCode::kInvalidArgument, "sequence_id");
  EXPECT_ERROR(c.CreateSequence(std::string(129, 'a')).status(), StatusCode::kInvalidArgument, "sequence_id");
  EXPECT_ERROR(c.ForkSequence("").status(), StatusCode::kInvalidArgument, "sequence_id");
  EXPECT_ERROR(c.ForkSequence(*good, "bad/id").status(), StatusCode::kInvalidArgument, "new_sequence_id");
  EXPECT_ERROR(c.ReleaseSequence("").status(), StatusCode::kInvalidArgument, "sequence_id");
  const std::string row = tracker_->RandomRows(1);
  EXPECT_ERROR(c.AppendKv(*good, 2, row).status(), StatusCode::kInvalidArgument, "layer");
  EXPECT_ERROR(c.AppendKv(*good, -1, row).status(), StatusCode::kInvalidArgument, "layer");
  EXPECT_ERROR(c.AppendKv(*good, 0, row.substr(0, 1000)).status(), StatusCode::kInvalidArgument, "kv");
  EXPECT_ERROR(c.AppendKv("", 0, row).status(), StatusCode::kInvalidArgument, "sequence_id");
  EXPECT_ERROR(c.AppendKvLayers(*good, {}).status(), StatusCode::kInvalidArgument, "no messages");
  {
    // A second message naming another sequence: the first one was applied on arrival,
    // and the error says so.
    grpc::ClientContext ctx;
    c.Prepare(&ctx);
    v1::AppendKvResponse resp;
    auto w = c.stub()->AppendKv(&ctx, &resp);
    v1::AppendKvRequest req;
    req.set_sequence_id(*good);
    req.set_kv(row);
    w->Write(req);
    req.set_sequence_id("other-seq");
    w->Write(req);
    w->WritesDone();
    EXPECT_ERROR(client::ToAbsl(w->Finish()), StatusCode::kInvalidArgument, "sequence_id");
    tracker_->Appended(*good, 0, row);
  }

  // NOT_FOUND.
  EXPECT_ERROR(c.ReleaseSequence("no-such-seq").status(), StatusCode::kNotFound, "no-such-seq");
  EXPECT_ERROR(c.ForkSequence("no-such-seq").status(), StatusCode::kNotFound, "no-such-seq");
  EXPECT_ERROR(c.AppendKv("no-such-seq", 0, row).status(), StatusCode::kNotFound, "no-such-seq");

  // An upload of no rows still answers with the sequence's lengths, and NOT_FOUND for
  // an unknown sequence (it once returned OK with no lengths at all).
  {
    grpc::ClientContext ctx;
    c.Prepare(&ctx);
    v1::AppendKvResponse resp;
    auto w = c.stub()->AppendKv(&ctx, &resp);
    v1::AppendKvRequest req;
    req.set_sequence_id(*good);
    w->Write(req);
    w->WritesDone();
    ASSERT_TRUE(w->Finish().ok());
    EXPECT_EQ(resp.tokens_appended(), 0);
    ASSERT_EQ(resp.lengths_size(), 2);
    EXPECT_EQ(resp.lengths(0), 71);
    EXPECT_EQ(resp.lengths(1), 5);
  }
  {
    grpc::ClientContext ctx;
    c.Prepare(&ctx);
    v1::AppendKvResponse resp;
    auto w = c.stub()->AppendKv(&ctx, &resp);
    v1::AppendKvRequest req;
    req.set_sequence_id("no-such-seq");
    w->Write(req);
    w->WritesDone();
    EXPECT_ERROR(client::ToAbsl(w->Finish()), StatusCode::kNotFound, "no-such-seq");
  }

  // ALREADY_EXISTS.
  EXPECT_ERROR(c.CreateSequence("good-seq").status(), StatusCode::kAlreadyExists, "good-seq");
  ASSERT_TRUE(c.CreateSequence("taken").ok());
  EXPECT_ERROR(c.ForkSequence(*good, "taken").status(), StatusCode::kAlreadyExists, "taken");

  // None of the refused calls touched the good sequence: its results are as uploaded.
  auto info = c.GetInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->sequences(), 2);
  auto results = c.DecodeAll({tracker_->Step(*good, 0), tracker_->Step(*good, 1, 2, true)});
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 2u);
  for (const auto& [id, r] : *results) EXPECT_TRUE(tracker_->Check(r).ok()) << tracker_->Check(r);
}

TEST_F(ErrorsTest, AppendKvNeverEchoesAClientsIdBytes) {
  StartDaemon({"--num_layers=1"});
  client::Client& c = *client_;
  auto good = tracker_->NewSequence({3}, "echo-seq");
  ASSERT_TRUE(good.ok()) << good.status();
  const std::string row = tracker_->RandomRows(1);
  // Later messages with control characters, an 8 KiB id, and a well-formed other id.
  const std::string evil_ids[] = {std::string("ab\r\nx-injected: 1\x01\x7f", 19), std::string(8192, 'z'),
                                  "other-seq"};
  for (const std::string& evil : evil_ids) {
    grpc::ClientContext ctx;
    c.Prepare(&ctx);
    v1::AppendKvResponse resp;
    auto w = c.stub()->AppendKv(&ctx, &resp);
    v1::AppendKvRequest req;
    req.set_sequence_id(*good);
    req.set_kv(row);
    w->Write(req);
    req.set_sequence_id(evil);
    w->Write(req);
    w->WritesDone();
    const grpc::Status st = w->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), "sequence_id")) << st.error_message();
    EXPECT_FALSE(absl::StrContains(st.error_message(), evil)) << "the id was echoed: " << st.error_message();
    EXPECT_LT(st.error_message().size(), 400u) << st.error_message();
    for (char ch : st.error_message()) EXPECT_TRUE(absl::ascii_isprint(static_cast<unsigned char>(ch)));
    tracker_->Appended(*good, 0, row);
  }
}

TEST_F(ErrorsTest, GetSequenceResyncsAfterABrokenStream) {
  StartDaemon({"--num_layers=2", "--max_steps_per_message=8"});
  client::Client& c = *client_;
  auto seq = tracker_->NewSequence({100, 30});
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto info = c.GetSequence(*seq);
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->lengths_size(), 2);
  EXPECT_EQ(info->lengths(0), 100);
  EXPECT_EQ(info->lengths(1), 30);
  EXPECT_EQ(info->pages(), 2);  // 100 rows of the longest layer: two 64-token pages
  // A stream whose first message runs and whose second is refused whole: the client
  // learns from GetSequence which rows the first one appended.
  auto stream = c.OpenDecodeStream();
  v1::DecodeRequest first;
  *first.add_steps() = tracker_->Step(*seq, 0);
  *first.add_steps() = tracker_->Step(*seq, 1, 2);
  ASSERT_TRUE(stream->Write(first));
  v1::DecodeRequest too_many;
  for (int i = 0; i < 9; ++i) too_many.add_steps()->set_sequence_id(*seq);
  stream->Write(too_many);
  stream->WritesDone();
  v1::DecodeResponse resp;
  int ok = 0;
  while (stream->Read(&resp)) {
    for (const auto& r : resp.results()) {
      EXPECT_TRUE(tracker_->Check(r).ok()) << tracker_->Check(r);
      ++ok;
    }
  }
  const grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "--max_steps_per_message")) << st.error_message();
  EXPECT_EQ(ok, 2) << "the accepted steps' results are delivered before the stream ends";
  info = c.GetSequence(*seq);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->lengths(0), 101);
  EXPECT_EQ(info->lengths(1), 32);
  EXPECT_ERROR(c.GetSequence("no-such-seq").status(), StatusCode::kNotFound, "sequence_id");
  EXPECT_ERROR(c.GetSequence("bad id").status(), StatusCode::kInvalidArgument, "sequence_id");
}

TEST_F(ErrorsTest, LiveSequencesAreBounded) {
  StartDaemon({"--num_layers=1", "--max_sequences=3"});
  client::Client& c = *client_;
  auto a = c.CreateSequence();
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(c.CreateSequence().ok());
  ASSERT_TRUE(c.ForkSequence(*a).ok());
  EXPECT_ERROR(c.CreateSequence().status(), StatusCode::kResourceExhausted, "max_sequences");
  EXPECT_ERROR(c.ForkSequence(*a).status(), StatusCode::kResourceExhausted, "max_sequences");
  ASSERT_TRUE(c.ReleaseSequence(*a).ok());
  EXPECT_TRUE(c.CreateSequence().ok());
}

TEST_F(ErrorsTest, BadStepsFailAloneAndTheStreamGoesOn) {
  StartDaemon({"--num_layers=2", "--max_s_q=4"});
  auto seq = tracker_->NewSequence({100, 3});
  ASSERT_TRUE(seq.ok()) << seq.status();
  const client::Shape& sh = client_->shape();

  std::vector<v1::DecodeStep> steps;
  std::map<uint64_t, std::pair<StatusCode, std::string>> bad;  // request id -> expected error
  auto add_bad = [&](v1::DecodeStep s, uint64_t id, StatusCode code, const std::string& text) {
    s.set_request_id(id);
    bad[id] = {code, text};
    steps.push_back(std::move(s));
  };
  steps.push_back(tracker_->Step(*seq, 0));
  v1::DecodeStep proto = steps.back();  // a valid shape to break in one field at a time
  v1::DecodeStep s = proto;
  s.mutable_q()->resize(sh.q_row_bytes - 2);
  add_bad(s, 1001, StatusCode::kInvalidArgument, "q:");
  s = proto;
  s.mutable_q()->clear();
  add_bad(s, 1002, StatusCode::kInvalidArgument, "q:");
  s = proto;
  s.set_q(std::string(size_t(sh.QBytes(5)), '\0'));  // s_q 5 > --max_s_q
  s.set_kv(std::string(size_t(sh.KvBytes(5)), '\0'));
  add_bad(s, 1003, StatusCode::kInvalidArgument, "s_q <= 4");
  s = proto;
  s.mutable_kv()->append(std::string(size_t(sh.kv_row_bytes), '\0'));  // 2 rows for s_q 1
  add_bad(s, 1004, StatusCode::kInvalidArgument, "kv:");
  s = proto;
  s.set_layer(2);
  add_bad(s, 1005, StatusCode::kInvalidArgument, "layer");
  s = proto;
  s.set_layer(-3);
  add_bad(s, 1006, StatusCode::kInvalidArgument, "layer");
  s = proto;
  s.clear_sequence_id();
  add_bad(s, 1007, StatusCode::kInvalidArgument, "sequence_id");
  s = proto;
  s.set_sequence_id("bad id\n");
  add_bad(s, 1008, StatusCode::kInvalidArgument, "sequence_id");
  s = proto;
  s.set_sequence_id("never-created");
  add_bad(s, 1009, StatusCode::kNotFound, "never-created");
  steps.push_back(tracker_->Step(*seq, 1, 2, true));
  steps.push_back(tracker_->Step(*seq, 0, 3, true));

  // One message holds them all; then a second message on the same stream still works.
  auto stream = client_->OpenDecodeStream();
  v1::DecodeRequest req;
  for (const auto& st : steps) *req.add_steps() = st;
  ASSERT_TRUE(stream->Write(req));
  std::map<uint64_t, v1::StepResult> got;
  v1::DecodeResponse resp;
  while (got.size() < steps.size() && stream->Read(&resp)) {
    for (const auto& r : resp.results()) got[r.request_id()] = r;
  }
  req.Clear();
  *req.add_steps() = tracker_->Step(*seq, 0);
  const uint64_t last = req.steps(0).request_id();
  ASSERT_TRUE(stream->Write(req));
  ASSERT_TRUE(stream->Read(&resp));
  for (const auto& r : resp.results()) got[r.request_id()] = r;
  stream->WritesDone();
  while (stream->Read(&resp)) {
  }
  EXPECT_TRUE(stream->Finish().ok());

  ASSERT_EQ(got.size(), steps.size() + 1);
  for (const auto& [id, r] : got) {
    auto it = bad.find(id);
    if (it == bad.end()) {
      EXPECT_TRUE(tracker_->Check(r).ok()) << tracker_->Check(r);
    } else {
      EXPECT_EQ(r.code(), static_cast<int>(it->second.first)) << id << ": " << r.message();
      EXPECT_TRUE(absl::StrContains(r.message(), it->second.second))
          << id << ": '" << r.message() << "' does not mention '" << it->second.second << "'";
      EXPECT_TRUE(r.out().empty());
    }
  }
  EXPECT_EQ(got[last].code(), 0);
}

TEST_F(ErrorsTest, PoolExhaustionFailsOnlyWhatNeedsPages) {
  // 8 pages of 64 tokens; A holds 2, B asks for 7.
  StartDaemon({"--num_layers=1", "--kv_pages=8"});
  auto a = tracker_->NewSequence({100});
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = tracker_->NewSequence({0});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_ERROR(client_->AppendKv(*b, 0, tracker_->RandomRows(7 * 64)).status(), StatusCode::kResourceExhausted,
               "");
  auto info = client_->GetInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->free_pages(), 6) << "a refused AppendKv must not hold pages";
  // B fills the pool exactly (all or nothing, so the reference sees these rows).
  const std::string rows = tracker_->RandomRows(6 * 64);
  auto filled = client_->AppendKv(*b, 0, rows);
  ASSERT_TRUE(filled.ok()) << filled.status();
  tracker_->reference().Append(*b, 0, rows);
  EXPECT_EQ(filled->lengths(0), 6 * 64);

  // In one request: B's step needs a new page (refused), A's fits in its page (runs).
  v1::DecodeStep on_b = tracker_->Step(*b, 0);
  v1::DecodeStep on_a = tracker_->Step(*a, 0);
  auto results = client_->DecodeAll({on_b, on_a});
  ASSERT_TRUE(results.ok()) << results.status();
  const v1::StepResult& rb = (*results)[on_b.request_id()];
  EXPECT_EQ(rb.code(), static_cast<int>(StatusCode::kResourceExhausted)) << rb.message();
  tracker_->Refused(on_b.request_id());
  EXPECT_TRUE(tracker_->Check((*results)[on_a.request_id()]).ok()) << tracker_->Check((*results)[on_a.request_id()]);

  // Releasing B gives its pages back; both sequences then work.
  auto freed = client_->ReleaseSequence(*b);
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 6);
  auto after = client_->DecodeAll({tracker_->Step(*a, 0, 2, true)});
  ASSERT_TRUE(after.ok());
  for (const auto& [id, r] : *after) EXPECT_TRUE(tracker_->Check(r).ok()) << tracker_->Check(r);
}

TEST_F(ErrorsTest, FullQueueRefusesStepsWithoutTouchingTheirSequences) {
  // A tiny queue behind a slow batch (long prefixes, many heads): most of a burst is
  // refused at once with RESOURCE_EXHAUSTED, the rest runs correctly.
  StartDaemon({"--num_layers=1", "--num_heads_q=64", "--max_queue=2", "--batch_window_us=0", "--max_batch_size=4"});
  constexpr int kSeqs = 24;
  std::vector<std::string> seqs;
  for (int i = 0; i < kSeqs; ++i) {
    auto s = tracker_->NewSequence({1500});
    ASSERT_TRUE(s.ok()) << s.status();
    seqs.push_back(*s);
  }
  std::vector<v1::DecodeStep> burst;
  for (const auto& s : seqs) burst.push_back(tracker_->Step(s, 0));
  auto results = client_->DecodeAll(burst, kSeqs);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), size_t{kSeqs});
  int refused = 0;
  for (const auto& [id, r] : *results) {
    if (r.code() == static_cast<int>(StatusCode::kResourceExhausted)) {
      ++refused;
      EXPECT_TRUE(absl::StrContains(absl::AsciiStrToLower(r.message()), "queue")) << r.message();
      tracker_->Refused(id);
    } else {
      EXPECT_TRUE(tracker_->Check(r).ok()) << tracker_->Check(r);
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_LT(refused, kSeqs);
  // Every sequence, refused or not, is consistent afterwards.
  std::vector<v1::DecodeStep> again;
  for (const auto& s : seqs) again.push_back(tracker_->Step(s, 0));
  for (const auto& step : again) {
    auto r = client_->DecodeAll({step});
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(tracker_->Check(r->begin()->second).ok()) << tracker_->Check(r->begin()->second);
  }
}

TEST_F(ErrorsTest, OversizedMessagesAreRefused) {
  options_.append_chunk_bytes = 2 << 20;
  StartDaemon({"--num_layers=1", "--max_message_bytes=1048576"});
  auto seq = tracker_->NewSequence({64});
  ASSERT_TRUE(seq.ok()) << seq.status();
  // 2 MiB of rows in one AppendKv message.
  const std::string rows = tracker_->RandomRows((2 << 20) / client_->shape().kv_row_bytes);
  EXPECT_ERROR(client_->AppendKv(*seq, 0, rows).status(), StatusCode::kResourceExhausted, "");
  // A Decode message over the limit ends that stream, not the daemon.
  std::vector<v1::DecodeStep> big;
  for (int i = 0; i < 60; ++i) big.push_back(tracker_->Step(*seq, 0));  // 60 * ~19 KiB
  auto r = client_->DecodeAll(big, 60);
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status();
  // The sequence is unchanged: a fresh step sees only the 64 prefix rows plus itself.
  for (const auto& s : big) tracker_->Refused(s.request_id());
  auto ok = client_->DecodeAll({tracker_->Step(*seq, 0)});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(tracker_->Check(ok->begin()->second).ok()) << tracker_->Check(ok->begin()->second);
}

}  // namespace
}  // namespace latentd::testing
