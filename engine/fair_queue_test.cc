// Batch formation over flows, without an engine: a flood does not delay a steady flow,
// equal flows share rows equally, order holds per flow and per (sequence, layer), more
// flows than slots rotate, cancelled steps leave from anywhere, messages launch whole.
#include "engine/fair_queue.h"
#include "engine/step_queue.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace latentd::engine {
namespace {

class FairQueueTest : public ::testing::Test {
 protected:
  // A step with the next arrival number (what StepQueue stamps on a push).
  DecodeStep* Step(uint64_t flow, const std::string& seq, int layer = 0, int s_q = 1) {
    auto s = std::make_unique<DecodeStep>();
    s->flow = flow;
    s->sequence_id = seq;
    s->layer = layer;
    s->s_q = s_q;
    s->engine_private = reinterpret_cast<void*>(++arrival_);
    steps_.push_back(std::move(s));
    return steps_.back().get();
  }
  // A message of n one-row steps of one flow (Engine::SubmitBatch), added to q.
  std::vector<DecodeStep*> AddUnit(FairQueue& q, uint64_t flow, uint64_t unit, int n, int s_q = 1) {
    std::vector<DecodeStep*> out;
    for (int i = 0; i < n; ++i) {
      DecodeStep* s = Step(flow, "u" + std::to_string(unit) + "-" + std::to_string(i), 0, s_q);
      s->unit = unit;
      EXPECT_TRUE(q.Add(s));
      out.push_back(s);
    }
    return out;
  }
  static int CountOf(const std::vector<DecodeStep*>& batch, const std::vector<DecodeStep*>& unit) {
    int n = 0;
    for (auto* s : unit) n += std::find(batch.begin(), batch.end(), s) != batch.end();
    return n;
  }
  std::vector<DecodeStep*> Pick(FairQueue& q, int max_steps, int max_rows = 1 << 20) {
    std::vector<DecodeStep*> out;
    q.Pick(max_steps, max_rows, [&](DecodeStep* s) { out.push_back(s); });
    return out;
  }
  static std::map<uint64_t, int> RowsByFlow(const std::vector<DecodeStep*>& batch) {
    std::map<uint64_t, int> rows;
    for (auto* s : batch) rows[s->flow] += s->s_q;
    return rows;
  }

