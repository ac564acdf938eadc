// The doorbell ring's thread on a ring in ordinary memory, fed by a fake stream: what
// it takes and when, how it stops, and the completions it publishes. Waits are for
// conditions (with a generous deadline), never for a guessed time.
#include "server/dataplane/doorbell_ring.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace latentd::server::dataplane {
namespace {

// Ring memory as a client would map it: zeroed, page-aligned.
struct RingMemory {
  explicit RingMemory(uint32_t entries) : bytes(ring::RingBytes(entries)) {
    base = static_cast<char*>(std::aligned_alloc(4096, bytes));
    std::memset(base, 0, bytes);
  }
  ~RingMemory() { std::free(base); }
  ring::Header* header() { return reinterpret_cast<ring::Header*>(base); }
  // Publishes entries [from, to) with request_id = index + 1000, as a client would.
  void Publish(uint32_t from, uint32_t to, uint32_t entries) {
    for (uint32_t i = from; i < to; ++i) {
      ring::SqEntry e{};
      e.request_id = 1000 + i;
      std::memcpy(base + ring::SqOffset() + (i & (entries - 1)) * sizeof(ring::SqEntry), &e, sizeof(e));
    }
    header()->sq_tail.store(to, std::memory_order_seq_cst);
    if (header()->server_waiting.load(std::memory_order_seq_cst) != 0) ring::FutexWake(&header()->sq_tail);
  }
  uint64_t bytes;
  char* base;
};

class FakeStream : public DoorbellRing::Stream {
 public:
  explicit FakeStream(DoorbellRing* ring) : ring_(ring) {}
  int64_t Room() override {
    absl::MutexLock l(&mu_);
    return room_;
  }
  void Take(uint32_t head, uint32_t count) override {
    absl::MutexLock l(&mu_);
    takes_.emplace_back(head, count);
    for (uint32_t i = 0; i < count; ++i) ids_.push_back(ring_->Entry(head + i).request_id);
  }
  void Fail(absl::Status status) override {
    absl::MutexLock l(&mu_);
    failed_ = std::move(status);
  }
  void SetRoom(int64_t room) {
    absl::MutexLock l(&mu_);
    room_ = room;
  }
  std::vector<std::pair<uint32_t, uint32_t>> takes() {
    absl::MutexLock l(&mu_);
    return takes_;
  }
  std::vector<uint64_t> ids() {
    absl::MutexLock l(&mu_);
    return ids_;
  }
  absl::Status failed() {
    absl::MutexLock l(&mu_);
    return failed_;
  }

 private:
  DoorbellRing* const ring_;
  absl::Mutex mu_;
  int64_t room_ = 1 << 20;
  std::vector<std::pair<uint32_t, uint32_t>> takes_;
  std::vector<uint64_t> ids_;
  absl::Status failed_;
};

// Waits up to 30 s for pred; false if it never held.
template <typename Pred>
bool Eventually(Pred pred) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!pred()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Microseconds(200));
  }
  return true;
}

// A ring with its thread running, stopped at once when the test ends.
struct Running {
  Running(uint32_t entries, int64_t max_batch, absl::Duration spin = absl::ZeroDuration())
      : memory(entries), ring(memory.base, entries, DoorbellRing::Options{spin, max_batch}), stream(&ring) {
    thread = std::thread([this] {
      ring.Run(&stream);
      returned.store(true);
    });
  }
  ~Running() {
    ring.RequestStop(DoorbellRing::kNow);
    thread.join();
  }
  uint32_t sq_head() { return memory.header()->sq_head.load(); }
  RingMemory memory;
  DoorbellRing ring;
  FakeStream stream;
  std::atomic<bool> returned{false};
  std::thread thread;
};

TEST(DoorbellRing, WritesItsSizeIntoTheHeader) {
  RingMemory m(16);
  DoorbellRing ring(m.base, 16, DoorbellRing::Options{absl::ZeroDuration(), 8});
  EXPECT_EQ(m.header()->entries, 16u);
}

TEST(DoorbellRing, TakesPublishedEntriesInBatchesOfAtMostMaxBatch) {
  Running r(8, 3);
  r.memory.Publish(0, 5, 8);
  ASSERT_TRUE(Eventually([&] { return r.sq_head() == 5; }));
  using Take = std::pair<uint32_t, uint32_t>;
  EXPECT_EQ(r.stream.takes(), (std::vector<Take>{{0, 3}, {3, 2}}));
  EXPECT_EQ(r.stream.ids(), (std::vector<uint64_t>{1000, 1001, 1002, 1003, 1004}));
}

