// The host tier through the engine: idle sequences move out and come back byte for
// byte (decode results checked against the oracle, exports identical), a pool of N
// pages serves 4N pages of sequences under a least-recently-used access pattern, a
// full tier refuses without losing anything, and offloaded ids stay taken, releasable
// and counted. Pools are poisoned (NaN in every row nobody wrote).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/testing/backend_under_test.h"
#include "engine/testing/engine_harness.h"

namespace latentd::engine {
namespace {

using testing::Harness;

constexpr bool kExact = testing::kExactUnderTest;
constexpr int64_t kPageBytes = 64 * 1152;  // one layer's page of bf16 rows, h_kv 1

class HostTierEngineTest : public ::testing::Test {
 public:
  void SetUp() override { setenv("LATENTD_KV_POISON", "1", 1); }

  static std::unique_ptr<Engine> Make(int layers, int64_t pages, int64_t host_bytes, int64_t max_sequences = 0) {
    EngineOptions o;
    o.backend = testing::kBackendUnderTest;
    o.model.num_layers = layers;
    o.model.num_heads_q = 16;
    o.kv_pages = pages;
    o.cpu_threads = 2;
    o.host_kv_bytes = host_bytes;
    o.max_sequences = max_sequences;
    auto e = Engine::Create(o);
#ifdef LATENTD_TEST_CUDA
    if (!e.ok()) return nullptr;
#endif
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }

  // One step on each layer of `id`, submitted and checked against the oracle.
  static void StepAndCheck(Harness& h, const std::string& id, int layers, int s_q = 1) {
    std::vector<Harness::Pending*> steps;
    for (int l = 0; l < layers; ++l) steps.push_back(h.MakeStep(id, l, s_q, true));
    for (auto* p : steps) ASSERT_TRUE(h.Submit(p).ok());
    ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
    for (auto* p : steps) {
      ASSERT_TRUE(p->status.ok()) << id << " layer " << p->step.layer << ": " << p->status;
      EXPECT_TRUE(h.Check(*p, kExact)) << id << " layer " << p->step.layer;
    }
  }

  static std::string ExportBytes(Engine* e, const std::string& id) {
    auto ex = e->ExportSequence(id);
    EXPECT_TRUE(ex.ok()) << ex.status();
    if (!ex.ok()) return "";
    std::string all;
    for (;;) {
      SequenceExportChunk c;
      auto more = (*ex)->Next(size_t{1} << 20, &c);
      EXPECT_TRUE(more.ok()) << more.status();
      if (!more.ok() || !*more) break;
      all += c.bytes;
    }
    return all;
  }
};

TEST_F(HostTierEngineTest, IdleSequencesMoveOutAndComeBackExactly) {
  auto e = Make(2, 64, 64 * kPageBytes);
  if (e == nullptr) GTEST_SKIP() << "no CUDA device";
  Harness h(e.get(), 7);
  const std::string a = h.NewSequence(130, "a");
  const std::string b = h.NewSequence(64, "b");
  StepAndCheck(h, a, 2);
  StepAndCheck(h, b, 2);
  const std::string b_rows = ExportBytes(e.get(), b);
  const EngineInfo before = e->Info();

  EXPECT_EQ(e->OffloadIdleSequences(absl::Hours(1)), 0);  // nothing idle that long
  EXPECT_EQ(e->OffloadIdleSequences(absl::ZeroDuration()), 2);
  EngineMetrics m = e->Metrics();
  EXPECT_EQ(m.host_tier_sequences, 2);
  EXPECT_EQ(m.host_offloads, 2u);
  EXPECT_EQ(m.host_tier_used_bytes, (3 + 3 + 2 + 2) * kPageBytes);  // a: 131 rows per layer, b: 65
  EXPECT_EQ(m.host_tier_capacity_bytes, 64 * kPageBytes);
  EXPECT_EQ(m.sequences, 0);
  EXPECT_EQ(e->Info().free_pages, before.total_pages);
  auto info = e->GetSequence(a);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->offloaded);
  EXPECT_EQ(info->pages, 0);
  EXPECT_EQ(info->lengths, (std::vector<int64_t>{131, 131}));

