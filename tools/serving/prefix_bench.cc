// Prefix-sharing workload against a running daemon: N sequences whose prompts share a
// prefix and then go their own way, uploaded once without page keys and once with them
// (docs/prefix-cache.md). Reports, per mode, the KV pages the sequences hold, the bytes
// uploaded and the setup time; the daemon's prefix counters say the same from its side.
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "clients/cpp/client.h"
#include "clients/cpp/page_keys.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "latentd address");
ABSL_FLAG(int, sequences, 64, "sequences (N)");
ABSL_FLAG(int, shared_len, 3072, "prompt tokens every sequence shares");
ABSL_FLAG(int, own_len, 1024, "prompt tokens of each sequence's own after the shared ones");
ABSL_FLAG(int, layers, 0, "layers to upload (0: all of the server's)");
ABSL_FLAG(std::string, salt, "prefix-bench", "page-key salt");
ABSL_FLAG(std::string, auth_token, "", "bearer token");

namespace latentd::tools {
namespace {

struct Result {
  int64_t pages = 0;
  int64_t bytes_uploaded = 0;
  double seconds = 0;
};

// One row per token, a function of the token id and its position, so that equal
// prompts give equal rows (as a prefill cluster's would).
std::string Rows(const std::vector<int64_t>& ids, int64_t from, int layer, size_t row_bytes) {
  std::string rows((ids.size() - from) * row_bytes, '\0');
  for (size_t t = from; t < ids.size(); ++t) {
    std::mt19937_64 rng(static_cast<uint64_t>(ids[t]) * 1000003u + t * 131u + layer);
    for (size_t b = 0; b < row_bytes; b += 2) {
      const uint16_t v = 0x3c00 | static_cast<uint16_t>(rng() & 0x3ff);  // finite, in [1, 2)
      rows[(t - from) * row_bytes + b] = static_cast<char>(v & 0xff);
      rows[(t - from) * row_bytes + b + 1] = static_cast<char>(v >> 8);
    }
  }
  return rows;
}

absl::StatusOr<Result> RunMode(client::Client* c, bool keys, int layers) {
  const int n = absl::GetFlag(FLAGS_sequences);
  const size_t row_bytes = c->shape().kv_row_bytes;
  std::mt19937_64 rng(7);
  std::vector<int64_t> shared(absl::GetFlag(FLAGS_shared_len));
  for (int64_t& t : shared) t = static_cast<int64_t>(rng() % 100000);
  auto before = c->GetInfo();
  if (!before.ok()) return before.status();
  Result r;
  std::vector<std::string> ids;
  const absl::Time start = absl::Now();
  for (int s = 0; s < n; ++s) {
    std::vector<int64_t> prompt = shared;
    for (int i = 0; i < absl::GetFlag(FLAGS_own_len); ++i) prompt.push_back(static_cast<int64_t>(rng() % 100000));
    int64_t present = 0;
    std::string id;
    if (keys) {
      auto created = c->CreateSequenceWithPrefix("", client::PageKeys(prompt, absl::GetFlag(FLAGS_salt)));
      if (!created.ok()) return created.status();
      id = created->sequence_id();
      present = created->prefix_tokens();
    } else {
      auto created = c->CreateSequence("");
      if (!created.ok()) return created.status();
      id = *created;
    }
    std::vector<std::string> rows;
    std::vector<absl::string_view> views;
    for (int l = 0; l < layers; ++l) rows.push_back(Rows(prompt, present, l, row_bytes));
    for (const std::string& x : rows) views.push_back(x);
    for (const std::string& x : rows) r.bytes_uploaded += static_cast<int64_t>(x.size());
    if (auto st = c->AppendKvLayers(id, views); !st.ok()) return st.status();
    ids.push_back(id);
  }
  r.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  auto after = c->GetInfo();
  if (!after.ok()) return after.status();
  r.pages = before->free_pages() - after->free_pages();
  for (const std::string& id : ids) {
    if (auto st = c->ReleaseSequence(id); !st.ok()) return st.status();
  }
  return r;
}

int Main() {
  client::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.auth_token = absl::GetFlag(FLAGS_auth_token);
  auto c = client::Client::Connect(options);
  if (!c.ok()) {
    std::fprintf(stderr, "prefix_bench: %s\n", c.status().ToString().c_str());
    return 1;
  }
  int layers = absl::GetFlag(FLAGS_layers);
  if (layers <= 0 || layers > (*c)->info().num_layers()) layers = (*c)->info().num_layers();
  std::printf("prefix_bench: %d sequences, %d shared + %d own tokens, %d layer(s), %lld bytes per row\n",
              absl::GetFlag(FLAGS_sequences), absl::GetFlag(FLAGS_shared_len), absl::GetFlag(FLAGS_own_len), layers,
              static_cast<long long>((*c)->shape().kv_row_bytes));
  // Without keys first: with keys first, the released pages would sit cached.
  for (bool keys : {false, true}) {
    auto r = RunMode(c->get(), keys, layers);
    if (!r.ok()) {
      std::fprintf(stderr, "prefix_bench: %s\n", r.status().ToString().c_str());
      return 1;
    }
    std::printf("%-12s pages held %8lld  uploaded %10.1f MB  setup %7.2f s\n", keys ? "page keys" : "no reuse",
                static_cast<long long>(r->pages), r->bytes_uploaded / 1e6, r->seconds);
  }
  return 0;
}

}  // namespace
}  // namespace latentd::tools

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("prefix_bench --target=ADDR [--sequences=64 --shared_len=3072 --own_len=1024]");
  absl::ParseCommandLine(argc, argv);
  return latentd::tools::Main();
}