  uint64_t arrival_ = 0;
  std::vector<std::unique_ptr<DecodeStep>> steps_;
};

TEST_F(FairQueueTest, FloodDoesNotDelaySteadyFlow) {
  FairQueue q(4096);
  for (int i = 0; i < 3000; ++i) ASSERT_TRUE(q.Add(Step(1, "flood-" + std::to_string(i % 500))));
  DecodeStep* steady = Step(2, "steady");
  ASSERT_TRUE(q.Add(steady));
  auto batch = Pick(q, 64);
  ASSERT_EQ(batch.size(), 64u);
  EXPECT_EQ(RowsByFlow(batch)[2], 1) << "the steady flow's step waited behind the flood";
  EXPECT_EQ(q.last_pick_flows(), 2);
  EXPECT_EQ(q.last_pick_max_flow_rows(), 63);
  // It keeps its place in every following batch while the flood lasts.
  for (int round = 0; round < 5; ++round) {
    DecodeStep* next = Step(2, "steady");
    ASSERT_TRUE(q.Add(next));
    batch = Pick(q, 64);
    EXPECT_NE(std::find(batch.begin(), batch.end(), next), batch.end()) << "round " << round;
  }
}

TEST_F(FairQueueTest, EqualFlowsShareRowsEqually) {
  FairQueue q(1024);
  // Flow 1 submits everything first: FIFO would give it whole batches.
  for (int flow = 1; flow <= 4; ++flow)
    for (int i = 0; i < 50; ++i) ASSERT_TRUE(q.Add(Step(flow, "s" + std::to_string(flow) + "-" + std::to_string(i))));
  for (int round = 0; round < 10; ++round) {
    auto rows = RowsByFlow(Pick(q, 16));
    ASSERT_EQ(rows.size(), 4u) << "round " << round;
    for (auto [flow, n] : rows) EXPECT_EQ(n, 4) << "flow " << flow << ", round " << round;
  }
}

TEST_F(FairQueueTest, RowsNotStepsAreShared) {
  FairQueue q(1024);
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(q.Add(Step(1, "wide-" + std::to_string(i), 0, 4)));
  for (int i = 0; i < 300; ++i) ASSERT_TRUE(q.Add(Step(2, "narrow-" + std::to_string(i), 0, 1)));
  int wide = 0, narrow = 0;
  for (int round = 0; round < 8; ++round) {
    auto rows = RowsByFlow(Pick(q, 64, 32));
    wide += rows[1];
    narrow += rows[2];
  }
  EXPECT_NEAR(wide, narrow, 8) << "query rows, not steps, are what the flows share";
}

TEST_F(FairQueueTest, OrderWithinAFlowAndPerSequenceLayer) {
  FairQueue q(1024);
  std::vector<DecodeStep*> added;
  // Two flows write the same (sequence, layer) alternately, plus steps of their own.
  for (int i = 0; i < 30; ++i) {
    added.push_back(Step(1 + i % 2, "shared", 0));
    added.push_back(Step(1 + i % 2, "own-" + std::to_string(i % 2), i % 3));
  }
  for (auto* s : added) ASSERT_TRUE(q.Add(s));
  std::map<uint64_t, uint64_t> last_by_flow;
  std::map<std::pair<std::string, int>, uint64_t> last_by_key;
  int picked = 0;
  while (!q.empty()) {
    auto batch = Pick(q, 8);
    ASSERT_FALSE(batch.empty()) << "nothing could be taken: deadlock";
    std::map<std::pair<std::string, int>, int> in_batch;
    for (auto* s : batch) {
      const uint64_t a = StepQueue::Arrival(s);
      EXPECT_GT(a, last_by_flow[s->flow]) << "flow " << s->flow << " reordered";
      last_by_flow[s->flow] = a;
      const auto key = std::make_pair(s->sequence_id, s->layer);
      EXPECT_GT(a, last_by_key[key]) << s->sequence_id << " layer " << s->layer << " reordered";
      last_by_key[key] = a;
      EXPECT_EQ(++in_batch[key], 1) << "two steps of one (sequence, layer) in a batch";
      ++picked;
    }
  }
  EXPECT_EQ(picked, 60);
}

TEST_F(FairQueueTest, MoreFlowsThanSlotsRotate) {
  FairQueue q(1024);
  for (int i = 0; i < 20; ++i)
    for (int flow = 1; flow <= 10; ++flow)
      ASSERT_TRUE(q.Add(Step(flow, "f" + std::to_string(flow) + "-" + std::to_string(i))));
  std::map<uint64_t, int> served;
  for (int round = 0; round < 5; ++round) {
    auto batch = Pick(q, 4);
    ASSERT_EQ(batch.size(), 4u);
    for (auto [flow, n] : RowsByFlow(batch)) served[flow] += n;
  }
  // 20 slots over 10 flows: every flow twice, none more.
  ASSERT_EQ(served.size(), 10u);
  for (auto [flow, n] : served) EXPECT_EQ(n, 2) << "flow " << flow;
}

TEST_F(FairQueueTest, FlowZeroIsPerSequenceAndRemoveIfWorksAnywhere) {
  FairQueue q(64);
  std::vector<DecodeStep*> a, b;
  for (int i = 0; i < 6; ++i) {
    a.push_back(Step(0, "a"));
    b.push_back(Step(0, "b"));
  }
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(q.Add(a[i]));
    ASSERT_TRUE(q.Add(b[i]));
  }
  EXPECT_EQ(q.flows(), 2);
  // Drop from the middle and the end of a flow.
  EXPECT_EQ(q.RemoveIf([&](DecodeStep* s) { return s == a[2] || s == a[5] || s == b[0]; }), 3);
  EXPECT_EQ(q.size(), 9);
  std::vector<DecodeStep*> order;
  while (!q.empty()) {
    auto batch = Pick(q, 8);
    ASSERT_FALSE(batch.empty());
    EXPECT_LE(batch.size(), 2u);  // one per (sequence, layer)
    order.insert(order.end(), batch.begin(), batch.end());
  }
  std::vector<DecodeStep*> want_a = {a[0], a[1], a[3], a[4]}, got_a;
  for (auto* s : order)
    if (s->sequence_id == "a") got_a.push_back(s);
  EXPECT_EQ(got_a, want_a);
  EXPECT_EQ(q.flows(), 0);
}

TEST_F(FairQueueTest, FullAndReusedAfterChurn) {
  FairQueue q(8);
  for (int round = 0; round < 200; ++round) {
    for (int i = 0; i < 8; ++i) ASSERT_TRUE(q.Add(Step(1 + (round + i) % 5, "s" + std::to_string((round * 8 + i) % 13))));
    EXPECT_FALSE(q.Add(Step(1, "over")));
    int left = 8;
    while (left > 0) {
      const int n = static_cast<int>(Pick(q, 3).size());
      ASSERT_GT(n, 0);
      left -= n;
    }
    EXPECT_TRUE(q.empty());
    EXPECT_EQ(q.flows(), 0);
  }
}