  // A step brings `a` back before it runs; its results are the oracle's bits.
  StepAndCheck(h, a, 2);
  StepAndCheck(h, a, 2, 3);
  info = e->GetSequence(a);
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->offloaded);
  EXPECT_EQ(info->lengths, (std::vector<int64_t>{135, 135}));
  // An export reads `b` from the tier as it lies (a draining daemon needs no pages to
  // move it): the very bytes it had, and it stays offloaded.
  EXPECT_EQ(ExportBytes(e.get(), b), b_rows);
  EXPECT_TRUE(e->GetSequence(b)->offloaded);
  EXPECT_EQ(e->Metrics().host_restores, 1u);
  StepAndCheck(h, b, 2);
  m = e->Metrics();
  EXPECT_EQ(m.host_restores, 2u);
  EXPECT_EQ(m.host_tier_sequences, 0);
  EXPECT_EQ(m.host_tier_used_bytes, 0);
  EXPECT_EQ(m.host_restore_failures, 0u);
  // An offloaded id is taken for forks too.
  ASSERT_EQ(e->OffloadIdleSequences(absl::ZeroDuration()), 2);
  EXPECT_TRUE(absl::IsAlreadyExists(e->ForkSequence(b, a).status()));
}

// An export that began with the sequence in the pool goes on from the tier once it moved
// out, and one that began in the tier goes on from the pool once it came back: the same
// bytes either way (rows appended after the export began are not part of it).
TEST_F(HostTierEngineTest, AnExportFollowsItsSequenceBetweenTiers) {
  auto e = Make(2, 64, 64 * kPageBytes);
  if (e == nullptr) GTEST_SKIP() << "no CUDA device";
  Harness h(e.get(), 13);
  const std::string a = h.NewSequence(200, "a");
  const std::string want = ExportBytes(e.get(), a);
  auto read = [&](bool offload_first) {
    auto ex = e->ExportSequence(a);
    EXPECT_TRUE(ex.ok()) << ex.status();
    if (!ex.ok()) return std::string();
    std::string got;
    for (int chunk = 0;; ++chunk) {
      if (chunk == 2) {
        if (offload_first) {
          StepAndCheck(h, a, 2);  // brings it back, one row longer per layer
        } else {
          EXPECT_EQ(e->OffloadIdleSequences(absl::ZeroDuration()), 1);
        }
      }
      SequenceExportChunk c;
      auto more = (*ex)->Next(50 * 1152, &c);
      EXPECT_TRUE(more.ok()) << more.status();
      if (!more.ok() || !*more) break;
      got += c.bytes;
    }
    return got;
  };
  EXPECT_EQ(read(/*offload_first=*/false), want);
  EXPECT_TRUE(e->GetSequence(a)->offloaded);
  EXPECT_EQ(ExportBytes(e.get(), a), want);
  EXPECT_EQ(read(/*offload_first=*/true), want);  // begins in the tier, a step brings it back
  EXPECT_FALSE(e->GetSequence(a)->offloaded);
  // Released while offloaded: the export ends NOT_FOUND.
  ASSERT_EQ(e->OffloadIdleSequences(absl::ZeroDuration()), 1);
  auto ex = e->ExportSequence(a);
  ASSERT_TRUE(ex.ok());
  ASSERT_TRUE(e->ReleaseSequence(a).ok());
  SequenceExportChunk c;
  EXPECT_TRUE(absl::IsNotFound((*ex)->Next(1 << 20, &c).status()));
}

TEST_F(HostTierEngineTest, AppendAndForkOfAnOffloadedSequenceBringItBack) {
  auto e = Make(2, 64, 64 * kPageBytes);
  if (e == nullptr) GTEST_SKIP() << "no CUDA device";
  Harness h(e.get(), 8);
  const std::string a = h.NewSequence(100, "a");
  ASSERT_EQ(e->OffloadIdleSequences(absl::ZeroDuration()), 1);
  const std::string fork = h.Fork(a);  // restores, then forks
  ASSERT_FALSE(fork.empty());
  StepAndCheck(h, fork, 2);
  StepAndCheck(h, a, 2);
  ASSERT_EQ(e->OffloadIdleSequences(absl::ZeroDuration()), 2);
  auto appended = e->AppendKv(a, 1, std::string(3 * 1152, '\x3c'));
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(appended->lengths, (std::vector<int64_t>{101, 104}));
  EXPECT_FALSE(e->GetSequence(a)->offloaded);
  EXPECT_TRUE(e->GetSequence(fork)->offloaded);
}

