// Tests of the metrics exporter without a daemon: the families built from a snapshot
// (names, cumulative buckets, quantiles, reasons), the --metrics_listen checks, and a
// real scrape of the HTTP endpoint on a free loopback port.
#include "server/metrics_exporter.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <map>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/check_names.h"
#include "prometheus/text_serializer.h"

namespace latentd::server {
namespace {

using ::testing::HasSubstr;

MetricsSnapshot SampleSnapshot() {
  MetricsSnapshot s;
  s.engine.steps_completed = 100;
  s.engine.batches = 7;
  s.engine.batch_size_histogram.assign(16, 0);
  s.engine.batch_size_histogram[0] = 2;  // size 1
  s.engine.batch_size_histogram[2] = 3;  // sizes 4..7
  s.engine.batch_size_histogram[4] = 2;  // sizes 16..31
  s.engine.queue_wait_us_p50 = 10;
  s.engine.queue_wait_us_p90 = 20;
  s.engine.queue_wait_us_p99 = 40;
  s.engine.exec_us_p50 = 100;
  s.engine.exec_us_p90 = 200;
  s.engine.exec_us_p99 = 400;
  s.engine.pages_used = 30;
  s.engine.pages_free = 60;
  s.engine.pages_high_water = 42;
  s.engine.rejected_invalid = 5;
  s.engine.rejected_queue_full = 1;
  s.service.refused_uploads = 3;
  s.service.results_delivered = 99;
  s.service.results_undelivered = 1;
  s.service.steps_inputs_pinned = 17;
  s.service.steps_inputs_device_direct = 11;
  s.service.rings = 2;
  s.service.refused_rings = 1;
  s.service.steps_ring = 40;
  s.service.refused_transfers = 2;
  s.service.open_streams = 2;
  s.auth_failures = 4;
  return s;
}

const prometheus::MetricFamily* Find(const std::vector<prometheus::MetricFamily>& families, const std::string& name) {
  for (const auto& f : families) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

TEST(MetricFamilies, NamesAreValidAndUnique) {
  const auto families = BuildMetricFamilies(SampleSnapshot(), 100);
  std::map<std::string, int> seen;
  for (const auto& f : families) {
    EXPECT_TRUE(prometheus::CheckMetricName(f.name)) << f.name;
    EXPECT_TRUE(absl::StartsWith(f.name, "latentd_")) << f.name;
    EXPECT_FALSE(f.help.empty()) << f.name;
    EXPECT_EQ(++seen[f.name], 1) << f.name;
    if (f.type == prometheus::MetricType::Counter) {
      EXPECT_TRUE(absl::EndsWith(f.name, "_total")) << f.name;
    }
  }
}

TEST(MetricFamilies, BatchSizeHistogramIsCumulative) {
  const auto families = BuildMetricFamilies(SampleSnapshot(), 100);
  const auto* f = Find(families, "latentd_batch_size");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(f->type, prometheus::MetricType::Histogram);
  const auto& h = f->metric.at(0).histogram;
  ASSERT_EQ(h.bucket.size(), 16u);
  EXPECT_EQ(h.bucket[0].upper_bound, 1);
  EXPECT_EQ(h.bucket[0].cumulative_count, 2u);
  EXPECT_EQ(h.bucket[1].upper_bound, 3);
  EXPECT_EQ(h.bucket[1].cumulative_count, 2u);
  EXPECT_EQ(h.bucket[2].upper_bound, 7);
  EXPECT_EQ(h.bucket[2].cumulative_count, 5u);
  EXPECT_EQ(h.bucket[4].upper_bound, 31);
  EXPECT_EQ(h.bucket[4].cumulative_count, 7u);
  EXPECT_TRUE(std::isinf(h.bucket.back().upper_bound));
  EXPECT_EQ(h.bucket.back().cumulative_count, 7u);
  EXPECT_EQ(h.sample_count, 7u);
  for (size_t i = 1; i < h.bucket.size(); ++i) {
    EXPECT_GE(h.bucket[i].cumulative_count, h.bucket[i - 1].cumulative_count);
    EXPECT_GT(h.bucket[i].upper_bound, h.bucket[i - 1].upper_bound);
  }
}

TEST(MetricFamilies, LatencySummariesInSeconds) {
  auto families = BuildMetricFamilies(SampleSnapshot(), 100);
  const auto* wait = Find(families, "latentd_step_queue_wait_seconds");
  ASSERT_NE(wait, nullptr);
  const auto& s = wait->metric.at(0).summary;
  EXPECT_EQ(s.sample_count, 100u);
  ASSERT_EQ(s.quantile.size(), 3u);
  EXPECT_DOUBLE_EQ(s.quantile[0].quantile, 0.5);
  EXPECT_DOUBLE_EQ(s.quantile[0].value, 10e-6);
  EXPECT_DOUBLE_EQ(s.quantile[2].quantile, 0.99);
  EXPECT_DOUBLE_EQ(s.quantile[2].value, 40e-6);
  const auto* exec = Find(families, "latentd_batch_exec_seconds");
  ASSERT_NE(exec, nullptr);
  EXPECT_EQ(exec->metric.at(0).summary.sample_count, 7u);
  EXPECT_DOUBLE_EQ(exec->metric.at(0).summary.quantile[1].value, 200e-6);

  // Before any step the quantiles are unknown, not zero.
  families = BuildMetricFamilies(MetricsSnapshot{}, 100);
  EXPECT_TRUE(std::isnan(Find(families, "latentd_step_queue_wait_seconds")->metric.at(0).summary.quantile[0].value));
}

TEST(MetricFamilies, PagesAndReasons) {
  const auto families = BuildMetricFamilies(SampleSnapshot(), 100);
  std::map<std::string, double> pages;
  for (const auto& m : Find(families, "latentd_kv_pages")->metric) pages[m.label.at(0).value] = m.gauge.value;
  EXPECT_EQ(pages, (std::map<std::string, double>{{"free", 60}, {"retiring", 10}, {"used", 30}}));
  std::map<std::string, double> reasons;
  for (const auto& m : Find(families, "latentd_rejections_total")->metric) {
    reasons[m.label.at(0).value] = m.counter.value;
  }
  EXPECT_EQ(reasons.size(), 13u);
  EXPECT_EQ(reasons["transfer_streams"], 2);
  EXPECT_EQ(reasons["invalid"], 5);
  EXPECT_EQ(reasons["queue_full"], 1);
  EXPECT_EQ(reasons["upload"], 3);
  EXPECT_EQ(reasons["ring"], 1);
  EXPECT_EQ(reasons["deadline"], 0);
  EXPECT_EQ(Find(families, "latentd_auth_failures_total")->metric.at(0).counter.value, 4);
}

TEST(MetricFamilies, SerializesToTextFormat) {
  std::ostringstream text;
  prometheus::TextSerializer().Serialize(text, BuildMetricFamilies(SampleSnapshot(), 100));
  const std::string t = text.str();
  EXPECT_THAT(t, HasSubstr("# TYPE latentd_steps_completed_total counter\nlatentd_steps_completed_total 100\n"));
  EXPECT_THAT(t, HasSubstr("latentd_batch_size_bucket{le=\"7\"} 5\n"));
  EXPECT_THAT(t, HasSubstr("latentd_batch_size_bucket{le=\"+Inf\"} 7\n"));
  EXPECT_THAT(t, HasSubstr("latentd_rejections_total{reason=\"invalid\"} 5\n"));
  EXPECT_THAT(t, HasSubstr("latentd_results_total{outcome=\"delivered\"} 99\n"));
  EXPECT_THAT(t, HasSubstr("latentd_step_inputs_total{path=\"pinned\"} 17\n"));
  EXPECT_THAT(t, HasSubstr("latentd_step_inputs_total{path=\"device_direct\"} 11\n"));
  EXPECT_THAT(t, HasSubstr("latentd_doorbell_rings 2\n"));
  EXPECT_THAT(t, HasSubstr("latentd_ring_steps_total 40\n"));
  EXPECT_THAT(t, HasSubstr("reason=\"ring\"} 1\n"));
  EXPECT_THAT(t, HasSubstr("latentd_step_queue_wait_seconds{quantile=\"0.99\"}"));
}

TEST(ValidateMetricsListen, AcceptsLiteralAddresses) {
  EXPECT_TRUE(ValidateMetricsListen("127.0.0.1:9464").ok());
  EXPECT_TRUE(ValidateMetricsListen("0.0.0.0:0").ok());
  EXPECT_TRUE(ValidateMetricsListen("[::1]:9464").ok());
}

TEST(ValidateMetricsListen, RefusesMalformedAddressesNamingTheFlag) {
  for (const char* bad : {"", "9464", "127.0.0.1", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:94x4",
                          "localhost:9464", "::1:9464", "[::1:9464", "[127.0.0.1]:9464", "127.0.0.1:9464s"}) {
    const absl::Status st = ValidateMetricsListen(bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(st.message()), HasSubstr("--metrics_listen")) << bad;
  }
}

// A minimal HTTP/1.0 GET over a plain socket (the response is read to EOF).
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  (void)!write(fd, request.data(), request.size());
  std::string response;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) response.append(buf, static_cast<size_t>(n));
  close(fd);
  return response;
}

TEST(MetricsExporter, ServesScrapesFromTheSourceAndStops) {
  std::atomic<int> calls{0};
  auto exporter = MetricsExporter::Start(
      "127.0.0.1:0",
      [&calls] {
        ++calls;
        return SampleSnapshot();
      },
      100, BuildInfo{"1.2.3", "cuda:Test GPU", "fp8_e4m3"});
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  const std::string address = (*exporter)->address();
  ASSERT_TRUE(absl::StartsWith(address, "127.0.0.1:")) << address;
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(address.substr(address.rfind(':') + 1), &port));
  ASSERT_GT(port, 0);

  const std::string body = HttpGet(port, "/metrics");
  EXPECT_THAT(body, HasSubstr("200 OK"));
  EXPECT_THAT(body, HasSubstr("latentd_steps_completed_total 100"));
  EXPECT_THAT(body, HasSubstr("latentd_build_info{backend=\"cuda\",device=\"Test GPU\",kv_dtype=\"fp8_e4m3\",version=\"1.2.3\"} 1"));
  EXPECT_EQ(calls.load(), 1);

  // A second exporter on the same port must fail, naming the flag.
  auto second = MetricsExporter::Start("127.0.0.1:" + std::to_string(port), [] { return MetricsSnapshot{}; }, 1,
                                       BuildInfo{"1", "cpu"});
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("--metrics_listen"));

  (*exporter)->Stop();
  (*exporter)->Stop();  // idempotent
  EXPECT_EQ(HttpGet(port, "/metrics"), "");
  EXPECT_EQ(calls.load(), 1);
}

}  // namespace
}  // namespace latentd::server
