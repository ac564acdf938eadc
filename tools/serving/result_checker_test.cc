// ResultChecker without a daemon: against the CPU reference it accepts a right result and
// flags (and explains) a wrong one; with a check held on a latch it bounds its queue,
// and Flush and the destructor wait for what was queued.
#include "tools/serving/result_checker.h"

#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <random>
#include <string>

#include "clients/cpp/reference.h"
#include "kernels/params.h"

namespace latentd::tools {
namespace {

constexpr int kHq = 16;
constexpr int64_t kLength = 100;
constexpr int64_t kRow = kernels::kHeadDimQK * 2;  // bytes per row, h_kv 1

v1::ServerInfo Info() {
  v1::ServerInfo info;
  info.set_dtype(v1::BF16);
  info.set_num_heads_q(kHq);
  info.set_num_heads_kv(1);
  info.set_num_layers(2);
  info.set_softmax_scale(static_cast<float>(1.0 / std::sqrt(192.0)));
  return info;
}

ResultChecker::Options Bounded(size_t max_queue, int max_described) {
  ResultChecker::Options o;
  o.max_queue = max_queue;
  o.max_described = max_described;
  return o;
}

class AgainstReferenceTest : public ::testing::Test {
 protected:
  AgainstReferenceTest() : ref_(Info(), 1), rng_(11) {
    ref_.Append("seq", 1, client::RandomHalves(rng_, kLength * kRow / 2, kernels::DType::kBF16));
    q_ = client::RandomHalves(rng_, kHq * kernels::kHeadDimQK, kernels::DType::kBF16);
  }

  // The item of a step over the sequence's rows whose result is the reference's own.
  ResultChecker::Item RightItem() {
    ResultChecker::Item item{"seq", 1, kLength, q_, {}};
    std::string out, lse;
    EXPECT_TRUE(ref_.Expected("seq", 1, kLength, q_, 1, true, &out, &lse).ok());
    item.result.set_out(out);
    item.result.set_lse(lse);
    return item;
  }

  // The same with the first output value 4.0 (bf16 0x4080), where every right value is
  // a weighted mean of values in [-1, 1).
  ResultChecker::Item WrongItem() {
    ResultChecker::Item item = RightItem();
    std::string out = item.result.out();
    out[0] = static_cast<char>(0x80);
    out[1] = static_cast<char>(0x40);
    item.result.set_out(out);
    return item;
  }

  client::Reference ref_;
  std::mt19937_64 rng_;
  std::string q_;
};

TEST_F(AgainstReferenceTest, AcceptsARightResult) {
  ResultChecker checker(ResultChecker::AgainstReference(&ref_, 1, true), {});
  ASSERT_TRUE(checker.Push(RightItem()));
  checker.Flush();
  EXPECT_EQ(checker.checked(), 1u);
  EXPECT_EQ(checker.mismatched(), 0u);
  EXPECT_EQ(checker.failures(), "");
}

TEST_F(AgainstReferenceTest, FlagsAWrongResultWithWhereAndWhy) {
  ResultChecker checker(ResultChecker::AgainstReference(&ref_, 1, true), {});
  ASSERT_TRUE(checker.Push(RightItem()));
  ASSERT_TRUE(checker.Push(WrongItem()));
  checker.Flush();
  EXPECT_EQ(checker.checked(), 2u);
  EXPECT_EQ(checker.mismatched(), 1u);
  const std::string f = checker.failures();
  EXPECT_EQ(f.rfind("seq layer 1 length 100: DATA_LOSS: out[0]", 0), 0u) << f;
  EXPECT_NE(f.find("\n    "), std::string::npos) << "no diagnosis: " << f;  // Reference::Diagnose's line
}

TEST_F(AgainstReferenceTest, AStepThatFailedIsAMismatchWithoutDiagnosis) {
  ResultChecker checker(ResultChecker::AgainstReference(&ref_, 1, true), {});
  ResultChecker::Item item = RightItem();
  item.result.set_code(static_cast<int>(absl::StatusCode::kNotFound));
  item.result.set_message("no such sequence");
  ASSERT_TRUE(checker.Push(std::move(item)));
  checker.Flush();
  EXPECT_EQ(checker.mismatched(), 1u);
  EXPECT_EQ(checker.failures(), "seq layer 1 length 100: NOT_FOUND: step failed on the server: no such sequence");
}

TEST_F(AgainstReferenceTest, DescribesOnlyTheFirstMismatches) {
  ResultChecker checker(ResultChecker::AgainstReference(&ref_, 1, true), Bounded(0, 2));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(checker.Push(WrongItem()));
  checker.Flush();
  EXPECT_EQ(checker.mismatched(), 3u);
  const std::string f = checker.failures();
  size_t described = 0;
  for (size_t at = f.find("seq layer 1"); at != std::string::npos; at = f.find("seq layer 1", at + 1)) ++described;
  EXPECT_EQ(described, 2u) << f;
  EXPECT_NE(f.find("\n  seq layer 1"), std::string::npos) << f;  // one per line
}

// A check that waits until released, counting the items it saw.
struct Latch {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  int entered = 0;