// A pool of 16 pages serves 16 sequences of 4 pages each (4x the pool) visited round
// robin, least recently used first: each visit moves others out to make room and brings
// the visited one back; every result is exact.
TEST_F(HostTierEngineTest, PoolServesFourTimesItsPagesUnderLruAccess) {
  constexpr int kSeqs = 16;
  auto e = Make(2, 16, 2 * kSeqs * 4 * kPageBytes);
  if (e == nullptr) GTEST_SKIP() << "no CUDA device";
  Harness h(e.get(), 9);
  std::vector<std::string> ids;
  for (int i = 0; i < kSeqs; ++i) ids.push_back(h.NewSequence(3 * 64 + 10, "s" + std::to_string(i)));
  for (const auto& id : ids) ASSERT_FALSE(id.empty());
  for (int round = 0; round < 3; ++round)
    for (const auto& id : ids) StepAndCheck(h, id, 2);
  const EngineMetrics m = e->Metrics();
  EXPECT_GT(m.host_offloads, 0u);
  EXPECT_GT(m.host_restores, 0u);
  EXPECT_EQ(m.host_restore_failures, 0u);
  EXPECT_LE(m.pages_used, 16);
  EXPECT_EQ(m.sequences + m.host_tier_sequences, kSeqs);
}

// The tier holds one sequence's two pages: a second cannot move out, so the pool
// refuses as it would without a tier, and nothing acknowledged is lost.
TEST_F(HostTierEngineTest, AFullTierRefusesAndLosesNothing) {
  auto e = Make(1, 6, 2 * kPageBytes);
  if (e == nullptr) GTEST_SKIP() << "no CUDA device";
  Harness h(e.get(), 10);
  const std::string a = h.NewSequence(100, "a");  // 2 pages
  const std::string b = h.NewSequence(100, "b");  // 2 pages
  ASSERT_TRUE(e->CreateSequence("c").ok());
  const std::string page(64 * 1152, '\x3c');
  ASSERT_TRUE(e->AppendKv("c", 0, page + page).ok());  // the pool's last 2 pages
  // One more page for c: a (least recently used) moves out and fills the tier.
  auto appended = e->AppendKv("c", 0, page);
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_TRUE(e->GetSequence(a)->offloaded);
  // Two more: b cannot move out (the tier is full), so the pool refuses.
  auto refused = e->AppendKv("c", 0, page + page);
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_GT(e->Metrics().host_offload_refused, 0u);
  // Bringing a back needs 2 pages with 1 free, and b cannot make room: the step fails,
  // a stays offloaded.
  Harness::Pending* p = h.MakeStep(a, 0, 1, true);
  ASSERT_TRUE(h.Submit(p).ok());
  ASSERT_TRUE(h.WaitAll(absl::Seconds(60)));
  EXPECT_TRUE(absl::IsResourceExhausted(p->status)) << p->status;
  h.Rollback(p);
  EXPECT_EQ(e->Metrics().host_restore_failures, 1u);
  EXPECT_TRUE(e->GetSequence(a)->offloaded);
  ASSERT_TRUE(e->ReleaseSequence("c").ok());
  StepAndCheck(h, a, 1);  // now it fits
  StepAndCheck(h, b, 1);
}

