// The sharded step queue: bound, FIFO across shards, waking the consumer.
#include "engine/step_queue.h"

#include <gtest/gtest.h>

#include <thread>

namespace latentd::engine {
namespace {

TEST(StepQueue, BoundedAndOrderedAcrossShards) {
  StepQueue q(5, 4);
  DecodeStep steps[6];
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(q.Push(&steps[i], 7 * i + 3).ok());
  absl::Status st = q.Push(&steps[5], 1);
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_EQ(q.size(), 5);
  std::vector<DecodeStep*> out;
  EXPECT_EQ(q.DrainInto(&out), 5);
  ASSERT_EQ(out.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(out[i], &steps[i]) << i;
  // Drained steps hold their place until the consumer is done with them.
  EXPECT_EQ(q.size(), 5);
  EXPECT_TRUE(absl::IsResourceExhausted(q.Push(&steps[5], 1)));
  q.Done(5);
  EXPECT_EQ(q.size(), 0);
  EXPECT_TRUE(q.Push(&steps[5], 1).ok());
}

TEST(StepQueue, WakesWaitingConsumer) {
  StepQueue q(16);
  DecodeStep step;
  std::thread producer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    ASSERT_TRUE(q.Push(&step, 0).ok());
  });
  EXPECT_TRUE(q.WaitForWork(absl::Now() + absl::Seconds(30)));
  producer.join();
  EXPECT_FALSE(StepQueue(4).WaitForWork(absl::Now() + absl::Milliseconds(5)));
}

TEST(StepQueue, ManyProducersLoseNothing) {
  StepQueue q(100000);
  constexpr int kThreads = 4, kEach = 2000;
  std::vector<DecodeStep> steps(kThreads * kEach);
  std::vector<std::thread> producers;
  for (int t = 0; t < kThreads; ++t)
    producers.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) ASSERT_TRUE(q.Push(&steps[t * kEach + i], t * kEach + i).ok());
    });
  std::vector<DecodeStep*> out;
  while (static_cast<int>(out.size()) < kThreads * kEach) {
    q.WaitForWork(absl::Now() + absl::Milliseconds(10));
    q.DrainInto(&out);
  }
  for (auto& p : producers) p.join();
  std::sort(out.begin(), out.end());
  EXPECT_EQ(std::unique(out.begin(), out.end()), out.end());
  EXPECT_EQ(out.size(), steps.size());
}

}  // namespace
}  // namespace latentd::engine
