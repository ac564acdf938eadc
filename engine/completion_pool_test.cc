// CompletionPool: every completion runs once, a key's in the order pushed, on threads
// other than the pusher's; a full ring makes Push wait rather than reorder or drop; the
// destructor runs everything pushed.
#include "engine/completion_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace latentd::engine {
namespace {

TEST(CompletionPoolTest, EachKeyInOrderOffThePushersThread) {
  constexpr int kSteps = 20000, kKeys = 37;
  std::vector<DecodeStep> steps(kSteps);
  for (int i = 0; i < kSteps; ++i) steps[i].request_id = static_cast<uint64_t>(i);
  std::mutex mu;
  std::map<uint64_t, std::vector<uint64_t>> seen;  // key -> request ids in completion order
  std::atomic<int> on_pusher{0}, failed{0};
  const std::thread::id pusher = std::this_thread::get_id();
  {
    CompletionPool pool(3, 64, [&](DecodeStep* const* s, const absl::Status* st, int n) {
      if (std::this_thread::get_id() == pusher) ++on_pusher;
      std::lock_guard<std::mutex> l(mu);
      for (int i = 0; i < n; ++i) {
        if (!st[i].ok()) ++failed;
        seen[s[i]->request_id % kKeys].push_back(s[i]->request_id);
      }
    });
    for (int i = 0; i < kSteps; ++i) {
      pool.Push(&steps[i], i % 101 == 0 ? absl::InternalError("x") : absl::OkStatus(), i % kKeys);
    }
  }  // the destructor runs everything pushed
  EXPECT_EQ(on_pusher.load(), 0);
  EXPECT_EQ(failed.load(), (kSteps + 100) / 101);
  size_t total = 0;
  for (const auto& [key, ids] : seen) {
    total += ids.size();
    for (size_t j = 1; j < ids.size(); ++j) ASSERT_LT(ids[j - 1], ids[j]) << "key " << key << " reordered";
  }
  EXPECT_EQ(total, static_cast<size_t>(kSteps));
}

TEST(CompletionPoolTest, AFullRingMakesPushWait) {
  std::vector<DecodeStep> steps(10);
  absl::Notification release;
  std::atomic<int> done{0};
  CompletionPool pool(1, 2, [&](DecodeStep* const*, const absl::Status*, int n) {
    release.WaitForNotification();
    done += n;
  });
  std::thread pusher([&] {
    for (auto& s : steps) pool.Push(&s, absl::OkStatus(), 0);
  });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(done.load(), 0);
  EXPECT_GE(pool.waits(), 1u) << "one running, two in the ring: the fourth Push waits";
  release.Notify();
  pusher.join();
  while (done.load() < 10) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(done.load(), 10);
}

// What arrived while a thread was busy runs as one call, in push order, statuses with it.
TEST(CompletionPoolTest, PushesThatWaitedRunTogether) {
  std::vector<DecodeStep> steps(6);
  for (int i = 0; i < 6; ++i) steps[i].request_id = static_cast<uint64_t>(i);
  absl::Notification started, release;
  std::mutex mu;
  std::vector<std::vector<uint64_t>> runs;
  std::vector<bool> ok;
  {
    CompletionPool pool(1, 16, [&](DecodeStep* const* s, const absl::Status* st, int n) {
      if (!started.HasBeenNotified()) {
        started.Notify();
        release.WaitForNotification();
      }
      std::lock_guard<std::mutex> l(mu);
      runs.emplace_back();
      for (int i = 0; i < n; ++i) {
        runs.back().push_back(s[i]->request_id);
        ok.push_back(st[i].ok());
      }
    });
    pool.Push(&steps[0], absl::OkStatus(), 0);
    started.WaitForNotification();
    for (int i = 1; i < 6; ++i) pool.Push(&steps[i], i == 3 ? absl::InternalError("x") : absl::OkStatus(), 0);
    release.Notify();
  }
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0], (std::vector<uint64_t>{0}));
  EXPECT_EQ(runs[1], (std::vector<uint64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(ok, (std::vector<bool>{true, true, true, false, true, true}));
}

TEST(CompletionPoolTest, NoThreadsRunsInline) {
  DecodeStep step;
  const std::thread::id me = std::this_thread::get_id();
  bool ran = false;
  CompletionPool pool(0, 4, [&](DecodeStep* const*, const absl::Status*, int n) {
    ran = std::this_thread::get_id() == me && n == 1;
  });
  pool.Push(&step, absl::OkStatus(), 5);
  EXPECT_TRUE(ran);
}

}  // namespace
}  // namespace latentd::engine
