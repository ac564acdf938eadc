// The page-key chain against bytes computed independently (Python's hashlib, the
// formula of page_keys.h), so the C++ and Python clients name pages alike.
#include "clients/cpp/page_keys.h"

#include <gtest/gtest.h>

#include <vector>

#include "absl/strings/escaping.h"

namespace latentd::client {
namespace {

std::vector<int64_t> Tokens(int n) {
  std::vector<int64_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (int64_t{i} * 7919 + 13) % 129280;
  return t;
}

std::vector<std::string> Hex(const std::vector<std::string>& keys) {
  std::vector<std::string> h;
  for (const std::string& k : keys) h.push_back(absl::BytesToHexString(k));
  return h;
}

// python3: parent = sha256(b"latentd.page_key.v1" + struct.pack("<Q", len(salt)) + salt)[:16];
// per page: parent = sha256(parent + struct.pack("<64q", *page))[:16].
TEST(PageKeys, MatchAnIndependentImplementation) {
  EXPECT_EQ(Hex(PageKeys(Tokens(200))),
            (std::vector<std::string>{"993f763e15cd48180d5d806e7838563a", "3b01f31f81a7f3d4104608be2a8cf3f8",
                                      "6f7028a8268e5db4f0ee1a75ebd6fb2e"}));
  EXPECT_EQ(Hex(PageKeys(Tokens(200), "tenant-a")),
            (std::vector<std::string>{"ad28246e1f940208e41a1c5e7c61f9ab", "8e144efd59cfcac22e04fe61388a5863",
                                      "423c8140fb0c2232a3b697d90b44c77e"}));
}

TEST(PageKeys, OnlyFullPagesAndTheChainDependsOnEveryEarlierToken) {
  EXPECT_TRUE(PageKeys(Tokens(63)).empty());
  EXPECT_EQ(PageKeys(Tokens(128)).size(), 2u);
  std::vector<int64_t> a = Tokens(192), b = a;
  b[5] += 1;  // a change in the first page changes every key after it
  const auto ka = PageKeys(a), kb = PageKeys(b);
  for (int i = 0; i < 3; ++i) EXPECT_NE(ka[i], kb[i]) << i;
  b = a;
  b[130] += 1;  // a change in the third page leaves the first two
  const auto kc = PageKeys(b);
  EXPECT_EQ(ka[0], kc[0]);
  EXPECT_EQ(ka[1], kc[1]);
  EXPECT_NE(ka[2], kc[2]);
  for (const std::string& k : ka) EXPECT_EQ(k.size(), 16u);
}

}  // namespace
}  // namespace latentd::client
