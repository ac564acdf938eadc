// The drain's ending: its last log line counts the accepted steps delivered and not
// delivered, the exit code is 0 only for a clean drain, and a second SIGTERM/SIGINT
// during a drain ends the daemon at once with 128 + the signal.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <regex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/integration/daemon.h"
#include "tests/integration/tracker.h"

namespace latentd::testing {
namespace {

std::string LastLine(const std::string& log) {
  std::vector<std::string> lines = absl::StrSplit(log, '\n', absl::SkipEmpty());
  return lines.empty() ? "" : lines.back();
}

bool WaitForLog(Daemon& daemon, absl::string_view text, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + HangGuard(timeout);
  while (absl::Now() < deadline) {
    if (absl::StrContains(daemon.Log(), text)) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

// A drain held open by a stream whose client reads nothing (its results cannot all be
// written), then a second signal. "At once" is measured against what ignoring the signal
// would take, the whole 120 s drain: the bound, HangGuard(5 s), is 5 s in a plain build
// and 50 s under TSan, where a loaded 2-core machine can take seconds to log and exit.
void SecondSignalExitsAtOnce(int first, int second) {
  Daemon daemon({"--num_layers=1", "--num_heads_q=128", "--stream_stall_timeout_s=0", "--drain_timeout_s=120"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  auto seq = tracker.NewSequence({64});
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto stream = (*c)->OpenDecodeStream();
  for (int i = 0; i < 400; i += 10) {  // about 50 MiB of results, far beyond flow control
    v1::DecodeRequest req;
    for (int j = 0; j < 10; ++j) *req.add_steps() = tracker.Step(*seq, 0);
    ASSERT_TRUE(stream->Write(req));
  }
  daemon.Signal(first);
  ASSERT_TRUE(WaitForLog(daemon, "draining", absl::Seconds(10))) << daemon.Log();
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(daemon.Running()) << "the drain ended before the second signal:\n" << daemon.Log();

  const absl::Time sent = absl::Now();
  daemon.Signal(second);
  EXPECT_EQ(daemon.Wait(absl::Seconds(10)), 128 + second) << daemon.Log();
  EXPECT_LT(absl::Now() - sent, HangGuard(absl::Seconds(5)));
  static_assert(kSanitizerSlowdown * 5 < 120, "the bound must stay below the drain it tells apart from");
  EXPECT_TRUE(absl::StrContains(LastLine(daemon.Log()), "received during the drain: exiting now")) << daemon.Log();
}

TEST(DrainTest, SecondSigtermExitsAtOnceWith143) { SecondSignalExitsAtOnce(SIGTERM, SIGTERM); }
TEST(DrainTest, SecondSigintExitsAtOnceWith130) { SecondSignalExitsAtOnce(SIGTERM, SIGINT); }

TEST(DrainTest, CleanDrainSaysEveryAcceptedStepWasDelivered) {
  Daemon daemon({"--num_layers=1", "--num_heads_q=32", "--max_batch_size=4", "--drain_timeout_s=120"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  // 500 tokens: 200 steps must fit the 120 s drain on a 2-core machine under TSan
  // (about 0.7 s a step at 2000 tokens there).
  auto seq = tracker.NewSequence({500});
  ASSERT_TRUE(seq.ok()) << seq.status();

  auto stream = (*c)->OpenDecodeStream();
  std::atomic<int> received{0};
  int ok = 0;
  std::thread reader([&] {
    v1::DecodeResponse resp;
    while (stream->Read(&resp)) {
      for (const auto& r : resp.results()) ok += r.code() == 0;
      received += resp.results_size();
    }
  });
  constexpr int kSteps = 200;
  for (int i = 0; i < kSteps; i += 10) {
    v1::DecodeRequest req;
    for (int j = 0; j < 10; ++j) *req.add_steps() = tracker.Step(*seq, 0);
    stream->Write(req);
  }
  stream->WritesDone();
  while (received < 10) absl::SleepFor(absl::Milliseconds(2));
  daemon.Signal(SIGTERM);
  reader.join();
  stream->Finish();
  // Up to the drain's own 120 s timeout (it exits 1 then), plus its exit.
  EXPECT_EQ(daemon.Wait(absl::Seconds(150)), 0) << daemon.Log();

  const std::string last = LastLine(daemon.Log());
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      last, m,
      std::regex("drained in [0-9.]+s: ([0-9]+) steps completed in total; since the signal ([0-9]+) accepted steps "
                 "delivered, 0 not delivered \\(0 results whose client was gone, 0 dropped unlaunched as their "
                 "client went away, 0 still queued\\); exit code 0$")))
      << daemon.Log();
  EXPECT_EQ(std::stoi(m[1]), ok) << daemon.Log();
  EXPECT_LE(std::stoi(m[2]), ok) << daemon.Log();
}

TEST(DrainTest, TimedOutDrainCountsWhatWasNotDeliveredAndExits1) {
  // Large heads and a long context on two CPU threads, one step per batch: the queue
  // cannot empty within the one-second drain.
  Daemon daemon({"--num_layers=1", "--num_heads_q=128", "--max_batch_size=1", "--drain_timeout_s=1"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  auto seq = tracker.NewSequence({8192});
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto stream = (*c)->OpenDecodeStream();
  std::atomic<int> received{0};
  std::thread reader([&] {
    v1::DecodeResponse resp;
    while (stream->Read(&resp)) received += resp.results_size();
  });
  // One step per message, so results stream back while the rest wait (a message's
  // results come back together).
  for (int j = 0; j < 300; ++j) {
    v1::DecodeRequest req;
    *req.add_steps() = tracker.Step(*seq, 0);
    ASSERT_TRUE(stream->Write(req));
  }
  while (received < 1) absl::SleepFor(absl::Milliseconds(2));
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(absl::Seconds(30)), 1) << daemon.Log();
  reader.join();
  stream->Finish();

  const std::string last = LastLine(daemon.Log());
  std::smatch m;
  ASSERT_TRUE(std::regex_search(last, m,
                                std::regex("drain timed out after 1s: [0-9]+ steps completed in total; since the "
                                           "signal [0-9]+ accepted steps delivered, ([0-9]+) not delivered .*, "
                                           "([0-9]+) still queued\\); exit code 1$")))
      << daemon.Log();
  EXPECT_GT(std::stoi(m[1]), 0) << last;
  EXPECT_GT(std::stoi(m[2]), 0) << last;
}

}  // namespace
}  // namespace latentd::testing
