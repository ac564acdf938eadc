// The /metrics endpoint's HTTP handling: request lines, the answers to other paths and
// methods, oversized and silent clients, and a refused connection after Stop.
#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace latentd::server {
namespace {

std::string Exchange(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  (void)!write(fd, request.data(), request.size());
  shutdown(fd, SHUT_WR);  // all sent: a server waiting for more sees the end at once
  std::string response;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) response.append(buf, static_cast<size_t>(n));
  close(fd);
  return response;
}

TEST(MetricsHttp, RequestLines) {
  EXPECT_EQ(ParseHttpRequestLine("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").path, "/metrics");
  EXPECT_EQ(ParseHttpRequestLine("GET /metrics?name[]=x HTTP/1.0\r\n\r\n").path, "/metrics");
  EXPECT_EQ(ParseHttpRequestLine("POST /m HTTP/1.1\r\n").method, "POST");
  EXPECT_TRUE(ParseHttpRequestLine("GET /metrics\r\n\r\n").method.empty());
  EXPECT_TRUE(ParseHttpRequestLine("GET  HTTP/1.1\r\n").method.empty());
  EXPECT_TRUE(ParseHttpRequestLine(" /metrics HTTP/1.1\r\n").method.empty());
  EXPECT_TRUE(ParseHttpRequestLine("GET /metrics SPDY/3\r\n").method.empty());
  EXPECT_TRUE(ParseHttpRequestLine("").method.empty());
}

TEST(MetricsHttp, AnswersScrapesAndRefusesTheRest) {
  std::atomic<int> renders{0};
  auto server = MetricsHttpServer::Start("127.0.0.1:0", [&] {
    ++renders;
    return std::string("a_metric 1\n");
  });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);
  std::string r = Exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_TRUE(absl::StartsWith(r, "HTTP/1.1 200 OK\r\n")) << r;
  EXPECT_TRUE(absl::StrContains(r, "Content-Length: 11\r\n")) << r;
  EXPECT_TRUE(absl::EndsWith(r, "\r\n\r\na_metric 1\n")) << r;
  EXPECT_TRUE(absl::StartsWith(Exchange(port, "GET /other HTTP/1.1\r\n\r\n"), "HTTP/1.1 404"));
  EXPECT_TRUE(absl::StartsWith(Exchange(port, "POST /metrics HTTP/1.1\r\n\r\n"), "HTTP/1.1 405"));
  EXPECT_TRUE(absl::StartsWith(Exchange(port, "hello\r\n\r\n"), "HTTP/1.1 400"));
  EXPECT_TRUE(absl::StartsWith(Exchange(port, "GET /metrics HTTP/1.1\r\nX: " + std::string(20000, 'a')), "HTTP/1.1 431"));
  // A client that closes without a request changes nothing for the next one.
  EXPECT_EQ(Exchange(port, ""), "");
  EXPECT_TRUE(absl::StartsWith(Exchange(port, "HEAD /metrics HTTP/1.1\r\n\r\n"), "HTTP/1.1 200 OK"));
  EXPECT_EQ(renders.load(), 2);
  // The port is taken while it serves; refused once stopped.
  EXPECT_FALSE(MetricsHttpServer::Start("127.0.0.1:" + std::to_string(port), [] { return std::string(); }).ok());
  (*server)->Stop();
  EXPECT_EQ(Exchange(port, "GET /metrics HTTP/1.1\r\n\r\n"), "");
  EXPECT_EQ(renders.load(), 2);
}

}  // namespace
}  // namespace latentd::server
