// The /metrics HTTP endpoint: one thread that accepts scrapes on a listening socket and
// answers each with the text a callback renders. Plain sockets, so the daemon's HTTP side
// needs no server library (civetweb's fixed 100 KB thread stacks do not hold the static TLS
// that cuBLAS and OpenBLAS bring into the process).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace latentd::server {

// What a request's head asks for: its method and path (query string cut off), or
// empty strings when the head is not an HTTP/1.x request line.
struct HttpRequestLine {
  std::string method;
  std::string path;
};
HttpRequestLine ParseHttpRequestLine(absl::string_view head);

class MetricsHttpServer {
 public:
  // Renders the body of GET /metrics (Prometheus text format); called on the server's
  // thread, one scrape at a time.
  using Render = std::function<std::string()>;

  // Binds `address` (a literal IPv4 host:port or [IPv6]:port; port 0 picks one).
  // UNAVAILABLE naming the address when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address, Render render);
  ~MetricsHttpServer();  // Stop()

  int port() const { return port_; }
  // Stops accepting and joins the thread; idempotent. No Render runs after it returns.
  void Stop();

 private:
  MetricsHttpServer() = default;
  void Loop();
  void Serve(int fd);

  Render render_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // an eventfd that Stop writes, to end the poll
  int port_ = 0;
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

}  // namespace latentd::server
