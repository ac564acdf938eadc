// The consistent-hash ring: the fixed table both clients must reproduce
// (testdata/ring_table.txt, also checked by the Python client's test), the hash's known
// values, the spread over targets, and that removing a target moves only its keys.
#include "clients/cpp/hash_ring.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace latentd::client {
namespace {

std::string TablePath() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  const std::string rel = "clients/cpp/testdata/ring_table.txt";
  if (srcdir == nullptr) return rel;
  return absl::StrCat(srcdir, "/", workspace != nullptr ? workspace : "latentd", "/", rel);
}

std::string Key(const std::string& field) { return field == "<empty>" ? "" : field; }

TEST(HashRingTest, Fnv1aKnownValues) {
  // The published FNV-1a 64 test vectors.
  EXPECT_EQ(Fnv1a64(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(Fnv1a64("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(Fnv1a64("foobar"), 0x85944171f73967e8ULL);
  EXPECT_EQ(Fmix64(0), 0u);
}

TEST(HashRingTest, MatchesTheTableThePythonClientChecks) {
  std::ifstream f(TablePath());
  ASSERT_TRUE(f.good()) << TablePath();
  std::map<std::string, HashRing> rings;
  std::string line;
  int checked = 0;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> w = absl::StrSplit(line, ' ');
    ASSERT_GE(w.size(), 3u) << line;
    if (w[0] == "ring") {
      int vn = 0;
      ASSERT_TRUE(absl::SimpleAtoi(w[2], &vn)) << line;
      rings.emplace(w[1], HashRing(std::vector<std::string>(w.begin() + 3, w.end()), vn));
    } else if (w[0] == "hash") {
      uint64_t want = 0;
      ASSERT_TRUE(absl::SimpleHexAtoi(w[2], &want)) << line;
      EXPECT_EQ(RouteHash(Key(w[1])), want) << line;
      ++checked;
    } else if (w[0] == "owner") {
      ASSERT_EQ(w.size(), 4u) << line;
      ASSERT_TRUE(rings.count(w[1])) << line;
      EXPECT_EQ(absl::StrCat(rings.at(w[1]).Owner(Key(w[2]))), w[3]) << line;
      ++checked;
    } else if (w[0] == "preference") {
      ASSERT_EQ(w.size(), 4u) << line;
      ASSERT_TRUE(rings.count(w[1])) << line;
      EXPECT_EQ(absl::StrJoin(rings.at(w[1]).Preference(Key(w[2])), ","), w[3]) << line;
      ++checked;
    } else if (w[0] == "salted") {
      ASSERT_EQ(w.size(), 4u) << line;
      int k = 0;
      ASSERT_TRUE(absl::SimpleAtoi(w[2], &k)) << line;
      EXPECT_EQ(SaltedRoute(Key(w[1]), k), w[3]) << line;
      ++checked;
    } else {
      FAIL() << "unknown line: " << line;
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(HashRingTest, SpreadsKeysOverEveryTarget) {
  HashRing ring({"127.0.0.1:50051", "127.0.0.1:50052", "127.0.0.1:50053"});
  std::vector<int> count(3, 0);
  const int n = 30000;
  for (int i = 0; i < n; ++i) ++count[ring.Owner(absl::StrCat("seq-", i))];
  for (int c : count) {
    EXPECT_GT(c, n / 3 * 0.75);
    EXPECT_LT(c, n / 3 * 1.25);
  }
}

TEST(HashRingTest, OrderOfTargetsDoesNotMatter) {
  HashRing a({"x:1", "y:1", "z:1"});
  HashRing b({"z:1", "x:1", "y:1"});
  for (int i = 0; i < 1000; ++i) {
    const std::string key = absl::StrCat("k", i);
    EXPECT_EQ(a.target(a.Owner(key)), b.target(b.Owner(key))) << key;
  }
}

TEST(HashRingTest, RemovingATargetMovesOnlyItsKeys) {
  HashRing four({"h:1", "h:2", "h:3", "h:4"});
  HashRing three({"h:1", "h:2", "h:4"});
  int moved = 0;
  for (int i = 0; i < 5000; ++i) {
    const std::string key = absl::StrCat("seq-", i);
    const std::string before = four.target(four.Owner(key));
    const std::string after = three.target(three.Owner(key));
    if (before != "h:3") {
      EXPECT_EQ(before, after) << key;
    } else {
      ++moved;
      // It goes where the four-target ring's walk would have sent it next.
      const std::vector<int> pref = four.Preference(key);
      ASSERT_EQ(pref.size(), 4u);
      EXPECT_EQ(after, four.target(pref[1])) << key;
    }
  }
  EXPECT_GT(moved, 0);
}

TEST(HashRingTest, PreferenceListsEveryTargetOnceOwnerFirst) {
  HashRing ring({"a:1", "b:1", "c:1", "d:1", "e:1"}, 4);
  for (int i = 0; i < 200; ++i) {
    const std::string key = absl::StrCat("p", i);
    std::vector<int> pref = ring.Preference(key);
    ASSERT_EQ(pref.size(), 5u);
    EXPECT_EQ(pref[0], ring.Owner(key));
    std::sort(pref.begin(), pref.end());
    EXPECT_EQ(pref, (std::vector<int>{0, 1, 2, 3, 4}));
  }
  EXPECT_EQ(HashRing({}).Owner("x"), -1);
  EXPECT_TRUE(HashRing({}).Preference("x").empty());
}

}  // namespace
}  // namespace latentd::client
