// The /metrics endpoint on plain sockets: poll for a connection or Stop, read one request
// head (bounded in size and time), answer, close.
#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace latentd::server {
namespace {

// A scrape's request head is a few hundred bytes; anything longer is refused.
constexpr size_t kMaxHead = 8192;
// A client gets this long to send its head and to take the answer.
constexpr int kIoTimeoutSeconds = 5;

void SendAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return;  // the scraper went away or timed out: nothing to do
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
}

void Answer(int fd, absl::string_view status, absl::string_view type, absl::string_view body) {
  SendAll(fd, absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type, "\r\nContent-Length: ", body.size(),
                           "\r\nConnection: close\r\n\r\n"));
  SendAll(fd, body);
}

}  // namespace

HttpRequestLine ParseHttpRequestLine(absl::string_view head) {
  const size_t eol = head.find("\r\n");
  absl::string_view line = head.substr(0, eol);
  const size_t sp1 = line.find(' ');
  if (sp1 == absl::string_view::npos || sp1 == 0) return {};
  const size_t sp2 = line.find(' ', sp1 + 1);
  if (sp2 == absl::string_view::npos || sp2 == sp1 + 1) return {};
  if (!absl::StartsWith(line.substr(sp2 + 1), "HTTP/1.")) return {};
  absl::string_view path = line.substr(sp1 + 1, sp2 - sp1 - 1);
  if (const size_t q = path.find('?'); q != absl::string_view::npos) path = path.substr(0, q);
  return {std::string(line.substr(0, sp1)), std::string(path)};
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const std::string& address,
                                                                            Render render) {
  const size_t colon = address.rfind(':');
  absl::string_view host = absl::string_view(address).substr(0, colon);
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("--metrics_listen: '", address, "': expected host:port"));
  const bool v6 = absl::ConsumePrefix(&host, "[") && absl::ConsumeSuffix(&host, "]");
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (v6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(static_cast<uint16_t>(port));
    if (inet_pton(AF_INET6, std::string(host).c_str(), &a->sin6_addr) != 1)
      return absl::InvalidArgumentError(absl::StrCat("--metrics_listen: '", address, "': bad IPv6 address"));
    len = sizeof(sockaddr_in6);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_port = htons(static_cast<uint16_t>(port));
    if (inet_pton(AF_INET, std::string(host).c_str(), &a->sin_addr) != 1)
      return absl::InvalidArgumentError(absl::StrCat("--metrics_listen: '", address, "': bad IPv4 address"));
    len = sizeof(sockaddr_in);
  }
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer());
  s->render_ = std::move(render);
  s->listen_fd_ = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  if (s->listen_fd_ < 0 || setsockopt(s->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
      bind(s->listen_fd_, reinterpret_cast<sockaddr*>(&ss), len) != 0 || listen(s->listen_fd_, 16) != 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics_listen: cannot serve metrics on ", address, ": ", std::strerror(errno)));
  }
  sockaddr_storage bound{};
  socklen_t blen = sizeof bound;
  getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &blen);
  s->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  s->wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (s->wake_fd_ < 0) return absl::InternalError(absl::StrCat("metrics: eventfd: ", std::strerror(errno)));
  s->thread_ = std::thread([p = s.get()] { p->Loop(); });
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  Stop();
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void MetricsHttpServer::Stop() {
  if (stopped_.exchange(true)) return;
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof one);
    thread_.join();
  }
  // Closed now, not at destruction: a scraper after Stop is refused, not left waiting.
  if (listen_fd_ >= 0) close(listen_fd_);
  listen_fd_ = -1;
}

void MetricsHttpServer::Loop() {
  pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  while (!stopped_.load()) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Serve(fd);
    close(fd);
  }
}

void MetricsHttpServer::Serve(int fd) {
  const timeval timeout{kIoTimeoutSeconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  std::string head;
  char buf[1024];
  while (head.find("\r\n\r\n") == std::string::npos) {
    if (head.size() >= kMaxHead) return Answer(fd, "431 Request Header Fields Too Large", "text/plain", "too large\n");
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // closed, or silent past the timeout
    head.append(buf, static_cast<size_t>(n));
  }
  const HttpRequestLine req = ParseHttpRequestLine(head);
  if (req.method.empty()) return Answer(fd, "400 Bad Request", "text/plain", "expected an HTTP/1.x request\n");
  if (req.method != "GET" && req.method != "HEAD") return Answer(fd, "405 Method Not Allowed", "text/plain", "GET only\n");
  if (req.path != "/metrics") return Answer(fd, "404 Not Found", "text/plain", "metrics are at /metrics\n");
  const std::string body = render_();
  if (req.method == "HEAD") {
    SendAll(fd, absl::StrCat("HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: ",
                             body.size(), "\r\nConnection: close\r\n\r\n"));
    return;
  }
  Answer(fd, "200 OK", "text/plain; version=0.0.4", body);
}

}  // namespace latentd::server
