// The host tier's arena bookkeeping: blocks per layer page, the bound, refusals, and
// blocks given back on cancel and remove.
#include "engine/kv/host_tier.h"

#include <gtest/gtest.h>

#include <cstring>
#include <set>

namespace latentd::engine::kv {
namespace {

constexpr int64_t kRowBytes = 1152;  // bf16, h_kv 1
constexpr int64_t kBlock = kRowBytes * 64;

TEST(HostTierTest, CapacityRoundsDownToBlocks) {
  auto t = HostTier::Create(10 * kBlock + kBlock / 2, kRowBytes);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->block_bytes(), kBlock);
  EXPECT_EQ((*t)->arena_bytes(), 10 * kBlock);
  EXPECT_EQ((*t)->free_blocks(), 10);
  EXPECT_EQ((*t)->GetStats().capacity_bytes, 10 * kBlock);
}

TEST(HostTierTest, ReservesOneBlockPerLayerPageAndRefusesPastTheBound) {
  auto t = *HostTier::Create(10 * kBlock, kRowBytes);
  EXPECT_EQ(HostTier::BlocksFor({65, 1, 0}), 3);
  auto a = t->Reserve({65, 1, 0});  // 2 + 1 + 0 blocks
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->blocks.size(), 3u);
  EXPECT_EQ(a->blocks[0].size(), 2u);
  EXPECT_EQ(a->blocks[1].size(), 1u);
  EXPECT_EQ(a->blocks[2].size(), 0u);
  EXPECT_EQ(t->free_blocks(), 7);
  EXPECT_EQ(t->Reserve({64 * 8}), nullptr);  // 8 > 7
  EXPECT_EQ(t->GetStats().refused, 1u);
  EXPECT_EQ(t->free_blocks(), 7);
  auto b = t->Reserve({64 * 7});
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(t->free_blocks(), 0);
  // Every block handed out once, and each lies inside the arena.
  std::set<int32_t> seen;
  for (auto* e : {a.get(), b.get()})
    for (auto& layer : e->blocks)
      for (int32_t blk : layer) {
        EXPECT_TRUE(seen.insert(blk).second) << blk;
        EXPECT_GE(t->Block(blk), static_cast<char*>(t->arena()));
        EXPECT_LE(t->Block(blk) + kBlock, static_cast<char*>(t->arena()) + t->arena_bytes());
      }
  EXPECT_EQ(seen.size(), 10u);
  t->Cancel(std::move(b));
  EXPECT_EQ(t->free_blocks(), 7);
  EXPECT_EQ(t->GetStats().used_bytes, 3 * kBlock);
}

TEST(HostTierTest, CommitFindRemove) {
  auto t = *HostTier::Create(4 * kBlock, kRowBytes);
  auto e = t->Reserve({100, 100});
  ASSERT_NE(e, nullptr);
  e->id = "s1";
  e->last_used = absl::FromUnixSeconds(100);
  std::memset(t->Block(e->blocks[1][1]), 0x5a, kBlock);
  t->Commit(std::move(e));
  EXPECT_EQ(t->Find("s2"), nullptr);
  HostTier::Entry* f = t->Find("s1");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->lengths, (std::vector<int64_t>{100, 100}));
  EXPECT_EQ(t->Block(f->blocks[1][1])[kBlock - 1], 0x5a);
  EXPECT_EQ(t->GetStats().sequences, 1);
  EXPECT_EQ(t->GetStats().offloads, 1u);
  // Idle ids skip busy entries.
  EXPECT_EQ(t->IdleIds(absl::FromUnixSeconds(101)), std::vector<std::string>{"s1"});
  EXPECT_TRUE(t->IdleIds(absl::FromUnixSeconds(100)).empty());
  f->busy = true;
  EXPECT_TRUE(t->IdleIds(absl::FromUnixSeconds(101)).empty());
  f->busy = false;
  t->Remove("s1", /*restored=*/true);
  EXPECT_EQ(t->Find("s1"), nullptr);
  EXPECT_EQ(t->free_blocks(), 4);
  EXPECT_EQ(t->GetStats().restores, 1u);
  EXPECT_EQ(t->GetStats().sequences, 0);
  t->Remove("s1", true);  // gone: no-op
  EXPECT_EQ(t->GetStats().restores, 1u);
}

TEST(HostTierTest, EmptyTierRefusesEverything) {
  auto t = *HostTier::Create(kBlock - 1, kRowBytes);
  EXPECT_EQ(t->arena_bytes(), 0);
  EXPECT_EQ(t->Reserve({1}), nullptr);
  EXPECT_NE(t->Reserve({0}), nullptr);  // nothing to hold
}

}  // namespace
}  // namespace latentd::engine::kv
