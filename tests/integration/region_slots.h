// Test helper of the data-plane tests (shared region, CUDA region, doorbell ring): where
// each step's tensors lie in a region, the step or ring entry that points there, and the
// result read back out of it.
#pragma once

#include <cstdint>
#include <string>

#include "clients/cpp/client.h"
#include "proto/latentd.pb.h"

namespace latentd::testing {

// Slot i of a region, after its first `base` bytes (a doorbell ring's, or 0), holds the
// q, kv, out and lse of one step with s_q <= 2; slots are multiples of `align` bytes.
struct SlotLayout {
  SlotLayout(const client::Shape& sh, uint64_t base = 0, uint64_t align = 64);

  uint64_t at(int i) const { return base + slot * i; }  // slot i's first byte
  uint64_t bytes(int slots) const { return base + slot * slots; }

  uint64_t base, q, kv, out, lse, slot;
};

// Points a byte step at slot i: sets its region offsets and drops its q and kv bytes
// (the caller has put them into the slot). Returns the step's s_q.
int PointAtSlot(v1::DecodeStep* step, const client::Shape& sh, const SlotLayout& lay, int i);

// Copies a byte step's q and kv into slot i of host memory `region` and points it there.
int IntoSlot(v1::DecodeStep* step, const client::Shape& sh, const SlotLayout& lay, char* region, int i);

// The same step as a ring entry of `sequence_id` (which must outlive the entry), its
// tensors copied into slot i of `region`.
client::Ring::Step IntoRingSlot(const v1::DecodeStep& step, const std::string& sequence_id,
                                const client::Shape& sh, const SlotLayout& lay, char* region, int i);

// A step answered in place: its out and lse, read from slot i of host memory `region`,
// as the StepResult a Tracker checks.
v1::StepResult InPlaceResult(uint64_t request_id, const client::Shape& sh, const SlotLayout& lay,
                             const char* region, int i, int s_q);

// Ends a stream from the client's side: WritesDone, reads what is left, its status.
grpc::Status Close(client::DecodeStream* stream);

}  // namespace latentd::testing
