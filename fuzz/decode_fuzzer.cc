// libFuzzer target: Decode streams through the service into a CPU engine. Each input
// becomes one bidi stream whose messages are either the input's raw bytes (any
// protobuf, or none) or well-formed DecodeRequests built from them (valid sequence ids,
// right tensor sizes, so the steps reach the engine), sometimes with one field broken.
// Afterwards the server must still be healthy; results must have consistent sizes.
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

constexpr const char* kMethod = "/latentd.v1.DecodeService/Decode";

std::string PickId(Input& in, const std::vector<std::string>& ids) {
  switch (in.Range(0, 7)) {
    case 0: return "no-such-sequence";
    case 1: return "bad id!";
    case 2: return in.Bytes(in.Range(0, 8));
    default: return ids[in.Range(0, static_cast<int>(ids.size()) - 1)];
  }
}

// One step; `exact` reports whether it is valid as far as the client can tell.
void BuildStep(Input& in, const std::vector<std::string>& ids, latentd::v1::DecodeStep* step,
               bool* exact) {
  using namespace latentd::fuzz;
  step->set_request_id(in.Range(0, 1000));
  const int s_q = in.Range(1, 3);
  const std::string seed = in.Bytes(in.Range(0, 16));
  step->set_sequence_id(ids[in.Range(0, static_cast<int>(ids.size()) - 1)]);
  step->set_layer(in.Range(0, kLayers - 1));
  step->set_q(Rows(seed, s_q, kQRowBytes));
  step->set_kv(Rows(seed, s_q, kKvRowBytes));
  step->set_causal(in.Range(0, 1));
  *exact = true;
  // A layer step now and then: hidden states instead of q and kv, maybe a position.
  if (in.Range(0, 2) == 0) {
    step->clear_q();
    step->clear_kv();
    step->set_hidden(Rows(seed, s_q, kHiddenRowBytes));
    switch (in.Range(0, 5)) {
      case 0: step->set_position(in.Range(0, kMaxPositions - s_q)); break;
      case 1: step->set_position(in.Range(kMaxPositions - s_q + 1, kMaxPositions + 2)); *exact = false; break;
      case 2: step->mutable_hidden()->resize(in.Range(0, 3 * kHiddenRowBytes)); *exact = false; break;
      case 3: step->set_q(Rows(seed, s_q, kQRowBytes)); *exact = false; break;  // both APIs at once
      default: break;
    }
    if (step->has_position() && step->position() < 0) *exact = false;
    return;
  }
  // Break one field now and then.
  switch (in.Range(0, 11)) {
    case 0: step->set_sequence_id(PickId(in, ids)); *exact = false; break;
    case 1: step->set_layer(in.Range(-2, kLayers + 2)); *exact = false; break;
    case 2: step->mutable_q()->resize(in.Range(0, 2 * kQRowBytes)); *exact = false; break;
    case 3: step->mutable_kv()->resize(in.Range(0, 2 * kKvRowBytes)); *exact = false; break;
    case 4: step->set_q(Rows(seed, in.Range(4, 9), kQRowBytes));
            step->set_kv(Rows(seed, step->q().size() / kQRowBytes, kKvRowBytes));
            *exact = false; break;  // s_q past max_s_q
    case 5: step->set_timeout_ms(in.Range(0, 2)); *exact = false; break;
    default: break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Harness& h = Harness::Get();
  Input in(data, size);
  const std::vector<std::string> ids = h.BeginInput(in.Range(1, 3));
  // Sometimes the input's sequences start in the host tier: its steps then bring them
  // back first (byte for byte, so exact results stay exact).
  if (in.Range(0, 3) == 0) h.engine()->OffloadIdleSequences(absl::ZeroDuration());

  std::vector<std::string> messages;
  bool all_exact = true;
  int exact_steps = 0;
  const int n = in.Range(1, 6);
  for (int m = 0; m < n && (m == 0 || !in.empty()); ++m) {
    if (in.Range(0, 3) == 0) {
      // Raw bytes: whatever the input holds (possibly an unparsable message).
      messages.push_back(in.Bytes(in.Range(0, 200)));
      all_exact = false;
      continue;
    }
    latentd::v1::DecodeRequest req;
    const int steps = in.Range(0, 4);
    for (int s = 0; s < steps; ++s) {
      bool exact = false;
      BuildStep(in, ids, req.add_steps(), &exact);
      all_exact &= exact;
      exact_steps += exact;
    }
    std::string bytes = req.SerializeAsString();
    if (in.Range(0, 7) == 0) {
      // Flip or cut a well-formed message.
      if (!bytes.empty() && in.Range(0, 1)) {
        bytes[in.Range(0, static_cast<int>(bytes.size()) - 1)] ^= static_cast<char>(in.Byte() | 1);
      } else {
        bytes.resize(in.Range(0, static_cast<int>(bytes.size())));
      }
      all_exact = false;
    }
    messages.push_back(std::move(bytes));
  }

  const Harness::CallResult r = h.StreamingCall(kMethod, messages);
  int results = 0;
  for (const auto& bytes : r.responses) {
    latentd::v1::DecodeResponse resp;
    if (!resp.ParseFromString(bytes)) Fail("unparsable DecodeResponse");
    for (const auto& res : resp.results()) {
      ++results;
      if (res.code() != 0) continue;
      // A layer step's output: [s_q, hidden], no lse.
      if (res.lse().empty() && !res.out().empty() &&
          static_cast<int64_t>(res.out().size()) % latentd::fuzz::kHiddenRowBytes == 0)
        continue;
      const int64_t rows = static_cast<int64_t>(res.out().size()) / latentd::fuzz::kOutRowBytes;
      if (rows < 1 || rows * latentd::fuzz::kOutRowBytes != static_cast<int64_t>(res.out().size()) ||
          static_cast<int64_t>(res.lse().size()) != rows * latentd::fuzz::kHeadsQ * 4) {
        Fail(absl::StrCat("OK result with out ", res.out().size(), " bytes, lse ",
                          res.lse().size()));
      }
    }
  }
  // Every step of an all-valid stream is answered exactly once, and the stream ends OK.
  if (all_exact) {
    if (!r.status.ok()) {
      Fail(absl::StrCat("valid stream ended with ", r.status.error_code(), " ",
                        r.status.error_message()));
    }
    if (results != exact_steps) {
      Fail(absl::StrCat("valid stream: ", exact_steps, " steps, ", results, " results"));
    }
  }
  h.CheckHealthy(ids[0]);
  h.EndInput();
  return 0;
}
