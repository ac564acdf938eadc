// libFuzzer target: AppendKv uploads through the service into a CPU engine. Each input
// becomes one client stream whose messages are the input's raw bytes or well-formed
// AppendKvRequests built from them (valid ids and row sizes, sometimes one field
// broken). Afterwards the server must still be healthy and, for an all-valid stream,
// the response must account for every row.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/service_harness.h"

using latentd::fuzz::Fail;
using latentd::fuzz::Harness;
using latentd::fuzz::Input;

namespace {

constexpr const char* kMethod = "/latentd.v1.DecodeService/AppendKv";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace latentd::fuzz;
  Harness& h = Harness::Get();
  Input in(data, size);
  const std::vector<std::string> ids = h.BeginInput(in.Range(1, 2));
  const std::string& id = ids[in.Range(0, static_cast<int>(ids.size()) - 1)];

  std::vector<std::string> messages;
  bool all_exact = true;
  int64_t rows_sent = 0;
  const int n = in.Range(1, 6);
  for (int m = 0; m < n && (m == 0 || !in.empty()); ++m) {
    if (in.Range(0, 3) == 0) {
      messages.push_back(in.Bytes(in.Range(0, 200)));
      all_exact = false;
      continue;
    }
    latentd::v1::AppendKvRequest req;
    // The id is required in the first message; later ones may repeat or omit it.
    if (m == 0 || in.Range(0, 1)) req.set_sequence_id(id);
    req.set_layer(in.Range(0, kLayers - 1));
    const int rows = in.Range(0, 5);
    req.set_kv(Rows(in.Bytes(in.Range(0, 16)), rows, kKvRowBytes));
    bool exact = rows > 0;
    switch (in.Range(0, 9)) {
      case 0: req.set_sequence_id(in.Range(0, 1) ? "no-such-sequence" : in.Bytes(in.Range(0, 8)));
              exact = false; break;
      case 1: req.set_layer(in.Range(-2, kLayers + 2)); exact = false; break;
      case 2: req.mutable_kv()->resize(in.Range(0, 3 * kKvRowBytes)); exact = false; break;
      case 3: if (m > 0) { req.set_sequence_id(ids.back()); exact = ids.size() == 1; } break;
      default: break;
    }
    all_exact &= exact;
    if (exact) rows_sent += rows;
    messages.push_back(req.SerializeAsString());
  }

  const Harness::CallResult r = h.StreamingCall(kMethod, messages);
  if (r.status.ok()) {
    if (r.responses.size() != 1) Fail(absl::StrCat(r.responses.size(), " AppendKv responses"));
    latentd::v1::AppendKvResponse resp;
    if (!resp.ParseFromString(r.responses[0])) Fail("unparsable AppendKvResponse");
    if (resp.lengths_size() != kLayers) Fail(absl::StrCat(resp.lengths_size(), " lengths"));
    for (int64_t len : resp.lengths()) {
      if (len < kBaseTokens) Fail(absl::StrCat("length ", len, " below the forked prefix"));
    }
    if (all_exact && resp.tokens_appended() != rows_sent) {
      Fail(absl::StrCat("tokens_appended ", resp.tokens_appended(), ", sent ", rows_sent));
    }
  } else if (all_exact) {
    Fail(absl::StrCat("valid upload ended with ", r.status.error_code(), " ",
                      r.status.error_message()));
  }
  h.CheckHealthy(id);
  h.EndInput();
  return 0;
}
