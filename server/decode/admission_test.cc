// Admission accounting of a Decode stream without a daemon: the shared byte budget,
// slot charges that grow and are refused whole, slot reuse and the stall rule.
#include "server/decode/admission.h"

#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "engine/types.h"
#include "gtest/gtest.h"

namespace latentd::server::decode {
namespace {

StepShape Shape() {
  engine::ModelConfig m;
  m.num_heads_q = 16;
  return StepShape::For(m, 8);
}

TEST(ByteBudget, RefusesWholeChargesOverTheLimit) {
  ByteBudget b(100);
  EXPECT_TRUE(b.Charge(60));
  EXPECT_FALSE(b.Charge(41));  // nothing of it charged
  EXPECT_EQ(b.used(), 60);
  EXPECT_TRUE(b.Charge(40));
  EXPECT_EQ(b.used(), 100);
  b.Release(100);
  EXPECT_EQ(b.used(), 0);
}

TEST(ByteBudget, ConcurrentChargesNeverPassTheLimit) {
  ByteBudget b(1000);
  std::vector<std::thread> threads;
  std::atomic<int> granted{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i)
        if (b.Charge(3)) granted.fetch_add(1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(granted.load(), 333);
  EXPECT_EQ(b.used(), 999);
}

TEST(ChargeSlot, ChargesWhatTheBuffersHoldPlusExtra) {
  ByteBudget b(1 << 20);
  Slot s;
  s.q_buf.reserve(1000);
  ASSERT_TRUE(ChargeSlot(&s, 500, &b).ok());
  EXPECT_EQ(s.charged, HeldBytes(&s) + 500);
  EXPECT_EQ(b.used(), s.charged);
  // Already covered: nothing more.
  const int64_t before = b.used();
  ASSERT_TRUE(ChargeSlot(&s, 0, &b).ok());
  EXPECT_EQ(b.used(), before);
  ReleaseSlot(&s, &b);
  EXPECT_EQ(b.used(), 0);
  EXPECT_EQ(s.charged, 0);
}

TEST(ChargeSlot, OverTheBudgetGivesTheInputsBackAndNamesTheFlag) {
  ByteBudget b(4096);
  Slot s;
  s.q_buf.assign(3000, 'q');
  s.kv_buf.assign(500, 'k');
  const absl::Status st = ChargeSlot(&s, 4096, &b);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(st.message(), "--max_inflight_bytes=4096")) << st.message();
  EXPECT_EQ(b.used(), 0);
  EXPECT_EQ(s.charged, 0);
  EXPECT_EQ(s.q_buf.capacity() + s.kv_buf.capacity(), std::string().capacity() * 2);
}

TEST(ResultCharge, LseBeyondItsCapacityAndOutWithItsHead) {
  const StepShape sh = Shape();
  EXPECT_EQ(ResultCharge(2, 0, sh), 2 * sh.lse_row_bytes + 2 * (sh.out_row_bytes + 64));
  EXPECT_EQ(ResultCharge(2, 1 << 20, sh), 2 * (sh.out_row_bytes + 64));
}

TEST(PinnedFor, QThenKvAlignedInWholePages) {
  const StepShape sh = Shape();
  const PinnedSize p = PinnedFor(3, sh);
  EXPECT_EQ(p.kv_at % 256, 0u);
  EXPECT_GE(p.kv_at, static_cast<size_t>(3 * sh.q_row_bytes));
  EXPECT_LT(p.kv_at, static_cast<size_t>(3 * sh.q_row_bytes) + 256);
  EXPECT_EQ(p.bytes % 4096, 0u);
  EXPECT_GE(p.bytes, p.kv_at + static_cast<size_t>(3 * sh.kv_row_bytes));
  EXPECT_LT(p.bytes, p.kv_at + static_cast<size_t>(3 * sh.kv_row_bytes) + 4096);
}

TEST(SlotPool, ReusesSpareSlotsBeforeMakingNew) {
  SlotPool pool;
  std::vector<Slot*> got;
  pool.Take(3, &got);
  ASSERT_EQ(got.size(), 3u);
  Slot* first = got[0];
  for (Slot* s : got) pool.Put(s);
  EXPECT_EQ(pool.size(), 3u);
  std::vector<Slot*> again;
  pool.Take(4, &again);  // three spare, one new
  EXPECT_EQ(pool.size(), 0u);
  int reused = 0;
  for (Slot* s : again) reused += (s == got[0] || s == got[1] || s == got[2]) ? 1 : 0;
  EXPECT_EQ(reused, 3);
  EXPECT_NE(first, nullptr);
  for (Slot* s : again) pool.Put(s);
  std::vector<Slot*> spare;
  pool.TakeSpare(1, &spare);
  EXPECT_EQ(pool.size(), 1u);
  EXPECT_EQ(spare.size(), 3u);
  pool.TakeSpare(5, &spare);
  EXPECT_TRUE(spare.empty());
  for (Slot* s : again) delete s;
}

TEST(FlowControl, OpenStepsAndTheStallRule) {
  EXPECT_EQ(OpenSteps(2, 3, 4, 5), 14);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_TRUE(Stalled(true, t0, t0 + absl::Seconds(1)));
  EXPECT_FALSE(Stalled(true, t0, t0));  // pending since the cutoff exactly: not yet
  EXPECT_FALSE(Stalled(false, t0, t0 + absl::Seconds(1)));  // no write pending
}

}  // namespace
}  // namespace latentd::server::decode
