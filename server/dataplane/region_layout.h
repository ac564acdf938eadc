// Where a step's tensors may lie in a same-host region (a shared memory file or a
// client's CUDA allocation): the bounds and alignment rule every region step is checked
// against before any pointer into the region is formed.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace latentd::server::dataplane {

// Bytes of each tensor per query token (the model's shape).
struct RowBytes {
  uint64_t q = 0, kv = 0, out = 0, lse = 0;
  uint64_t hidden = 0;  // a layer step's hidden state and output per token
};

// A step's DecodeStep.region (or doorbell ring entry): its s_q and tensor offsets.
struct RegionTensors {
  uint64_t s_q = 0;
  uint64_t q_offset = 0, kv_offset = 0, out_offset = 0, lse_offset = 0;
  // A layer step: hidden [s_q, hidden] at hidden_offset, its output [s_q, hidden] at
  // out_offset; q, kv and lse are not read.
  bool layer_step = false;
  uint64_t hidden_offset = 0;
};

// The region a step's tensors must fit: `bytes` long, whose first `reserved` bytes hold
// its doorbell ring (0 when it has none, or the ring is in a file of its own).
struct RegionBounds {
  uint64_t bytes = 0;
  uint64_t reserved = 0;
};

// OK when 1 <= s_q <= max_s_q and every tensor lies inside [reserved, bytes), aligned to
// its element (2 bytes; lse 4). Else INVALID_ARGUMENT naming the field
// ("region.s_q", "region.q_offset", ...). Tensors may overlap each other: they are the
// client's own memory, and an overlap only garbles the client's own result.
absl::Status CheckRegionTensors(const RegionTensors& t, const RowBytes& rows, uint64_t max_s_q,
                                const RegionBounds& region);

}  // namespace latentd::server::dataplane
