// The Decode stream's wire format read and written by hand: a DecodeRequest is counted
// before anything is copied (so one message cannot make the server hold more steps than
// its limit), its steps are read straight into reused per-stream buffers with every
// field bounded, and StepResults are serialized into one buffer per response.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/io/zero_copy_stream.h"

namespace latentd::wire {

// Fields larger than these are skipped rather than copied; the step then fails
// validation with the size it had on the wire.
struct StepBounds {
  int64_t max_id_bytes = 128;
  int64_t max_q_bytes = 0;
  int64_t max_kv_bytes = 0;
  int64_t max_hidden_bytes = 0;  // DecodeStep.hidden (0 without the layer API)
};

// One DecodeStep as read off the wire. The strings are the caller's, reused across
// steps so that the steady state allocates nothing.
struct StepFields {
  uint64_t request_id = 0;
  int32_t layer = 0;
  bool causal = false;
  uint32_t timeout_ms = 0;
  bool trace = false;
  // RegionTensors, when the step carries one.
  bool has_region = false;
  uint32_t region_s_q = 0;
  uint64_t q_offset = 0, kv_offset = 0, out_offset = 0, lse_offset = 0;
  // The layer API: DecodeStep.hidden (read where q goes: the two never come together,
  // q_bytes then counts the q field alone) or RegionTensors.layer_step/hidden_offset, and
  // the optional position of either.
  bool has_hidden = false;
  int64_t hidden_bytes = 0;
  bool region_layer_step = false;
  uint64_t hidden_offset = 0;
  bool has_position = false;
  int64_t position = 0;
  // Sizes on the wire; a field over its bound is not copied (its string stays empty).
  int64_t sequence_id_bytes = 0, q_bytes = 0, kv_bytes = 0;
  std::string* sequence_id = nullptr;
  std::string* q = nullptr;
  std::string* kv = nullptr;
  // Optional: memory q and kv are read into instead of the strings when they fit in
  // q_cap / kv_cap bytes (and their bounds); q_raw / kv_raw then say that they went there.
  char* q_dst = nullptr;
  int64_t q_cap = 0;
  char* kv_dst = nullptr;
  int64_t kv_cap = 0;
  bool q_raw = false, kv_raw = false;
};

// DecodeRequest.open_cuda_region as read off the wire (present: the field was there).
// A handle longer than kMaxIpcHandleBytes is not copied; handle_bytes keeps its size.
struct CudaRegionFields {
  static constexpr int kMaxIpcHandleBytes = 64;
  bool present = false;
  std::string handle;
  int64_t handle_bytes = 0;
  uint64_t offset = 0, bytes = 0;
};

// Steps in a serialized DecodeRequest, found without copying any field; INVALID_ARGUMENT
// naming the byte offset when the bytes are not a DecodeRequest. Stops counting (and
// returns limit + 1) once the count exceeds `limit`. *open_region_bytes (when given)
// gets DecodeRequest.open_region_bytes, *cuda_region (when given) open_cuda_region,
// *region_ring_entries (when given) region_ring_entries.
absl::StatusOr<int> CountDecodeSteps(google::protobuf::io::ZeroCopyInputStream* in, int limit,
                                     uint64_t* open_region_bytes = nullptr,
                                     CudaRegionFields* cuda_region = nullptr,
                                     uint64_t* region_ring_entries = nullptr);

// Reads a DecodeRequest's steps one at a time.
class DecodeStepReader {
 public:
  explicit DecodeStepReader(google::protobuf::io::ZeroCopyInputStream* in) : in_(in) {}
  // Reads the next step into *out (its strings overwritten). false at the end of the
  // message; INVALID_ARGUMENT for malformed bytes.
  absl::StatusOr<bool> Next(const StepBounds& bounds, StepFields* out);

 private:
  google::protobuf::io::ZeroCopyInputStream* in_;
};

// One AppendKv message: sequence_id (bounded like a step's) and the rows, read into the
// caller's strings.
struct AppendFields {
  int32_t layer = 0;
  int64_t sequence_id_bytes = 0;
  std::string* sequence_id = nullptr;
  std::string* kv = nullptr;
  // AppendKvRequest.hidden (the layer API), into its own string when given.
  std::string* hidden = nullptr;
  int64_t hidden_bytes = 0;
};
absl::Status ReadAppendKvRequest(google::protobuf::io::ZeroCopyInputStream* in, int64_t max_id_bytes,
                                 AppendFields* out);

// StepTiming (proto/latentd.proto), microseconds since the Unix epoch.
struct Timing {
  int64_t received_us = 0, parsed_us = 0, submitted_us = 0, batched_us = 0, launched_us = 0, finished_us = 0,
          completed_us = 0, response_us = 0;
};

// A StepResult to serialize; views into the caller's buffers.
struct ResultView {
  uint64_t request_id = 0;
  const std::string* out = nullptr;  // may be null or empty on error
  const std::string* lse = nullptr;
  int32_t code = 0;
  const std::string* message = nullptr;
  const Timing* timing = nullptr;  // written when set
};

// A DecodeResponse holding only `region` {path, bytes, ring_bytes, handoff_socket,
// ticket (each of the last three written when not 0 or empty)}.
std::string EncodeRegionResponse(const std::string& path, uint64_t bytes, uint64_t ring_bytes = 0,
                                 const std::string& handoff_socket = {}, const std::string& ticket = {});

// A successful result laid out before its step runs (zero-copy responses): the engine
// writes out straight into the response buffer. Offsets count from the result's start.
struct ResultLayout {
  size_t bytes = 0;    // the whole result inside a DecodeResponse
  size_t out_at = 0;   // where out's bytes go
  size_t tail_at = 0;  // where lse (and timing) are written once the step is done
};
ResultLayout SuccessLayout(uint64_t request_id, size_t out_bytes, size_t lse_bytes, bool timing);
// Writes everything before out's bytes at `result`.
void EncodeSuccessHead(uint64_t request_id, size_t out_bytes, size_t lse_bytes, bool timing, uint8_t* result);
// Writes lse and, when given, timing at `tail` (result + tail_at).
void EncodeSuccessTail(const std::string& lse, const Timing* timing, uint8_t* tail);

// Bytes the result takes inside a DecodeResponse (tag and length prefix included).
size_t EncodedResultSize(const ResultView& r);
// Writes the result as one `results` entry of a DecodeResponse at `target`, which has
// EncodedResultSize(r) bytes; returns the end.
uint8_t* EncodeResult(const ResultView& r, uint8_t* target);

}  // namespace latentd::wire