TEST(DoorbellRing, UnconsumedCompletionsBoundWhatItTakes) {
  Running r(4, 16);
  r.memory.Publish(0, 4, 4);
  ASSERT_TRUE(Eventually([&] { return r.sq_head() == 4; }));
  // Four results not yet consumed fill the completion queue: nothing more is taken.
  r.memory.Publish(4, 6, 4);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(r.sq_head(), 4u);
  r.ring.Publish(4);                     // the four are answered,
  r.memory.header()->cq_head.store(1);  // and one consumed: room for one
  ASSERT_TRUE(Eventually([&] { return r.sq_head() == 5; }));
  r.memory.header()->cq_head.store(4);
  ASSERT_TRUE(Eventually([&] { return r.sq_head() == 6; }));
  using Take = std::pair<uint32_t, uint32_t>;
  EXPECT_EQ(r.stream.takes(), (std::vector<Take>{{0, 4}, {4, 1}, {5, 1}}));
}

TEST(DoorbellRing, StreamRoomBoundsWhatItTakes) {
  Running r(8, 16);
  r.stream.SetRoom(0);
  r.memory.Publish(0, 3, 8);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(r.sq_head(), 0u);
  r.stream.SetRoom(2);
  ASSERT_TRUE(Eventually([&] { return r.sq_head() >= 2; }));
  r.stream.SetRoom(1 << 20);
  ASSERT_TRUE(Eventually([&] { return r.sq_head() == 3; }));
  EXPECT_EQ(r.stream.takes().front(), (std::pair<uint32_t, uint32_t>{0, 2}));
}

TEST(DoorbellRing, SubmissionTailPastTheRingFailsTheStream) {
  Running r(8, 16);
  r.memory.header()->sq_tail.store(9);
  ring::FutexWake(&r.memory.header()->sq_tail);
  ASSERT_TRUE(Eventually([&] { return r.returned.load(); }));
  const absl::Status st = r.stream.failed();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message().rfind("ring.sq_tail: 9", 0), 0u) << st;
  EXPECT_EQ(r.memory.header()->closed.load(), 1u);
  EXPECT_TRUE(r.stream.takes().empty());
}

TEST(DoorbellRing, DrainedTakesWhatIsPublishedThenStops) {
  Running r(8, 16);
  r.stream.SetRoom(0);
  r.memory.Publish(0, 3, 8);
  r.ring.RequestStop(DoorbellRing::kDrained);
  r.stream.SetRoom(1 << 20);
  ASSERT_TRUE(Eventually([&] { return r.returned.load(); }));
  EXPECT_EQ(r.sq_head(), 3u);
  EXPECT_EQ(r.memory.header()->closed.load(), 1u);
}

TEST(DoorbellRing, DrainedWithAFullCompletionQueueStops) {
  Running r(2, 16);
  r.memory.Publish(0, 2, 2);
  ASSERT_TRUE(Eventually([&] { return r.sq_head() == 2; }));
  r.memory.Publish(2, 4, 2);  // never consumed: the client no longer reads
  r.ring.RequestStop(DoorbellRing::kDrained);
  ASSERT_TRUE(Eventually([&] { return r.returned.load(); }));
  EXPECT_EQ(r.sq_head(), 2u);
}

TEST(DoorbellRing, StopNowStopsAnIdleRingAndIsNeverLowered) {
  Running r(8, 16);
  r.ring.RequestStop(DoorbellRing::kNow);
  r.ring.RequestStop(DoorbellRing::kRun);  // ignored
  ASSERT_TRUE(Eventually([&] { return r.returned.load(); }));
  EXPECT_EQ(r.memory.header()->closed.load(), 1u);
}

TEST(DoorbellRing, PublishStoresTheTailOfWrittenCompletions) {
  RingMemory m(4);
  DoorbellRing ring(m.base, 4, DoorbellRing::Options{absl::ZeroDuration(), 8});
  for (uint32_t i = 0; i < 5; ++i) ring.Completion(i)->request_id = 50 + i;  // index 4 reuses entry 0
  ring.Publish(5);
  EXPECT_EQ(m.header()->cq_tail.load(), 5u);
  const auto* cq = reinterpret_cast<const ring::CqEntry*>(m.base + ring::CqOffset(4));
  EXPECT_EQ(cq[0].request_id, 54u);
  EXPECT_EQ(cq[3].request_id, 53u);
}

