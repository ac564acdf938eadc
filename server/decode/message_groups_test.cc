// The message rule without a daemon: groups open in message order, a group's slots are
// held until its last step is answered, and released groups leave from the front only.
#include "server/decode/message_groups.h"

#include <vector>

#include "gtest/gtest.h"

namespace latentd::server::decode {
namespace {

int Held(const Group* g) {
  int n = 0;
  for (const Slot* s = g->held; s != nullptr; s = s->group_next) ++n;
  return n;
}

TEST(MessageGroups, AGroupIsReleasedWhenItsLastStepIsAnswered) {
  MessageGroups groups;
  Group* g = groups.New();
  Slot a, b, bad;
  a.group = b.group = bad.group = g->id;
  g->remaining = 2;
  MessageGroups::Hold(g, &bad);  // failed validation: held from the start
  EXPECT_FALSE(groups.Answered(&a));
  EXPECT_EQ(Held(g), 2);
  EXPECT_TRUE(groups.Answered(&b));
  EXPECT_EQ(Held(groups.Find(a.group)), 3);
}

TEST(MessageGroups, OnlyTheFrontLeavesAndTheRingGrowsInOrder) {
  MessageGroups groups;
  std::vector<uint64_t> ids;
  for (int i = 0; i < 9; ++i) {  // past the first capacity (4) twice
    Group* g = groups.New();
    g->remaining = 1;
    ids.push_back(g->id);
  }
  EXPECT_EQ(groups.open(), 9u);
  for (size_t i = 1; i < ids.size(); ++i) EXPECT_EQ(ids[i], ids[i - 1] + 1);
  for (uint64_t id : ids) EXPECT_EQ(groups.Find(id)->id, id);
  // The second message finishes first: nothing leaves while the first is open.
  groups.Find(ids[1])->remaining = 0;
  groups.PopReleased();
  EXPECT_EQ(groups.open(), 9u);
  groups.Find(ids[0])->remaining = 0;
  groups.PopReleased();
  EXPECT_EQ(groups.open(), 7u);
  EXPECT_EQ(groups.Find(ids[2])->id, ids[2]);
  // A released group that still holds results stays until they are taken.
  Slot s;
  Group* g2 = groups.Find(ids[2]);
  g2->remaining = 0;
  MessageGroups::Hold(g2, &s);
  groups.PopReleased();
  EXPECT_EQ(groups.open(), 7u);
  g2->held = nullptr;
  groups.PopReleased();
  EXPECT_EQ(groups.open(), 6u);
}

}  // namespace
}  // namespace latentd::server::decode
