// The Prometheus exporter and the scrape-time collector; see metrics_exporter.h and the
// metric list in docs/metrics.md (names, types and labels there must match this file).
#include "server/metrics_exporter.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "prometheus/client_metric.h"
#include "prometheus/text_serializer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "kernels/params.h"
#include "server/auth.h"

namespace latentd::server {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

MetricFamily Family(std::string name, std::string help, MetricType type) {
  MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

ClientMetric Labelled(std::vector<ClientMetric::Label> labels) {
  ClientMetric m;
  m.label = std::move(labels);
  return m;
}

MetricFamily Counter(std::string name, std::string help, double value) {
  MetricFamily f = Family(std::move(name), std::move(help), MetricType::Counter);
  f.metric.emplace_back().counter.value = value;
  return f;
}

MetricFamily Gauge(std::string name, std::string help, double value) {
  MetricFamily f = Family(std::move(name), std::move(help), MetricType::Gauge);
  f.metric.emplace_back().gauge.value = value;
  return f;
}

// The engine keeps percentiles over its latest samples, not every observation, so the
// summary carries those quantiles, the number of observations so far, and no sum
// (NaN): the engine does not total the latencies, and a made-up sum would mislead.
MetricFamily LatencySummary(std::string name, std::string help, uint64_t count, double p50_us, double p90_us,
                            double p99_us) {
  MetricFamily f = Family(std::move(name), std::move(help), MetricType::Summary);
  ClientMetric& m = f.metric.emplace_back();
  m.summary.sample_count = count;
  m.summary.sample_sum = kNaN;
  // Without a sample the engine reports zeros; Prometheus's convention is NaN.
  const auto seconds = [count](double us) { return count == 0 ? kNaN : us * 1e-6; };
  m.summary.quantile = {{0.5, seconds(p50_us)}, {0.9, seconds(p90_us)}, {0.99, seconds(p99_us)}};
  return f;
}

}  // namespace

std::vector<MetricFamily> BuildMetricFamilies(const MetricsSnapshot& s, int64_t total_pages) {
  const engine::EngineMetrics& e = s.engine;
  const ServiceCounters& c = s.service;
  std::vector<MetricFamily> out;
  out.reserve(24);

  out.push_back(Counter("latentd_steps_completed_total", "Decode steps that completed successfully.",
                        static_cast<double>(e.steps_completed)));
  out.push_back(Counter("latentd_batches_total", "Attention launches (batches of decode steps).",
                        static_cast<double>(e.batches)));

  // Bucket i of the engine's histogram holds batches of 2^i to 2^(i+1)-1 steps (the
  // last one: all larger batches). Sizes are whole numbers, so le=2^(i+1)-1 is the
  // bucket's exact upper bound; the last bucket is open and becomes +Inf.
  {
    MetricFamily f = Family("latentd_batch_size", "Decode steps per attention launch.", MetricType::Histogram);
    ClientMetric& m = f.metric.emplace_back();
    const auto& h = e.batch_size_histogram;
    uint64_t cumulative = 0;
    for (size_t i = 0; i < h.size(); ++i) {
      cumulative += h[i];
      if (i + 1 < h.size()) m.histogram.bucket.push_back({cumulative, std::ldexp(1.0, static_cast<int>(i) + 1) - 1});
    }
    m.histogram.bucket.push_back({cumulative, std::numeric_limits<double>::infinity()});
    m.histogram.sample_count = cumulative;
    // The engine counts completed steps, not launched ones: the two differ only by steps
    // that failed inside their batch, so the sum can be short by those.
    m.histogram.sample_sum = static_cast<double>(e.steps_completed);
    out.push_back(std::move(f));
  }

  out.push_back(LatencySummary("latentd_step_queue_wait_seconds",
                               "Time from a step's submission to its batch's launch, over the latest 4096 steps.",
                               e.steps_completed, e.queue_wait_us_p50, e.queue_wait_us_p90, e.queue_wait_us_p99));
  out.push_back(LatencySummary("latentd_batch_exec_seconds",
                               "Time from a batch's launch to its results, over the latest 4096 batches.", e.batches,
                               e.exec_us_p50, e.exec_us_p90, e.exec_us_p99));

  {
    MetricFamily f = Family("latentd_kv_pages",
                            "KV cache pages by state (used: held by sequences; free: ready to hand out; retiring: "
                            "freed, waiting for reads in flight). The states add up to the pool size.",
                            MetricType::Gauge);
    const int64_t retiring = std::max<int64_t>(0, total_pages - e.pages_used - e.pages_free);
    for (const auto& [state, value] :
         {std::pair<const char*, int64_t>{"used", e.pages_used}, {"free", e.pages_free}, {"retiring", retiring}}) {
      f.metric.push_back(Labelled({{"state", state}}));
      f.metric.back().gauge.value = static_cast<double>(value);
    }
    out.push_back(std::move(f));
  }
  out.push_back(Gauge("latentd_prefix_cached_pages",
                      "Unreferenced KV pages kept for prefix reuse (counted as free in latentd_kv_pages).",
                      static_cast<double>(e.pages_cached)));
  out.push_back(Gauge("latentd_prefix_keyed_pages", "KV pages whose content key is published (live or cached).",
                      static_cast<double>(e.pages_keyed)));
  out.push_back(Counter("latentd_prefix_hit_pages_total", "Prefix pages CreateSequence attached from the cache.",
                        static_cast<double>(e.prefix_hit_pages)));
  out.push_back(Counter("latentd_prefix_miss_pages_total",
                        "Prefix page keys CreateSequence did not find (from the first miss on).",
                        static_cast<double>(e.prefix_miss_pages)));
  out.push_back(Counter("latentd_prefix_evictions_total", "Cached prefix pages handed out again, least recently cached first.",
                        static_cast<double>(e.prefix_evictions)));
  out.push_back(Counter("latentd_prefix_upload_bytes_saved_total",
                        "Bytes of KV rows clients did not upload because their prefix was cached (all layers).",
                        static_cast<double>(e.prefix_bytes_saved)));
  out.push_back(Gauge("latentd_kv_pages_high_water", "Most KV pages in use at once since the start.",
                      static_cast<double>(e.pages_high_water)));
  out.push_back(Gauge("latentd_sequences", "Live sequences (forks included).", static_cast<double>(e.sequences)));
  out.push_back(
      Gauge("latentd_queued_steps", "Decode steps waiting in the engine's queue.", static_cast<double>(e.queued_steps)));
  out.push_back(Gauge("latentd_waiting_flows", "Flows (Decode streams) with steps waiting in the queue.",
                      static_cast<double>(e.waiting_flows)));
  out.push_back(Counter("latentd_append_chunks_total",
                        "Chunks AppendKv uploads were copied in (the KV lock is dropped between two).",
                        static_cast<double>(e.append_chunks)));

  out.push_back(Counter("latentd_sequences_exported_total",
                        "Sequences whose ExportSequence stream read every row (docs/export-import.md).",
                        static_cast<double>(e.sequences_exported)));
  out.push_back(Counter("latentd_export_bytes_total", "Stored row bytes ExportSequence streams read from the pool.",
                        static_cast<double>(e.export_bytes)));
  out.push_back(Counter("latentd_sequences_imported_total", "Sequences ImportSequence created.",
                        static_cast<double>(e.sequences_imported)));
  out.push_back(Counter("latentd_import_bytes_total", "Stored row bytes of the imported sequences.",
                        static_cast<double>(e.import_bytes)));
  out.push_back(Counter("latentd_import_failures_total",
                        "Imports refused, failed or abandoned part-way (each left nothing behind).",
                        static_cast<double>(e.import_failures)));
  out.push_back(Gauge("latentd_host_tier_capacity_bytes", "Size of the host KV tier (--host_kv_bytes, whole pages).",
                      static_cast<double>(e.host_tier_capacity_bytes)));
  out.push_back(Gauge("latentd_host_tier_used_bytes", "Host tier bytes holding offloaded sequences' rows.",
                      static_cast<double>(e.host_tier_used_bytes)));
  out.push_back(Gauge("latentd_host_tier_sequences", "Sequences in the host tier.",
                      static_cast<double>(e.host_tier_sequences)));
  out.push_back(Counter("latentd_host_offloads_total", "Sequences moved from the pool to the host tier.",
                        static_cast<double>(e.host_offloads)));
  out.push_back(Counter("latentd_host_restores_total", "Sequences brought back from the host tier into the pool.",
                        static_cast<double>(e.host_restores)));
  out.push_back(Counter("latentd_host_offload_refused_total",
                        "Offloads refused because the host tier was full (the sequence stayed in the pool).",
                        static_cast<double>(e.host_offload_refused)));
  out.push_back(Counter("latentd_host_restore_failures_total",
                        "Restores that failed (the pool could not take the sequence; it stayed offloaded).",
                        static_cast<double>(e.host_restore_failures)));
  out.push_back(Counter("latentd_host_restore_seconds_total", "Time restores took, summed.",
                        e.host_restore_seconds));
  out.push_back(Gauge("latentd_open_transfer_streams", "ExportSequence and ImportSequence streams not yet finished.",
                      static_cast<double>(c.open_exports + c.open_imports)));

  out.push_back(Gauge("latentd_open_decode_streams", "Decode streams not yet finished.",
                      static_cast<double>(c.open_streams)));
  out.push_back(Gauge("latentd_open_calls", "Decode and AppendKv streams not yet finished.",
                      static_cast<double>(c.open_calls)));
  out.push_back(Gauge("latentd_inflight_bytes", "Step buffers (inputs and results) held for all Decode streams.",
                      static_cast<double>(c.inflight_bytes)));
  out.push_back(Gauge("latentd_shared_region_bytes",
                      "Shared-memory regions mapped for open Decode streams (same-host data plane).",
                      static_cast<double>(c.region_bytes)));
  out.push_back(Gauge("latentd_shared_regions", "Open Decode streams with a shared-memory region.",
                      static_cast<double>(c.regions)));
  out.push_back(Gauge("latentd_doorbell_rings", "Open Decode streams with a doorbell ring (each polled by a daemon thread).",
                      static_cast<double>(c.rings)));
  out.push_back(Counter("latentd_ring_steps_total", "Decode steps taken from doorbell rings.",
                        static_cast<double>(c.steps_ring)));
  out.push_back(Gauge("latentd_upload_bytes", "AppendKv bytes received and not yet applied to the KV cache.",
                      static_cast<double>(c.upload_bytes)));

  {
    MetricFamily f = Family("latentd_rejections_total",
                            "Work refused or dropped, by reason (see docs/metrics.md for each reason).",
                            MetricType::Counter);
    const std::pair<const char*, uint64_t> reasons[] = {
        {"queue_full", e.rejected_queue_full},
        {"out_of_pages", e.rejected_out_of_pages},
        {"invalid", e.rejected_invalid},
        {"deadline", e.rejected_deadline},
        {"cancelled", e.dropped_cancelled},
        {"max_sequences", e.rejected_max_sequences},
        {"streams", c.refused_streams},
        {"inflight_bytes", c.refused_steps_bytes},
        {"message", c.refused_messages},
        {"upload", c.refused_uploads},
        {"region", c.refused_regions},
        {"ring", c.refused_rings},
        {"transfer_streams", c.refused_transfers},
    };
    for (const auto& [reason, value] : reasons) {
      f.metric.push_back(Labelled({{"reason", reason}}));
      f.metric.back().counter.value = static_cast<double>(value);
    }
    out.push_back(std::move(f));
  }
  {
    MetricFamily f = Family("latentd_step_inputs_total",
                            "Decode steps submitted whose q and kv were parsed into the stream's pinned-input "
                            "buffer (pinned), or read by the device where they lay, with no host staging copy "
                            "(device_direct: registered pinned inputs or a registered shared region).",
                            MetricType::Counter);
    for (const auto& [path, value] : {std::pair<const char*, uint64_t>{"pinned", c.steps_inputs_pinned},
                                      {"device_direct", c.steps_inputs_device_direct}}) {
      f.metric.push_back(Labelled({{"path", path}}));
      f.metric.back().counter.value = static_cast<double>(value);
    }
    out.push_back(std::move(f));
  }
  out.push_back(Counter("latentd_auth_failures_total", "Calls refused for a missing or wrong bearer token.",
                        static_cast<double>(s.auth_failures)));
  {
    MetricFamily f = Family("latentd_results_total",
                            "Results of steps the engine accepted: delivered to the client's transport, or "
                            "undelivered because the client went away or a write failed.",
                            MetricType::Counter);
    for (const auto& [outcome, value] : {std::pair<const char*, uint64_t>{"delivered", c.results_delivered},
                                         {"undelivered", c.results_undelivered}}) {
      f.metric.push_back(Labelled({{"outcome", outcome}}));
      f.metric.back().counter.value = static_cast<double>(value);
    }
    out.push_back(std::move(f));
  }
  return out;
}

SnapshotCollector::SnapshotCollector(Source source, int64_t total_pages)
    : source_(std::move(source)), total_pages_(total_pages) {}

std::vector<MetricFamily> SnapshotCollector::Collect() const { return BuildMetricFamilies(source_(), total_pages_); }

absl::Status ValidateMetricsListen(absl::string_view address) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen: '", address, "': ", why, " (e.g. 127.0.0.1:9464 or [::1]:9464)"));
  };
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return bad("expected host:port");
  absl::string_view host = address.substr(0, colon);
  const absl::string_view port = address.substr(colon + 1);
  uint32_t port_number = 0;
  if (port.empty() || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) || port.size() > 5 ||
      !absl::SimpleAtoi(port, &port_number) || port_number > 65535) {
    return bad("expected a port number from 0 to 65535");
  }
  unsigned char buf[16];
  if (absl::ConsumePrefix(&host, "[")) {
    if (!absl::ConsumeSuffix(&host, "]")) return bad("unterminated [IPv6] host");
    if (inet_pton(AF_INET6, std::string(host).c_str(), buf) != 1) return bad("expected an IPv6 address in []");
  } else if (inet_pton(AF_INET, std::string(host).c_str(), buf) != 1) {
    return bad("expected a literal IPv4 address or [IPv6] address as host");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(const std::string& address,
                                                                        SnapshotCollector::Source source,
                                                                        int64_t total_pages, const BuildInfo& build) {
  if (absl::Status st = ValidateMetricsListen(address); !st.ok()) return st;
  std::unique_ptr<MetricsExporter> x(new MetricsExporter());
  x->registry_ = std::make_shared<prometheus::Registry>();
  std::string backend = build.backend, device;
  if (absl::StartsWith(backend, "cuda:")) {
    device = backend.substr(5);
    backend = "cuda";
  }
  prometheus::BuildGauge()
      .Name("latentd_build_info")
      .Help("Always 1; the labels say which latentd this is and what it serves with.")
      .Register(*x->registry_)
      .Add({{"version", build.version}, {"backend", backend}, {"device", device}, {"kv_dtype", build.kv_dtype}})
      .Set(1);
  x->collector_ = std::make_shared<SnapshotCollector>(std::move(source), total_pages);
  // One HTTP thread: a scraper or two at a time is all this endpoint serves.
  auto http = MetricsHttpServer::Start(address, [registry = x->registry_, collector = x->collector_] {
    std::vector<prometheus::MetricFamily> families = registry->Collect();
    std::vector<prometheus::MetricFamily> more = collector->Collect();
    families.insert(families.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    return prometheus::TextSerializer().Serialize(families);
  });
  if (!http.ok()) return http.status();
  x->http_ = *std::move(http);
  const std::string host = address.substr(0, address.rfind(':'));
  x->address_ = absl::StrCat(host, ":", x->http_->port());
  return x;
}

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(const std::string& address,
                                                                        const engine::Engine* engine,
                                                                        const DecodeServiceImpl* service,
                                                                        const std::string& version) {
  const engine::EngineInfo info = engine->Info();
  return Start(
      address,
      [engine, service] {
        MetricsSnapshot s;
        s.engine = engine->Metrics();
        s.service = service->Counters();
        s.auth_failures = AuthFailures();
        return s;
      },
      info.total_pages,
      BuildInfo{version, info.backend, kernels::KvDTypeName(info.kv_dtype, info.model.dtype)});
}

MetricsExporter::~MetricsExporter() { Stop(); }

void MetricsExporter::Stop() {
  // Joins the HTTP thread: no Collect() runs after this.
  if (http_ != nullptr) http_->Stop();
}

}  // namespace latentd::server
