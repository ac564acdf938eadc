// Authentication end to end: the token from a file or the environment (and the start-up
// refusals), reflection behind the token, health open but with bounded Watch streams,
// and refused calls counted and logged without flooding the log or echoing the token.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "proto/health.grpc.pb.h"
#include "tests/integration/daemon.h"

namespace latentd::testing {
namespace {

using absl::StatusCode;

constexpr char kReflectionMethod[] = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";

std::string WriteTokenFile(const std::string& contents, mode_t mode) {
  const std::string path = TempDir("token") + "/token";
  std::ofstream(path, std::ios::trunc) << contents;
  chmod(path.c_str(), mode);
  return path;
}

std::shared_ptr<grpc::Channel> Channel(const Daemon& daemon) {
  return grpc::CreateChannel(daemon.target(), grpc::InsecureChannelCredentials());
}

// One reflection exchange (list_services) sent as a unary call over the bidi method: the
// server answers the one request and ends the stream when the client half-closes.
// Returns the status and the raw response bytes.
grpc::Status ListServices(const Daemon& daemon, const std::string& token, std::string* response) {
  grpc::GenericStub stub(Channel(daemon));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  // ServerReflectionRequest{list_services: ""}: field 7, length-delimited, empty.
  const std::string request_bytes("\x3a\x00", 2);
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer reply;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&ctx, kReflectionMethod, grpc::StubOptions(), &request, &reply, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  done.WaitForNotification();
  response->clear();
  std::vector<grpc::Slice> slices;
  if (status.ok() && reply.Dump(&slices).ok()) {
    for (const auto& s : slices) response->append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return status;
}

grpc::Status GetInfo(const Daemon& daemon, const std::string& token) {
  auto stub = v1::DecodeService::NewStub(Channel(daemon));
  grpc::ClientContext ctx;
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  v1::ServerInfo info;
  return stub->GetInfo(&ctx, v1::GetInfoRequest(), &info);
}

TEST(AuthTest, ReflectionNeedsTheTokenFromAFile) {
  const std::string token = "file-token-0123456789";
  Daemon daemon({"--auth_token_file=" + WriteTokenFile(token + "\n", 0600)});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  EXPECT_TRUE(absl::StrContains(daemon.Log(), "auth on (--auth_token_file)")) << daemon.Log();

  std::string reply;
  grpc::Status none = ListServices(daemon, "", &reply);
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED) << none.error_message();
  EXPECT_TRUE(absl::StrContains(none.error_message(), "authorization")) << none.error_message();
  EXPECT_EQ(ListServices(daemon, "file-token", &reply).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(ListServices(daemon, token + "0", &reply).error_code(), grpc::StatusCode::UNAUTHENTICATED);

  grpc::Status ok = ListServices(daemon, token, &reply);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_TRUE(absl::StrContains(reply, "latentd.v1.DecodeService")) << reply;

  // DecodeService: a token of another length (shorter, longer) is refused like any other.
  EXPECT_EQ(GetInfo(daemon, "x").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(GetInfo(daemon, token + token).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(GetInfo(daemon, token).ok());

  // Health answers probes without a token.
  client::ClientOptions o;
  o.auth_token = token;
  auto c = daemon.Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto health = grpc::health::v1::Health::NewStub(Channel(daemon));
  grpc::ClientContext hctx;
  grpc::health::v1::HealthCheckResponse hresp;
  ASSERT_TRUE(health->Check(&hctx, grpc::health::v1::HealthCheckRequest(), &hresp).ok());
  EXPECT_EQ(hresp.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  // No TLS on this daemon: the start-up warning says the token travels in clear text.
  EXPECT_TRUE(absl::StrContains(daemon.Log(), "auth token set without TLS")) << daemon.Log();
  EXPECT_TRUE(absl::StrContains(daemon.Log(), "clear text")) << daemon.Log();
  // The token came from a file: no warning about ps.
  EXPECT_FALSE(absl::StrContains(daemon.Log(), "visible in ps")) << daemon.Log();
}

TEST(AuthTest, FailuresAreCountedAndLoggedAtMostOncePerSecond) {
  const std::string token = "count-token";
  Daemon daemon({"--auth_token=" + token, "--stats_interval_s=1"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  EXPECT_TRUE(absl::StrContains(daemon.Log(), "visible in ps")) << daemon.Log();

  std::string reply;
  // Six refusals in quick succession, then one more after a second: two log lines.
  const absl::Time first = absl::Now();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(ListServices(daemon, "bad-token-presented", &reply).error_code(),
                                        grpc::StatusCode::UNAUTHENTICATED);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(GetInfo(daemon, "bad-token-presented").error_code(),
                                        grpc::StatusCode::UNAUTHENTICATED);
  // Whether the six fell within the limiter's one-second window depends on the machine
  // (six calls under TSan on a loaded one can take longer); only then is the number of
  // lines known. The total is checked either way.
  const bool quick = absl::Now() - first < absl::Milliseconds(900);
  absl::SleepFor(absl::Milliseconds(1100));
  EXPECT_EQ(GetInfo(daemon, "").error_code(), grpc::StatusCode::UNAUTHENTICATED);

  // A step so that the (quiet while idle) stats line is written.
  client::ClientOptions o;
  o.auth_token = token;
  auto c = daemon.Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto seq = (*c)->CreateSequence();
  ASSERT_TRUE(seq.ok()) << seq.status();
  v1::DecodeStep step;
  step.set_request_id(1);
  step.set_sequence_id(*seq);
  step.set_q(std::string((*c)->shape().q_row_bytes, '\0'));
  step.set_kv(std::string((*c)->shape().kv_row_bytes, '\0'));
  ASSERT_TRUE((*c)->DecodeAll({step}).ok());
  const absl::Time deadline = absl::Now() + HangGuard(absl::Seconds(10));
  while (!absl::StrContains(daemon.Log(), "auth failures") && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(100));

  const std::string log = daemon.Log();
  EXPECT_FALSE(absl::StrContains(log, "bad-token-presented")) << "the presented token was logged:\n" << log;
  std::smatch m;
  EXPECT_TRUE(std::regex_search(log, m, std::regex("auth failures ([0-9]+)"))) << log;
  if (!m.empty()) {
    EXPECT_EQ(m[1], "7") << log;
  }
  int lines = 0;
  for (size_t at = log.find("auth: refused"); at != std::string::npos; at = log.find("auth: refused", at + 1)) ++lines;
  EXPECT_GE(lines, 2) << log;
  EXPECT_LE(lines, 7) << log;
  EXPECT_TRUE(absl::StrContains(log, "; 7 in total")) << log;
  if (quick) {
    EXPECT_EQ(lines, 2) << log;
    EXPECT_TRUE(absl::StrContains(log, "5 more refused since the previous line; 7 in total")) << log;
  }
  // The first line names the reflection method, the second DecodeService.
  EXPECT_TRUE(absl::StrContains(log, "refused /grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"))
      << log;
}

// The refusal lines name the peer, which shows what the clients cannot: two Clients of
// one process get TCP connections of their own (ClientOptions::own_connection, the
// default), and with own_connection false they share one (gRPC's global subchannel
// pool). Both clients of a pair are alive while both calls are refused.
TEST(AuthTest, ClientsOwnTheirConnections) {
  const std::string token = "peer-token";
  Daemon daemon({"--auth_token=" + token});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  client::ClientOptions good;
  good.auth_token = token;
  auto info_client = daemon.Connect(good);
  ASSERT_TRUE(info_client.ok()) << info_client.status();
  const v1::ServerInfo info = (*info_client)->info();

  // Ports of the peers the refusal lines name, in order.
  auto peer_ports = [&] {
    std::vector<std::string> ports;
    const std::string log = daemon.Log();
    const std::regex line("auth: refused [^ ]+ from ipv4:127\\.0\\.0\\.1:([0-9]+)");
    for (auto it = std::sregex_iterator(log.begin(), log.end(), line); it != std::sregex_iterator(); ++it)
      ports.push_back((*it)[1]);
    return ports;
  };
  auto refused_pair = [&](bool own) {
    client::ClientOptions bad;
    bad.target = daemon.target();
    bad.auth_token = "wrong";
    bad.own_connection = own;
    auto a = client::Client::Open(bad, info);
    auto b = client::Client::Open(bad, info);
    for (auto* c : {a.get(), b.get()}) {
      EXPECT_EQ(c->CreateSequence().status().code(), StatusCode::kUnauthenticated);
      absl::SleepFor(absl::Milliseconds(1100));  // one refusal line per second
    }
  };
  refused_pair(true);
  refused_pair(false);
  const std::vector<std::string> ports = peer_ports();
  ASSERT_EQ(ports.size(), 4u) << daemon.Log();
  EXPECT_NE(ports[0], ports[1]) << "own_connection: the two clients shared a connection\n" << daemon.Log();
  EXPECT_EQ(ports[2], ports[3]) << "own_connection false: expected one shared connection\n" << daemon.Log();
}

TEST(AuthTest, TokenFromTheEnvironment) {
  const std::string token = "env-token-42";
  setenv("LATENTD_AUTH_TOKEN", token.c_str(), 1);
  Daemon daemon;
  const bool started = daemon.Start();
  unsetenv("LATENTD_AUTH_TOKEN");
  ASSERT_TRUE(started) << daemon.Log();
  EXPECT_TRUE(absl::StrContains(daemon.Log(), "auth on (LATENTD_AUTH_TOKEN)")) << daemon.Log();
  EXPECT_EQ(GetInfo(daemon, "").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(GetInfo(daemon, token).ok());
  std::string reply;
  EXPECT_TRUE(ListServices(daemon, token, &reply).ok());
}

TEST(AuthTest, BadTokenSourcesRefuseToStart) {
  struct Case {
    std::vector<std::string> flags;
    const char* env;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{"--auth_token_file=" + WriteTokenFile("t\n", 0644)}, nullptr, "--auth_token_file"},
      {{"--auth_token_file=" + WriteTokenFile("t\n", 0640)}, nullptr, "readable by group or others"},
      {{"--auth_token_file=" + WriteTokenFile("\n", 0600)}, nullptr, "empty"},
      {{"--auth_token_file=/nonexistent/token"}, nullptr, "--auth_token_file: cannot read"},
      {{"--auth_token=a"}, "b", "more than once"},
      {{"--auth_token_file=" + WriteTokenFile("t\n", 0600), "--auth_token=a"}, nullptr, "more than once"},
      {{}, "", "LATENTD_AUTH_TOKEN: the token is empty"},
      {{"--max_health_watchers=-1"}, nullptr, "--max_health_watchers"},
  };
  for (const Case& c : cases) {
    if (c.env != nullptr) setenv("LATENTD_AUTH_TOKEN", c.env, 1);
    Daemon daemon(c.flags);
    EXPECT_FALSE(daemon.Start(absl::Seconds(30))) << c.expect;
    unsetenv("LATENTD_AUTH_TOKEN");
    EXPECT_EQ(daemon.Wait(absl::Seconds(30)), 2) << c.expect << "\n" << daemon.Log();
    EXPECT_TRUE(absl::StrContains(daemon.Log(), c.expect)) << c.expect << "\n" << daemon.Log();
  }
}

TEST(AuthTest, HealthWatchStreamsAreBounded) {
  Daemon daemon({"--auth_token=watch-token", "--max_health_watchers=3"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto health = grpc::health::v1::Health::NewStub(Channel(daemon));
  struct Watch {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<grpc::health::v1::HealthCheckResponse>> reader;
  };
  auto open = [&] {
    auto w = std::make_unique<Watch>();
    w->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    w->reader = health->Watch(&w->ctx, grpc::health::v1::HealthCheckRequest());
    return w;
  };
  // Three watchers (no token needed) each get the current status.
  std::vector<std::unique_ptr<Watch>> watches;
  for (int i = 0; i < 3; ++i) {
    watches.push_back(open());
    grpc::health::v1::HealthCheckResponse resp;
    ASSERT_TRUE(watches.back()->reader->Read(&resp)) << i;
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  // Further ones are refused while those stay open.
  for (int i = 0; i < 2; ++i) {
    auto extra = open();
    grpc::health::v1::HealthCheckResponse resp;
    EXPECT_FALSE(extra->reader->Read(&resp));
    const grpc::Status st = extra->reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), "--max_health_watchers")) << st.error_message();
  }
  // Check still answers.
  grpc::ClientContext cctx;
  grpc::health::v1::HealthCheckResponse cresp;
  EXPECT_TRUE(health->Check(&cctx, grpc::health::v1::HealthCheckRequest(), &cresp).ok());

  // A watcher that leaves frees its slot.
  watches[0]->ctx.TryCancel();
  watches[0]->reader->Finish();
  watches.erase(watches.begin());
  bool reopened = false;
  const absl::Time deadline = absl::Now() + HangGuard(absl::Seconds(10));
  while (!reopened && absl::Now() < deadline) {
    auto again = open();
    grpc::health::v1::HealthCheckResponse resp;
    if (again->reader->Read(&resp)) {
      reopened = true;
      watches.push_back(std::move(again));
    } else {
      again->reader->Finish();
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  EXPECT_TRUE(reopened);
  for (auto& w : watches) {
    w->ctx.TryCancel();
    w->reader->Finish();
  }
  EXPECT_TRUE(daemon.Running());
}

}  // namespace
}  // namespace latentd::testing
