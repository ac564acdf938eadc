// Unit tests of server/auth: token comparison, the token sources and their precedence
// rule, the token file's permission check, the bearer check and the log rate limiter.
#include "server/auth.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace latentd::server {
namespace {

std::string WriteTemp(const std::string& name, const std::string& data, mode_t mode) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/auth_test-", getpid(), "-", name);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
  chmod(path.c_str(), mode);
  return path;
}

TEST(TokensEqualTest, ComparesWholeTokens) {
  EXPECT_TRUE(TokensEqual("s3cret", "s3cret"));
  EXPECT_FALSE(TokensEqual("s3creT", "s3cret"));
  EXPECT_FALSE(TokensEqual("s3cre", "s3cret"));    // a prefix
  EXPECT_FALSE(TokensEqual("s3crett", "s3cret"));  // longer
  EXPECT_FALSE(TokensEqual("", "s3cret"));
  EXPECT_FALSE(TokensEqual(std::string("s3cret\0", 7), "s3cret"));  // embedded NUL is a difference
  EXPECT_TRUE(TokensEqual(std::string(1000, 'x'), std::string(1000, 'x')));
}

TEST(ReadTokenFileTest, StripsTrailingNewline) {
  auto t = ReadTokenFile(WriteTemp("nl", "tok-123\n", 0600));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, "tok-123");
  auto crlf = ReadTokenFile(WriteTemp("crlf", "tok-456\r\n", 0400));
  ASSERT_TRUE(crlf.ok()) << crlf.status();
  EXPECT_EQ(*crlf, "tok-456");
}

TEST(ReadTokenFileTest, RefusesGroupOrWorldReadable) {
  for (mode_t mode : {0640, 0604, 0644}) {
    auto t = ReadTokenFile(WriteTemp("perm", "tok\n", mode));
    EXPECT_FALSE(t.ok()) << std::oct << mode;
    EXPECT_TRUE(absl::StrContains(t.status().message(), "--auth_token_file")) << t.status();
    EXPECT_TRUE(absl::StrContains(t.status().message(), "readable by group or others")) << t.status();
  }
}

TEST(ReadTokenFileTest, RefusesMissingEmptyAndMalformed) {
  auto missing = ReadTokenFile("/nonexistent/token");
  EXPECT_FALSE(missing.ok());
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "--auth_token_file")) << missing.status();
  auto empty = ReadTokenFile(WriteTemp("empty", "\n", 0600));
  EXPECT_FALSE(empty.ok());
  EXPECT_TRUE(absl::StrContains(empty.status().message(), "empty")) << empty.status();
  EXPECT_FALSE(ReadTokenFile(WriteTemp("space", "two words\n", 0600)).ok());
}

TEST(ResolveAuthTokenTest, OneSourceAtMost) {
  const std::string file = WriteTemp("src", "from-file\n", 0600);
  auto none = ResolveAuthToken({});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->token, "");

  auto f = ResolveAuthToken({file, std::nullopt, ""});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->token, "from-file");
  EXPECT_EQ(f->source, "--auth_token_file");
  auto e = ResolveAuthToken({"", std::string("from-env"), ""});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->token, "from-env");
  EXPECT_EQ(e->source, kAuthTokenEnv);
  auto g = ResolveAuthToken({"", std::nullopt, "from-flag"});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->source, "--auth_token");

  auto two = ResolveAuthToken({file, std::string("from-env"), ""});
  EXPECT_FALSE(two.ok());
  EXPECT_TRUE(absl::StrContains(two.status().message(), "more than once")) << two.status();
  EXPECT_FALSE(ResolveAuthToken({"", std::string("a"), "b"}).ok());
  EXPECT_FALSE(ResolveAuthToken({file, std::nullopt, "b"}).ok());
  // A variable that is set but empty is a mistake, not "no authentication".
  EXPECT_FALSE(ResolveAuthToken({"", std::string(""), ""}).ok());
}

TEST(CheckBearerTest, MissingWrongAndRight) {
  std::multimap<grpc::string_ref, grpc::string_ref> md;
  EXPECT_EQ(CheckBearer(md, "tok").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  md.emplace("authorization", "Bearer tok");
  EXPECT_TRUE(CheckBearer(md, "tok").ok());
  EXPECT_EQ(CheckBearer(md, "tox").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(CheckBearer(md, "tokk").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  std::multimap<grpc::string_ref, grpc::string_ref> basic;
  basic.emplace("authorization", "Basic tok");
  const grpc::Status st = CheckBearer(basic, "tok");
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_FALSE(absl::StrContains(st.error_message(), "Basic tok"));  // never echoed
}

TEST(LogRateLimiterTest, OneLinePerIntervalWithCount) {
  LogRateLimiter limiter(absl::Seconds(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  uint64_t suppressed = 99;
  EXPECT_TRUE(limiter.Allow(t0, &suppressed));
  EXPECT_EQ(suppressed, 0u);
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(limiter.Allow(t0 + absl::Milliseconds(100 * i), &suppressed));
  EXPECT_TRUE(limiter.Allow(t0 + absl::Seconds(1), &suppressed));
  EXPECT_EQ(suppressed, 5u);
  EXPECT_TRUE(limiter.Allow(t0 + absl::Seconds(3), &suppressed));
  EXPECT_EQ(suppressed, 0u);
}

TEST(RecordAuthFailureTest, Counts) {
  const uint64_t before = AuthFailures();
  const grpc::Status st(grpc::StatusCode::UNAUTHENTICATED, "metadata authorization: missing");
  for (int i = 0; i < 3; ++i) RecordAuthFailure("/x.Y/Z", "ipv4:127.0.0.1:1", st);
  EXPECT_EQ(AuthFailures(), before + 3);
}

}  // namespace
}  // namespace latentd::server
