// The lifetime and start rules with fake entry points instead of gRPC: the last Unref
// deletes, once; a plan's Start* calls are issued before the Finish it waited for, and
// never after it.
#include "server/decode/stream_lifetime.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace latentd::server::decode {
namespace {

struct Counted {
  explicit Counted(std::atomic<int>* deleted) : deleted(deleted) { refs.Publish(); }
  ~Counted() { deleted->fetch_add(1); }
  void Ref() { refs.Ref(); }
  void Unref() {
    if (refs.Unref()) delete this;
  }
  RefCount refs;
  std::atomic<int>* deleted;
};

TEST(RefCount, TheLastUnrefDeletesOnce) {
  std::atomic<int> deleted{0};
  auto* c = new Counted(&deleted);  // gRPC's reference
  std::vector<std::thread> threads;
  c->Ref();  // taken while gRPC's is held, for the threads below
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([c] {
      for (int i = 0; i < 1000; ++i) ScopedRef<Counted> ref(c);
    });
  }
  c->Unref();  // OnDone while the threads still hold theirs (one of them, transitively)
  EXPECT_EQ(deleted.load(), 0);
  for (auto& t : threads) t.join();
  EXPECT_EQ(deleted.load(), 0);  // the reference taken for the threads remains
  c->Unref();
  EXPECT_EQ(deleted.load(), 1);
}

// gRPC hands a new reactor to its executor (which may run OnCancel first) through
// queues ThreadSanitizer does not see; a relaxed store and load stand in for them here.
// Under --config=tsan this reports a race on the count unless RefCount tells TSan that
// construction comes first (as it does in gRPC).
TEST(RefCount, FirstRefOnAnotherThreadAfterAnUnseenHandoff) {
  std::atomic<int> deleted{0};
  std::atomic<Counted*> handoff{nullptr};
  std::thread executor([&] {
    Counted* c = nullptr;
    while ((c = handoff.load(std::memory_order_relaxed)) == nullptr) std::this_thread::yield();
    { ScopedRef<Counted> ref(c); }  // OnCancel's reference
    c->Unref();                      // gRPC's, at OnDone
  });
  handoff.store(new Counted(&deleted), std::memory_order_relaxed);
  executor.join();
  EXPECT_EQ(deleted.load(), 1);
}

// A reactor with fake entry points: a write and a read in flight hold Finish back.
struct FakeReactor {
  StartGate gate;
  std::vector<std::string> calls;
  int replans = 0;
  bool done = false;  // the stream has nothing left to do

  Plan Decide() {
    Plan p;
    if (gate.finished()) return p;
    if (done && gate.MayFinish()) {
      gate.Finishing();
      p.finish = true;
      p.status = grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
    return p;
  }
  void IssueWrite() { calls.push_back("write"); }
  void IssueRead() { calls.push_back("read"); }
  void IssueFinish(const grpc::Status& st) { calls.push_back("finish:" + st.error_message()); }
  Plan Replan() {
    ++replans;
    gate.Started();
    return Decide();
  }
};

TEST(StartRule, FinishWaitsForTheStartsDecidedBeforeIt) {
  FakeReactor r;
  Plan p;
  p.read = p.write = true;
  r.gate.Starting();  // decided under the lock with the plan
  r.done = true;      // meanwhile the stream ran out of work: no Finish while starting
  EXPECT_FALSE(r.gate.MayFinish());
  EXPECT_FALSE(r.Decide().finish);
  Act(&r, p);
  ASSERT_EQ(r.calls.size(), 3u);
  EXPECT_EQ(r.calls[0], "write");
  EXPECT_EQ(r.calls[1], "read");
  EXPECT_EQ(r.calls[2], "finish:client went away");
  EXPECT_EQ(r.replans, 1);
  EXPECT_TRUE(r.gate.finished());
  // Once finished, nothing more is decided.
  r.gate.Starting();
  EXPECT_FALSE(r.gate.MayFinish());
  EXPECT_FALSE(r.Decide().finish);
}

TEST(StartRule, APlanWithNothingToStartIssuesNothing) {
  FakeReactor r;
  Act(&r, Plan());
  EXPECT_TRUE(r.calls.empty());
  EXPECT_EQ(r.replans, 0);
  EXPECT_TRUE(r.gate.MayFinish());
}

}  // namespace
}  // namespace latentd::server::decode
