// Prometheus metrics for latentd: an HTTP endpoint (prometheus-cpp's Exposer, on
// --metrics_listen) whose latentd_* families are built at scrape time from the engine's
// and the service's counter snapshots, so that serving never touches a metric object.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/engine.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "server/metrics_http.h"
#include "server/service.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace latentd::server {

// What one scrape reports, read together.
struct MetricsSnapshot {
  engine::EngineMetrics engine;
  ServiceCounters service;
  uint64_t auth_failures = 0;
};

// The latentd_* families for one snapshot (build info aside, which never changes).
// `total_pages` is the KV pool size, fixed at start-up. Kept apart from the collector so
// that tests can check the families without an HTTP server.
std::vector<prometheus::MetricFamily> BuildMetricFamilies(const MetricsSnapshot& snapshot, int64_t total_pages);

// A Collectable that reads a fresh snapshot on every scrape. The engine and the service
// already keep their counters for logs and drain accounting; reading them here costs the
// request path nothing.
class SnapshotCollector final : public prometheus::Collectable {
 public:
  // Called from the exporter's HTTP threads, possibly two at once: must be thread-safe.
  using Source = std::function<MetricsSnapshot()>;
  SnapshotCollector(Source source, int64_t total_pages);
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const Source source_;
  const int64_t total_pages_;
};

// OK when `address` is <IPv4>:<port> or [<IPv6>]:<port> with a port in 0..65535 (0:
// any free port); otherwise INVALID_ARGUMENT naming --metrics_listen. Host names are
// refused: the HTTP server binds literal addresses only, and a name that resolves to
// a public interface would expose the endpoint by surprise.
absl::Status ValidateMetricsListen(absl::string_view address);

// Labels of latentd_build_info.
struct BuildInfo {
  std::string version;
  std::string backend;  // EngineInfo::backend: "cpu" or "cuda:<device name>"
  std::string kv_dtype;  // the KV cache's storage: "bf16" / "fp16" or "fp8_e4m3"
};

class MetricsExporter {
 public:
  // Serves GET /metrics on `address` (see ValidateMetricsListen). Fails, naming
  // --metrics_listen, when the address is malformed or cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Start(const std::string& address,
                                                                SnapshotCollector::Source source,
                                                                int64_t total_pages, const BuildInfo& build);
  // The daemon's sources: engine->Metrics(), service->Counters() and AuthFailures().
  // Both must outlive Stop().
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Start(const std::string& address,
                                                                const engine::Engine* engine,
                                                                const DecodeServiceImpl* service,
                                                                const std::string& version);
  ~MetricsExporter();

  // Closes the endpoint and waits for scrapes in progress; the source is not called
  // again afterwards. Idempotent.
  void Stop();
  // host:port actually bound (the port resolved when 0 was asked for).
  const std::string& address() const { return address_; }

 private:
  MetricsExporter() = default;

  std::shared_ptr<prometheus::Registry> registry_;  // build info
  std::shared_ptr<SnapshotCollector> collector_;
  std::unique_ptr<MetricsHttpServer> http_;
  std::string address_;
};

}  // namespace latentd::server