TEST_F(HostTierEngineTest, OffloadedIdsStayTakenReleasableAndCounted) {
  auto e = Make(1, 16, 16 * kPageBytes, /*max_sequences=*/2);
  if (e == nullptr) GTEST_SKIP() << "no CUDA device";
  Harness h(e.get(), 11);
  h.NewSequence(10, "a");
  ASSERT_EQ(e->OffloadIdleSequences(absl::ZeroDuration()), 1);
  EXPECT_TRUE(absl::IsAlreadyExists(e->CreateSequence("a").status()));
  EXPECT_TRUE(absl::IsAlreadyExists(e->CreateSequenceWithPrefix("a", {}).status()));
  h.NewSequence(10, "b");
  // a (offloaded) and b count against max_sequences = 2.
  EXPECT_TRUE(absl::IsResourceExhausted(e->CreateSequence("c").status()));
  EXPECT_TRUE(absl::IsResourceExhausted(e->ForkSequence("b", "c").status()));
  auto freed = e->ReleaseSequence("a");
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 0);
  EXPECT_TRUE(absl::IsNotFound(e->GetSequence("a").status()));
  EXPECT_EQ(e->Metrics().host_tier_used_bytes, 0);
  EXPECT_TRUE(absl::IsAlreadyExists(e->ForkSequence("b", "b").status()));
  auto c = e->CreateSequence("c");
  EXPECT_TRUE(c.ok()) << c.status();
  // The idle TTL releases offloaded sequences too.
  ASSERT_EQ(e->OffloadIdleSequences(absl::ZeroDuration()), 2);
  EXPECT_EQ(e->ReleaseIdleSequences(absl::ZeroDuration()), 2);
  EXPECT_EQ(e->Metrics().host_tier_sequences, 0);
  EXPECT_TRUE(absl::IsNotFound(e->GetSequence("b").status()));
}

// Pages with published keys go to the prefix cache when their sequences move out, and a
// restore attaches them again instead of copying: two sequences sharing a 2-page prefix
// come back sharing it, rows identical.
TEST_F(HostTierEngineTest, SharedPrefixPagesAreAttachedOnRestore) {
  auto e = Make(2, 16, 16 * kPageBytes);
  if (e == nullptr) GTEST_SKIP() << "no CUDA device";
  const std::vector<std::string> keys = {std::string(16, 'a'), std::string(16, 'b')};
  std::string rows(138 * 1152, '\0');
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<char>((i * 131) >> 3);
  ASSERT_TRUE(e->CreateSequenceWithPrefix("p1", keys).ok());
  for (int l = 0; l < 2; ++l) ASSERT_TRUE(e->AppendKv("p1", l, absl::string_view(rows).substr(0, 128 * 1152)).ok());
  auto p2 = e->CreateSequenceWithPrefix("p2", keys);
  ASSERT_TRUE(p2.ok());
  EXPECT_EQ(p2->prefix_tokens, 128);
  for (int l = 0; l < 2; ++l) ASSERT_TRUE(e->AppendKv("p2", l, absl::string_view(rows).substr(128 * 1152)).ok());
  const std::string p1_rows = ExportBytes(e.get(), "p1"), p2_rows = ExportBytes(e.get(), "p2");
  EXPECT_EQ(e->Metrics().pages_used, 3);
  ASSERT_EQ(e->OffloadIdleSequences(absl::ZeroDuration()), 2);
  EXPECT_EQ(e->Metrics().pages_cached, 2);
  EXPECT_EQ(ExportBytes(e.get(), "p2"), p2_rows);  // read from the tier
  // An append brings each back; the new row lands after the rows it had.
  const std::string row(1152, '\x11');
  ASSERT_TRUE(e->AppendKv("p2", 1, row).ok());
  ASSERT_TRUE(e->AppendKv("p1", 1, row).ok());
  EXPECT_EQ(ExportBytes(e.get(), "p2"), p2_rows + row);
  EXPECT_EQ(ExportBytes(e.get(), "p1"), p1_rows + row);
  const EngineMetrics m = e->Metrics();
  EXPECT_EQ(m.host_restores, 2u);
  // The prefix is shared again, not copied twice: 2 shared pages, and one page each
  // for p2's tail and p1's new row.
  EXPECT_EQ(m.pages_used, 4);
  EXPECT_EQ(e->GetSequence("p2")->shared_pages, 2);
}

TEST_F(HostTierEngineTest, WithoutATierNothingMoves) {
  auto e = Make(1, 16, 0);
  if (e == nullptr) GTEST_SKIP() << "no CUDA device";
  Harness h(e.get(), 12);
  h.NewSequence(10, "a");
  EXPECT_EQ(e->OffloadIdleSequences(absl::ZeroDuration()), 0);
  EXPECT_FALSE(e->GetSequence("a")->offloaded);
  EXPECT_EQ(e->Metrics().host_tier_capacity_bytes, 0);
}

}  // namespace
}  // namespace latentd::engine
