// The doorbell ring of the same-host data plane against the real daemon (CPU backend,
// another process): steps published into the region's submission queue come back on its
// completion queue, checked against the CPU implementation; bad entries are answered with
// the field and leave their batch's other steps alone; a malformed ring ends only its
// own stream; rings are bounded by --max_rings and freed with their stream.
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "clients/cpp/client.h"
#include "proto/ring.h"
#include "tests/integration/daemon.h"
#include "tests/integration/region_slots.h"
#include "tests/integration/tracker.h"

namespace latentd::testing {
namespace {

constexpr uint32_t kEntries = 16;

TEST(DoorbellTest, StepsThroughTheRingMatchTheCpuImplementation) {
  Daemon daemon({"--num_layers=2", "--num_heads_q=32", "--ring_spin_us=50"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  const client::Shape sh = (*c)->shape();
  const SlotLayout lay(sh, ring::RingBytes(kEntries));
  std::vector<std::string> seqs;
  for (int i = 0; i < 5; ++i) {
    auto s = tracker.NewSequence({20 + 41 * i, 64 * i + 3});
    ASSERT_TRUE(s.ok()) << s.status();
    seqs.push_back(*s);
  }
  auto stream = (*c)->OpenDecodeStream();
  auto region = stream->OpenRegion(lay.bytes(10), kEntries);
  ASSERT_TRUE(region.ok()) << region.status();
  client::Ring ring(region->get(), kEntries, 20);
  // Rounds of 10 steps in batches of 1 to 4, some traced; more rounds than the ring has
  // entries, so its counters wrap around the queues several times.
  for (int round = 0; round < 6; ++round) {
    std::vector<v1::DecodeStep> steps;
    std::vector<client::Ring::Step> ring_steps;
    std::map<uint64_t, int> slot_of;
    for (int i = 0; i < 10; ++i) {
      steps.push_back(tracker.Step(seqs[i % 5], (i / 5 + round) % 2, 1 + (i + round) % 2, i % 3 == 0));
      ring_steps.push_back(IntoRingSlot(steps.back(), seqs[i % 5], sh, lay, (*region)->data(), i));
      ring_steps.back().trace = i % 4 == 0;
      slot_of[steps.back().request_id()] = i;
    }
    for (int at = 0, n = 1; at < 10; at += n, n = n % 4 + 1) {
      const int take = std::min(n, 10 - at);
      ASSERT_TRUE(ring.Submit(&ring_steps[at], take).ok());
    }
    std::vector<client::Ring::Completion> done;
    ASSERT_TRUE(ring.Wait(10, &done, absl::Seconds(30)).ok());
    ASSERT_EQ(done.size(), 10u);
    for (const client::Ring::Completion& d : done) {
      ASSERT_EQ(d.code, 0) << d.message;
      const int i = slot_of.at(d.request_id);
      EXPECT_EQ(d.has_timing, i % 4 == 0);
      if (d.has_timing) {
        EXPECT_GT(d.timing.received_us(), 0);
        EXPECT_LE(d.timing.received_us(), d.timing.launched_us());
        EXPECT_LE(d.timing.launched_us(), d.timing.completed_us());
      }
      const v1::StepResult r = InPlaceResult(d.request_id, sh, lay, (*region)->data(), i, ring_steps[i].s_q);
      ASSERT_TRUE(tracker.Check(r).ok()) << "round " << round << ": " << tracker.Check(r);
    }
  }
  EXPECT_EQ(ring.outstanding(), 0u);
  EXPECT_TRUE(Close(stream.get()).ok());
  auto info = (*c)->GetInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->steps_completed(), 60u);
}

TEST(DoorbellTest, BadEntriesFailWithTheFieldAndLeaveTheRestAlone) {
  Daemon daemon({"--num_layers=2"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  const client::Shape sh = (*c)->shape();
  const SlotLayout lay(sh, ring::RingBytes(kEntries));
  auto seq = tracker.NewSequence({30, 30});
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto stream = (*c)->OpenDecodeStream();
  auto region = stream->OpenRegion(lay.bytes(2), kEntries);
  ASSERT_TRUE(region.ok()) << region.status();
  client::Ring ring(region->get(), kEntries);

  const v1::DecodeStep good = tracker.Step(*seq, 0, 1, false);
  std::vector<client::Ring::Step> steps(6, IntoRingSlot(good, *seq, sh, lay, (*region)->data(), 0));
  for (int i = 1; i < 6; ++i) steps[i].request_id = 900 + i;
  steps[1].q_offset = 64;  // inside the ring
  steps[2].layer = 5;
  steps[3].sequence_id = "no-such-sequence";
  steps[4].out_offset = lay.bytes(2) - 2;  // runs past the region's end
  steps[5].sequence_id = "bad id!";
  ASSERT_TRUE(ring.Submit(steps.data(), steps.size()).ok());
  std::vector<client::Ring::Completion> done;
  ASSERT_TRUE(ring.Wait(steps.size(), &done, absl::Seconds(30)).ok());
  std::map<uint64_t, client::Ring::Completion> by_id;
  for (auto& d : done) by_id[d.request_id] = d;
  ASSERT_EQ(by_id.size(), 6u);
  EXPECT_EQ(by_id[good.request_id()].code, 0) << by_id[good.request_id()].message;
  const struct {
    uint64_t id;
    int code;
    const char* names;
  } want[] = {{901, 3, "region.q_offset"}, {902, 3, "layer"}, {903, 5, ""}, {904, 3, "region.out_offset"},
              {905, 3, "sequence_id"}};
  for (const auto& w : want) {
    EXPECT_EQ(by_id[w.id].code, w.code) << w.id << ": " << by_id[w.id].message;
    EXPECT_TRUE(absl::StrContains(by_id[w.id].message, w.names)) << w.id << ": " << by_id[w.id].message;
  }
  EXPECT_TRUE(absl::StrContains(by_id[901].message, "doorbell ring")) << by_id[901].message;
  v1::StepResult r = InPlaceResult(good.request_id(), sh, lay, (*region)->data(), 0, 1);
  EXPECT_TRUE(tracker.Check(r).ok()) << tracker.Check(r);

  // The next step of that sequence sees exactly one new row (the good step's).
  const v1::DecodeStep next = tracker.Step(*seq, 0, 1, false);
  client::Ring::Step n = IntoRingSlot(next, *seq, sh, lay, (*region)->data(), 1);
  ASSERT_TRUE(ring.Submit(&n, 1).ok());
  done.clear();
  ASSERT_TRUE(ring.Wait(1, &done, absl::Seconds(30)).ok());
  ASSERT_EQ(done[0].code, 0) << done[0].message;
  r = InPlaceResult(next.request_id(), sh, lay, (*region)->data(), 1, 1);
  EXPECT_TRUE(tracker.Check(r).ok()) << tracker.Check(r);
  EXPECT_TRUE(Close(stream.get()).ok());
}

// A request for a ring that cannot be is refused with the field, on that stream only.
TEST(DoorbellTest, BadRingRequestsEndTheirStreamNamingTheField) {
  Daemon daemon({"--num_layers=2", "--max_rings=1"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  const uint64_t big = ring::RingBytes(kEntries) + (1 << 20);
  const struct {
    uint64_t bytes;
    uint32_t entries;
    grpc::StatusCode code;
    const char* names;
  } cases[] = {
      {big, 3, grpc::StatusCode::INVALID_ARGUMENT, "region_ring_entries"},
      {big, 8192, grpc::StatusCode::INVALID_ARGUMENT, "region_ring_entries"},
      {4096, kEntries, grpc::StatusCode::INVALID_ARGUMENT, "open_region_bytes"},
  };
  for (const auto& k : cases) {
    auto stream = (*c)->OpenDecodeStream();
    auto region = stream->OpenRegion(k.bytes, k.entries);
    ASSERT_FALSE(region.ok());
    EXPECT_EQ(static_cast<int>(region.status().code()), static_cast<int>(k.code)) << region.status();
    EXPECT_TRUE(absl::StrContains(region.status().message(), k.names)) << region.status();
  }
  {  // a ring with no region to hold it
    auto stream = (*c)->OpenDecodeStream();
    v1::DecodeRequest req;
    req.set_region_ring_entries(kEntries);
    ASSERT_TRUE(stream->Write(req));
    const grpc::Status st = Close(stream.get());
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(st.error_message(), "region_ring_entries")) << st.error_message();
  }
  // --max_rings=1: a second ring waits for the first stream to end.
  auto first = (*c)->OpenDecodeStream();
  auto r1 = first->OpenRegion(big, kEntries);
  ASSERT_TRUE(r1.ok()) << r1.status();
  {
    auto second = (*c)->OpenDecodeStream();
    auto r2 = second->OpenRegion(big, kEntries);
    ASSERT_FALSE(r2.ok());
    EXPECT_EQ(r2.status().code(), absl::StatusCode::kResourceExhausted) << r2.status();
    EXPECT_TRUE(absl::StrContains(r2.status().message(), "--max_rings")) << r2.status();
  }
  EXPECT_TRUE(Close(first.get()).ok());
  for (int attempt = 0;; ++attempt) {  // the first ring is released as its stream finishes
    auto third = (*c)->OpenDecodeStream();
    auto r3 = third->OpenRegion(big, kEntries);
    if (r3.ok()) {
      EXPECT_TRUE(Close(third.get()).ok());
      break;
    }
    ASSERT_LT(attempt, 50) << r3.status();
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// A client that corrupts its ring's counters ends its own stream, INVALID_ARGUMENT naming
// the counter; a client that goes away with steps published leaves the daemon serving.
TEST(DoorbellTest, BrokenOrAbandonedRingsEndOnlyTheirStream) {
  Daemon daemon({"--num_layers=2"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  const client::Shape sh = (*c)->shape();
  const SlotLayout lay(sh, ring::RingBytes(kEntries));
  auto seq = tracker.NewSequence({40, 40});  // its rows are not checked after the abandoned steps
  ASSERT_TRUE(seq.ok()) << seq.status();
  {
    auto stream = (*c)->OpenDecodeStream();
    auto region = stream->OpenRegion(lay.bytes(1), kEntries);
    ASSERT_TRUE(region.ok()) << region.status();
    auto* h = reinterpret_cast<ring::Header*>((*region)->data());
    h->sq_tail.store(kEntries * 3, std::memory_order_seq_cst);
    ring::FutexWake(&h->sq_tail);
    const grpc::Status st = Close(stream.get());
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(st.error_message(), "ring.sq_tail")) << st.error_message();
    EXPECT_EQ(h->closed.load(), 1u);
  }
  {
    auto stream = (*c)->OpenDecodeStream();
    auto region = stream->OpenRegion(lay.bytes(1), kEntries);
    ASSERT_TRUE(region.ok()) << region.status();
    client::Ring ring(region->get(), kEntries);
    std::vector<client::Ring::Step> steps;
    for (int i = 0; i < 8; ++i) {
      steps.push_back(IntoRingSlot(tracker.Step(*seq, 1, 1, false), *seq, sh, lay, (*region)->data(), 0));
      steps.back().out_offset = steps.back().lse_offset = lay.at(0) + lay.out;  // never read back
    }
    ASSERT_TRUE(ring.Submit(steps.data(), steps.size()).ok());
    stream->Cancel();
    (void)Close(stream.get());
  }
  // The daemon serves on: a fresh ring on another sequence works.
  auto other = tracker.NewSequence({50, 10});
  ASSERT_TRUE(other.ok()) << other.status();
  auto stream = (*c)->OpenDecodeStream();
  auto region = stream->OpenRegion(lay.bytes(1), kEntries);
  ASSERT_TRUE(region.ok()) << region.status();
  client::Ring ring(region->get(), kEntries);
  const v1::DecodeStep s = tracker.Step(*other, 0, 2, true);
  client::Ring::Step rs = IntoRingSlot(s, *other, sh, lay, (*region)->data(), 0);
  ASSERT_TRUE(ring.Submit(&rs, 1).ok());
  std::vector<client::Ring::Completion> done;
  ASSERT_TRUE(ring.Wait(1, &done, absl::Seconds(30)).ok());
  ASSERT_EQ(done[0].code, 0) << done[0].message;
  const v1::StepResult r = InPlaceResult(s.request_id(), sh, lay, (*region)->data(), 0, 2);
  EXPECT_TRUE(tracker.Check(r).ok()) << tracker.Check(r);
  EXPECT_TRUE(Close(stream.get()).ok());
  EXPECT_TRUE(daemon.Running());
}

// A client that never consumes its completions is cancelled by --stream_stall_timeout_s,
// as a byte stream whose responses are not read; a completion head outside what was
// posted ends the stream naming the counter instead of stalling it.
TEST(DoorbellTest, UnconsumedCompletionsAreCancelledByTheStallRule) {
  Daemon daemon({"--num_layers=2", "--stream_stall_timeout_s=1"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  const client::Shape sh = (*c)->shape();
  const SlotLayout lay(sh, ring::RingBytes(kEntries));
  auto seq = tracker.NewSequence({30, 30});
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto stream = (*c)->OpenDecodeStream();
  auto region = stream->OpenRegion(lay.bytes(1), kEntries);
  ASSERT_TRUE(region.ok()) << region.status();
  auto* h = reinterpret_cast<ring::Header*>((*region)->data());
  client::Ring ring(region->get(), kEntries);
  client::Ring::Step rs = IntoRingSlot(tracker.Step(*seq, 0, 1, false), *seq, sh, lay, (*region)->data(), 0);
  ASSERT_TRUE(ring.Submit(&rs, 1).ok());
  // The completion is posted, and never consumed (cq_head stays 0).
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (h->cq_tail.load() < 1) {
    ASSERT_LT(absl::Now(), deadline) << "the step was never answered";
    absl::SleepFor(absl::Milliseconds(5));
  }
  while (h->closed.load() == 0) {
    ASSERT_LT(absl::Now(), deadline) << "the stall rule never cancelled the ring's stream";
    absl::SleepFor(absl::Milliseconds(20));
  }
  const grpc::Status st = Close(stream.get());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
  EXPECT_TRUE(daemon.Running());
}

TEST(DoorbellTest, ACompletionHeadPastWhatWasPostedEndsTheStreamNamingIt) {
  Daemon daemon({"--num_layers=2"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  const client::Shape sh = (*c)->shape();
  const SlotLayout lay(sh, ring::RingBytes(kEntries));
  auto seq = tracker.NewSequence({30, 30});
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto stream = (*c)->OpenDecodeStream();
  auto region = stream->OpenRegion(lay.bytes(1), kEntries);
  ASSERT_TRUE(region.ok()) << region.status();
  auto* h = reinterpret_cast<ring::Header*>((*region)->data());
  client::Ring ring(region->get(), kEntries);
  client::Ring::Step rs = IntoRingSlot(tracker.Step(*seq, 0, 1, false), *seq, sh, lay, (*region)->data(), 0);
  ASSERT_TRUE(ring.Submit(&rs, 1).ok());
  std::vector<client::Ring::Completion> done;
  ASSERT_TRUE(ring.Wait(1, &done, absl::Seconds(30)).ok());
  h->cq_head.store(100, std::memory_order_release);  // one completion was posted
  client::Ring::Step next = IntoRingSlot(tracker.Step(*seq, 1, 1, false), *seq, sh, lay, (*region)->data(), 0);
  ASSERT_TRUE(ring.Submit(&next, 1).ok());
  const grpc::Status st = Close(stream.get());
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "ring.cq_head: 100")) << st.error_message();
  EXPECT_EQ(h->closed.load(), 1u);
}

// One connection holds at most --max_rings_per_connection rings; another connection
// still gets one while the first holds its share.
TEST(DoorbellTest, OneConnectionCannotHoldEveryRing) {
  Daemon daemon({"--num_layers=2", "--max_rings=4", "--max_rings_per_connection=2"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  client::ClientOptions own;
  own.own_connection = true;
  auto a = daemon.Connect(own);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = daemon.Connect(own);
  ASSERT_TRUE(b.ok()) << b.status();
  const uint64_t bytes = ring::RingBytes(kEntries) + (1 << 16);
  std::vector<std::unique_ptr<client::DecodeStream>> held;
  std::vector<std::unique_ptr<client::SharedRegion>> regions;
  for (int i = 0; i < 2; ++i) {
    held.push_back((*a)->OpenDecodeStream());
    auto r = held.back()->OpenRegion(bytes, kEntries);
    ASSERT_TRUE(r.ok()) << r.status();
    regions.push_back(*std::move(r));
  }
  {
    auto third = (*a)->OpenDecodeStream();
    auto r = third->OpenRegion(bytes, kEntries);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "--max_rings_per_connection=2")) << r.status();
  }
  auto other = (*b)->OpenDecodeStream();
  auto r = other->OpenRegion(bytes, kEntries);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Close(other.get()).ok());
  for (auto& s : held) EXPECT_TRUE(Close(s.get()).ok());
}

}  // namespace
}  // namespace latentd::testing
