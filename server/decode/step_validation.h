// What a Decode stream checks before a step is given to the engine: the stream-level
// fields of a DecodeRequest (opening a region, a doorbell ring) and each step's id,
// layer and tensors, inline bytes or in a region. Every error is INVALID_ARGUMENT
// naming the field, so a client can tell what to fix.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/wire.h"
#include "server/decode/step_shape.h"

namespace latentd::server::decode {

// Sequence ids are 1..128 characters from [A-Za-z0-9._:-].
bool IsValidSequenceId(absl::string_view id);

// `field` holds a well-formed id; empty is accepted only with allow_empty (RPCs where
// the server chooses one).
absl::Status CheckIdField(absl::string_view field, absl::string_view id, bool allow_empty);
// 0 <= layer < num_layers.
absl::Status CheckLayer(absl::string_view field, int layer, int num_layers);

// A DecodeRequest's stream-level fields: a region (shared memory of open_region_bytes,
// or a CUDA allocation) and its doorbell ring of ring_entries. Budgets (--max_rings,
// --max_region_bytes) are the admission's; this is the shape of the request alone.
struct OpenFields {
  uint64_t region_bytes = 0;  // open_region_bytes
  bool cuda_region = false;   // open_cuda_region present
  uint64_t ring_entries = 0;  // region_ring_entries
};
absl::Status CheckOpenFields(const OpenFields& f);

// A step with inline q and kv: steps[index] (request_id ...) prefixes the error.
absl::Status ValidateByteStep(const wire::StepFields& in, int index, const StepShape& sh);

// The stream's region as a step sees it: none (bytes 0 and !present), or `bytes` long
// with its first `ring_bytes` taken by a doorbell ring.
struct RegionExtent {
  bool present = false;
  uint64_t bytes = 0;
  uint64_t ring_bytes = 0;
  bool device = false;  // a CUDA region (device memory only)
};
// A step whose tensors are in the region: every tensor inside it and aligned.
absl::Status ValidateRegionStep(const wire::StepFields& in, int index, const StepShape& sh,
                                const RegionExtent& region);

// A doorbell ring entry's flag fields, each 0 or 1 (the ring has no bool).
absl::Status CheckRingFlags(uint32_t entry, uint64_t request_id, uint32_t causal, uint32_t trace,
                            uint32_t layer_step = 0, uint32_t has_position = 0);

}  // namespace latentd::server::decode
