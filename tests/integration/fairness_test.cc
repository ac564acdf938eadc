// A fair share for every client, against the real daemon: a steady client's decode
// latency beside a client flooding steps, and beside a client uploading large AppendKv
// messages, each compared with the same client alone in the same test.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/integration/daemon.h"
#include "tests/integration/tracker.h"

namespace latentd::testing {
namespace {

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

// One step at a time on one stream, each result checked; returns latencies in ms.
std::vector<double> Steady(Tracker* t, const std::string& seq, int n) {
  auto stream = t->client()->OpenDecodeStream();
  std::vector<double> ms;
  for (int i = 0; i < n; ++i) {
    v1::DecodeRequest req;
    *req.add_steps() = t->Step(seq, 0);
    const absl::Time start = absl::Now();
    EXPECT_TRUE(stream->Write(req));
    v1::DecodeResponse resp;
    EXPECT_TRUE(stream->Read(&resp));
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    for (const auto& r : resp.results()) EXPECT_TRUE(t->Check(r).ok()) << t->Check(r);
  }
  stream->WritesDone();
  v1::DecodeResponse resp;
  while (stream->Read(&resp)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
  return ms;
}

TEST(FairnessTest, AFloodDoesNotStarveASteadyClient) {
  const int kFloodSteps = getenv("FLOOD") ? atoi(getenv("FLOOD")) : 1000;
  // The CPU backend's batch time grows with its size (no weights to share between
  // steps), so a small batch keeps the comparison about scheduling, not arithmetic.
  Daemon daemon({"--num_layers=1", "--num_heads_q=16", "--kv_pages=2048", getenv("MBS") ? getenv("MBS") : "--max_batch_size=8"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto steady_client = daemon.Connect();
  ASSERT_TRUE(steady_client.ok());
  Tracker steady(steady_client->get(), 21);
  auto mine = steady.NewSequence({64});
  ASSERT_TRUE(mine.ok());
  Steady(&steady, *mine, 20);  // warm-up
  const std::vector<double> alone = Steady(&steady, *mine, 200);

  auto flood_client = daemon.Connect();
  ASSERT_TRUE(flood_client.ok());
  std::vector<std::string> theirs;
  for (int i = 0; i < 64; ++i) {
    auto s = (*flood_client)->CreateSequence();
    ASSERT_TRUE(s.ok());
    theirs.push_back(*s);
  }
  const client::Shape& sh = (*flood_client)->shape();
  std::atomic<bool> stop{false};
  std::atomic<int> flood_results{0};
  auto flood = (*flood_client)->OpenDecodeStream();
  std::thread reader([&] {
    v1::DecodeResponse resp;
    while (flood->Read(&resp)) flood_results += resp.results_size();
  });
  std::thread writer([&] {
    // Messages of 1000 steps, as fast as the stream takes them.
    v1::DecodeRequest req;
    for (int i = 0; i < kFloodSteps; ++i) {
      v1::DecodeStep* s = req.add_steps();
      s->set_sequence_id(theirs[i % theirs.size()]);
      s->set_q(std::string(static_cast<size_t>(sh.QBytes(1)), '\x01'));
      s->set_kv(std::string(static_cast<size_t>(sh.KvBytes(1)), '\x01'));
    }
    while (!stop.load() && flood->Write(req)) {
    }
    flood->WritesDone();
  });
  absl::SleepFor(absl::Seconds(1));  // the flood's queue is full by now
  const std::vector<double> beside = Steady(&steady, *mine, 200);
  stop.store(true);
  writer.join();
  reader.join();
  flood->Finish();
  const double p50_alone = Percentile(alone, 0.5), p50_beside = Percentile(beside, 0.5);
  std::printf("steady client p50 %.2f ms alone, %.2f ms beside a flood (%d flood results meanwhile)\n", p50_alone,
              p50_beside, flood_results.load());
  EXPECT_GT(flood_results.load(), 1000) << "the flood must have been served too";
  EXPECT_LE(p50_beside, 2 * p50_alone);
}

TEST(FairnessTest, ALargeUploadDoesNotStallADecoder) {
  Daemon daemon({"--num_layers=1", "--num_heads_q=16", "--kv_pages=4096"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto steady_client = daemon.Connect();
  ASSERT_TRUE(steady_client.ok());
  Tracker steady(steady_client->get(), 23);
  auto mine = steady.NewSequence({64});
  ASSERT_TRUE(mine.ok());
  Steady(&steady, *mine, 20);
  const std::vector<double> alone = Steady(&steady, *mine, 300);

  client::ClientOptions o;
  o.target = daemon.target();
  o.append_chunk_bytes = 59 << 20;  // one 59 MiB message per upload
  auto up = client::Client::Connect(o);
  ASSERT_TRUE(up.ok());
  std::atomic<bool> stop{false};
  std::atomic<int> uploads{0};
  const std::string rows(static_cast<size_t>((59 << 20) / (*up)->shape().kv_row_bytes * (*up)->shape().kv_row_bytes),
                         '\x02');
  std::thread uploader([&] {
    while (!stop.load()) {
      auto s = (*up)->CreateSequence();
      ASSERT_TRUE(s.ok());
      auto r = (*up)->AppendKv(*s, 0, rows);
      EXPECT_TRUE(r.ok()) << r.status();
      if (r.ok()) ++uploads;
      (*up)->ReleaseSequence(*s);
    }
  });
  while (uploads.load() == 0) absl::SleepFor(absl::Milliseconds(10));
  const std::vector<double> beside = Steady(&steady, *mine, 300);
  stop.store(true);
  uploader.join();
  const double p99_alone = Percentile(alone, 0.99), p99_beside = Percentile(beside, 0.99);
  std::printf("decoder p99 %.2f ms alone, %.2f ms beside 59 MiB uploads (%d uploads; p50 %.2f / %.2f ms)\n",
              p99_alone, p99_beside, uploads.load(), Percentile(alone, 0.5), Percentile(beside, 0.5));
  EXPECT_LE(p99_beside, 2 * p99_alone);
}

}  // namespace
}  // namespace latentd::testing