  ResultChecker::Checks Checks() {
    ResultChecker::Checks c;
    c.check = [this](const ResultChecker::Item& item) {
      std::unique_lock<std::mutex> l(mu);
      ++entered;
      cv.notify_all();
      cv.wait(l, [&] { return open; });
      return item.layer == 0 ? absl::OkStatus() : absl::DataLossError("wrong");
    };
    return c;
  }
  void WaitEntered(int n) {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return entered >= n; });
  }
  void Open() {
    std::lock_guard<std::mutex> l(mu);
    open = true;
    cv.notify_all();
  }
};

ResultChecker::Item Layer(int layer) { return ResultChecker::Item{"s", layer, 1, "", {}}; }

TEST(ResultCheckerTest, BoundsItsQueue) {
  Latch latch;
  ResultChecker checker(latch.Checks(), Bounded(2, 1));
  ASSERT_TRUE(checker.Push(Layer(0)));
  latch.WaitEntered(1);  // the thread holds the first item; the queue is empty
  EXPECT_TRUE(checker.Push(Layer(0)));
  EXPECT_TRUE(checker.Push(Layer(1)));
  EXPECT_FALSE(checker.Push(Layer(1)));  // two waiting: dropped
  EXPECT_FALSE(checker.Push(Layer(0)));
  EXPECT_EQ(checker.skipped(), 2u);
  latch.Open();
  checker.Flush();
  EXPECT_EQ(checker.checked(), 3u);
  EXPECT_EQ(checker.mismatched(), 1u);
  EXPECT_EQ(checker.failures(), "s layer 1 length 1: DATA_LOSS: wrong");  // no explain: the line alone
  EXPECT_TRUE(checker.Push(Layer(0)));  // room again
}

TEST(ResultCheckerTest, UnboundedQueueKeepsEveryItem) {
  Latch latch;
  ResultChecker checker(latch.Checks(), {});
  ASSERT_TRUE(checker.Push(Layer(0)));
  latch.WaitEntered(1);
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(checker.Push(Layer(0)));
  latch.Open();
  checker.Flush();
  EXPECT_EQ(checker.checked(), 1001u);
  EXPECT_EQ(checker.skipped(), 0u);
}

TEST(ResultCheckerTest, DestructorRunsWhatIsQueued) {
  Latch latch;
  auto checker = std::make_unique<ResultChecker>(latch.Checks(), ResultChecker::Options{});
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(checker->Push(Layer(0)));
  latch.WaitEntered(1);
  latch.Open();
  checker.reset();
  EXPECT_EQ(latch.entered, 5);
}

}  // namespace
}  // namespace latentd::tools