// A completion head ahead of what was posted would leave the ring waiting for room
// that never comes; one that moves back would hand out entries still unread.
TEST(DoorbellRing, CompletionHeadPastThePostedFailsTheStream) {
  Running r(4, 16);
  r.memory.Publish(0, 1, 4);
  ASSERT_TRUE(Eventually([&] { return r.sq_head() == 1; }));
  r.ring.Publish(1);
  r.memory.header()->cq_head.store(7);
  r.memory.Publish(1, 2, 4);
  ASSERT_TRUE(Eventually([&] { return r.returned.load(); }));
  const absl::Status st = r.stream.failed();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message().rfind("ring.cq_head: 7; expected from 0 (completions consumed before) to 1", 0), 0u) << st;
  EXPECT_EQ(r.sq_head(), 1u);
}

TEST(DoorbellRing, CompletionHeadMovingBackFailsTheStream) {
  Running r(4, 16);
  r.memory.Publish(0, 2, 4);
  ASSERT_TRUE(Eventually([&] { return r.sq_head() == 2; }));
  r.ring.Publish(2);
  r.memory.header()->cq_head.store(2);
  r.memory.Publish(2, 3, 4);  // taken with cq_head 2 checked
  ASSERT_TRUE(Eventually([&] { return r.sq_head() == 3; }));
  r.memory.header()->cq_head.store(1);
  r.memory.Publish(3, 4, 4);
  ASSERT_TRUE(Eventually([&] { return r.returned.load(); }));
  EXPECT_EQ(r.stream.failed().message().rfind("ring.cq_head: 1; expected from 2", 0), 0u) << r.stream.failed();
}

// The spin follows a moved submission tail only: an idle ring sleeps at once, and
// futex returns that bring nothing (timeouts, foreign wakes) put it back to sleep
// instead of spinning. With a one-hour spin, any re-armed spin would stop the count.
TEST(DoorbellRing, OnlyAMovedTailArmsTheSpin) {
  Running r(8, 16, absl::Hours(1));
  ring::Header* h = r.memory.header();
  ASSERT_TRUE(Eventually([&] { return r.ring.sleeps() >= 1; })) << "an idle ring spun instead of sleeping";
  for (int i = 0; i < 5; ++i) {
    const uint64_t before = r.ring.sleeps();
    ASSERT_TRUE(Eventually([&] { return h->server_waiting.load() == 1; }));
    ring::FutexWake(&h->sq_tail);  // a wake with nothing published
    ASSERT_TRUE(Eventually([&] { return r.ring.sleeps() > before; })) << "wake " << i << " re-armed the spin";
  }
  const uint64_t before = r.ring.sleeps();
  r.memory.Publish(0, 1, 8);
  ASSERT_TRUE(Eventually([&] { return r.sq_head() == 1; }));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_LE(r.ring.sleeps(), before + 1) << "a taken batch must arm the spin";
}

TEST(CompletionWatch, NothingWaitingIsNeverStalled) {
  CompletionWatch w;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_EQ(w.Observe(0, 0, t0), absl::InfiniteFuture());
  EXPECT_EQ(w.Observe(5, 5, t0 + absl::Hours(1)), absl::InfiniteFuture());
}

TEST(CompletionWatch, WaitingCompletionsStallFromTheFirstObservation) {
  CompletionWatch w;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_EQ(w.Observe(0, 3, t0), t0);
  EXPECT_EQ(w.Observe(0, 3, t0 + absl::Seconds(5)), t0);
  EXPECT_EQ(w.Observe(0, 9, t0 + absl::Seconds(9)), t0);  // more posted, none consumed
}

TEST(CompletionWatch, ProgressRestartsTheClock) {
  CompletionWatch w;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_EQ(w.Observe(0, 3, t0), t0);
  EXPECT_EQ(w.Observe(1, 3, t0 + absl::Seconds(2)), t0 + absl::Seconds(2));
  EXPECT_EQ(w.Observe(3, 3, t0 + absl::Seconds(3)), absl::InfiniteFuture());
  EXPECT_EQ(w.Observe(3, 4, t0 + absl::Seconds(4)), t0 + absl::Seconds(4));
}

}  // namespace
}  // namespace latentd::server::dataplane