// Model runners: four flows each with a message of a whole launch. Sharing rows step by
// step would put 16 of each in every batch, so every runner would wait for four
// launches; each message launches whole instead, the flows taking turns.
TEST_F(FairQueueTest, MessagesLaunchWholeAndFlowsTakeTurns) {
  FairQueue q(1024);
  std::vector<std::vector<DecodeStep*>> units;
  for (int flow = 1; flow <= 4; ++flow) units.push_back(AddUnit(q, flow, 100 + flow, 64));
  std::map<uint64_t, int> served;
  for (int round = 0; round < 4; ++round) {
    auto batch = Pick(q, 64);
    ASSERT_EQ(batch.size(), 64u) << "round " << round;
    const auto rows = RowsByFlow(batch);
    ASSERT_EQ(rows.size(), 1u) << "round " << round << ": a message was spread over launches";
    served[rows.begin()->first] += 1;
    EXPECT_EQ(batch, units[rows.begin()->first - 1]) << "the message's order changed";
  }
  EXPECT_EQ(served.size(), 4u);
  EXPECT_TRUE(q.empty());
  // Messages that fit together share a launch.
  auto a = AddUnit(q, 1, 201, 20), b = AddUnit(q, 2, 202, 20), c = AddUnit(q, 3, 203, 20);
  auto batch = Pick(q, 64);
  EXPECT_EQ(batch.size(), 60u);
  EXPECT_EQ(CountOf(batch, a) + CountOf(batch, b) + CountOf(batch, c), 60);
}

// A message that does not fit what is left of a batch sits out (lone steps of other
// flows still fill the room) and comes first in the next batch, whole.
TEST_F(FairQueueTest, AMessageThatDoesNotFitWaitsForTheNextBatchWhole) {
  FairQueue q(1024);
  auto a = AddUnit(q, 1, 11, 40);
  auto b = AddUnit(q, 2, 12, 40);
  std::vector<DecodeStep*> lone;
  for (int i = 0; i < 30; ++i) {
    lone.push_back(Step(3, "lone-" + std::to_string(i)));
    ASSERT_TRUE(q.Add(lone.back()));
  }
  auto first = Pick(q, 64);
  EXPECT_EQ(CountOf(first, a), 40);
  EXPECT_EQ(CountOf(first, b), 0) << "the second message was split";
  EXPECT_EQ(static_cast<int>(first.size()), 40 + CountOf(first, lone));
  EXPECT_GT(CountOf(first, lone), 0) << "the room left was not filled by lone steps";
  auto second = Pick(q, 64);
  EXPECT_EQ(CountOf(second, b), 40) << "the message that sat out did not come first";
  // By rows as well as by steps.
  auto wide = AddUnit(q, 4, 13, 4, /*s_q=*/8);
  auto narrow = AddUnit(q, 5, 14, 3, /*s_q=*/8);
  ASSERT_TRUE(q.size() == 7) << "lone steps left over: " << q.size() - 7;
  auto third = Pick(q, 64, 48);
  EXPECT_EQ(CountOf(third, wide), 4);
  EXPECT_EQ(CountOf(third, narrow), 0) << "24 rows of message taken into 16 rows of room";
  EXPECT_EQ(CountOf(Pick(q, 64, 48), narrow), 3);
}

// Only an empty batch takes part of a message: one larger than a launch is split, and
// one held back by the (sequence, layer) rule goes as far as the rule allows.
TEST_F(FairQueueTest, AMessageLargerThanALaunchIsSplitInOrder) {
  FairQueue q(1024);
  auto big = AddUnit(q, 1, 21, 100);
  auto first = Pick(q, 64);
  ASSERT_EQ(first.size(), 64u);
  EXPECT_EQ(std::vector<DecodeStep*>(big.begin(), big.begin() + 64), first);
  auto second = Pick(q, 64);
  EXPECT_EQ(std::vector<DecodeStep*>(big.begin() + 64, big.end()), second);
  // Two steps of one (sequence, layer) in one message: one per batch, in order.
  DecodeStep* x = Step(2, "same");
  DecodeStep* y = Step(2, "same");
  DecodeStep* z = Step(2, "other");
  for (DecodeStep* s : {x, y, z}) {
    s->unit = 22;
    ASSERT_TRUE(q.Add(s));
  }
  EXPECT_EQ(Pick(q, 64), std::vector<DecodeStep*>{x});
  EXPECT_EQ(Pick(q, 64), (std::vector<DecodeStep*>{y, z}));
  EXPECT_TRUE(q.empty());
}

}  // namespace
}  // namespace latentd::engine
