// One step's storage in a Decode stream (Slot): its input buffers, its result and the
// bookkeeping of the message it came in. Slots are owned by the stream and reused; the
// engine sees the DecodeStep base only and hands it back in StepDone.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/types.h"
#include "grpcpp/support/slice.h"
#include "proto/wire.h"

namespace latentd::server::decode {

struct Slot : engine::DecodeStep {
  std::string q_buf, kv_buf;  // inputs, read straight off the wire
  // Where the wire reader puts q and kv when they fit (--pinned_step_inputs): page-aligned
  // memory registered with the engine, [q of pin_s_q tokens | kv of pin_s_q tokens], so
  // the device reads them from here with no staging copy. Grown, and registered again,
  // only when a step does not fit (warm-up); never while the slot is in flight.
  char* pin = nullptr;
  size_t pin_bytes = 0, pin_kv_at = 0;
  int64_t pin_s_q = 0;
  uint64_t pin_device = 0;
  std::string out_buf, lse_buf;  // results, written by the engine in place
  int32_t code = 0;              // google.rpc code of the result
  std::string message;
  // Bytes counted against max_inflight_bytes: what the buffers hold, spare capacity
  // included, until the slot is deleted.
  int64_t charged = 0;
  bool accepted = false;       // the engine took it (its result counts as delivered or not)
  uint64_t group = 0;          // the message it came in (Group::id)
  Slot* group_next = nullptr;  // answered steps of its message, waiting for the rest
  bool trace = false;          // DecodeStep.trace: send StepTiming back
  bool in_region = false;      // tensors in the stream's shared region, not in the buffers
  bool layer_step = false;     // DecodeStep.hidden: the result is the layer's output, no lse
  // Zero-copy result: its StepResult laid out in the message's response buffer before
  // it runs, with `out` pointing inside; lse and timing are written at part_tail when
  // the response is built. Counted in `charged` like the slot's own buffers.
  bool laid_out = false;
  grpc::Slice part;
  size_t part_tail = 0;
  absl::Time received, parsed, submitted, completed;
  wire::Timing timing;  // filled when the response is built
};

// A slot about to be read into: its result and timestamps from a previous step cleared.
void ResetSlot(Slot* s, uint64_t request_id, bool trace, absl::Time received);

// The step is answered with `status` (its code and message).
void SetError(Slot* s, const absl::Status& status);

// Gives up the slot's share of its message's response buffer (gRPC keeps its own
// references to what it is sending).
void DropPart(Slot* s);

// The bytes the slot's buffers hold, spare capacity included (what it is charged for).
int64_t HeldBytes(const Slot* s);

// The slot's timestamps as the wire carries them, `response` being when its response
// was built.
void FillTiming(Slot* s, absl::Time response);

}  // namespace latentd::server::decode
