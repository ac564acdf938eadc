// The bounds and alignment rule of region steps (region_layout.h). Every product below
// is of values the caller bounded (s_q <= max_s_q, rows of one token), so none wraps.
#include "server/dataplane/region_layout.h"

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

namespace latentd::server::dataplane {

absl::Status CheckRegionTensors(const RegionTensors& t, const RowBytes& rows, uint64_t max_s_q,
                                const RegionBounds& region) {
  if (t.s_q < 1 || t.s_q > max_s_q) {
    return absl::InvalidArgumentError(absl::StrCat("region.s_q: ", t.s_q, "; expected 1 <= s_q <= ", max_s_q));
  }
  struct Tensor {
    const char* name;
    uint64_t offset, bytes, align;
  };
  const Tensor kernel_step[] = {
      {"region.q_offset", t.q_offset, t.s_q * rows.q, 2},
      {"region.kv_offset", t.kv_offset, t.s_q * rows.kv, 2},
      {"region.out_offset", t.out_offset, t.s_q * rows.out, 2},
      {"region.lse_offset", t.lse_offset, t.s_q * rows.lse, 4},
  };
  const Tensor layer_step[] = {
      {"region.hidden_offset", t.hidden_offset, t.s_q * rows.hidden, 2},
      {"region.out_offset", t.out_offset, t.s_q * rows.hidden, 2},
  };
  for (const Tensor& x : t.layer_step ? absl::MakeConstSpan(layer_step) : absl::MakeConstSpan(kernel_step)) {
    // offset > bytes is tested first so that bytes - offset cannot wrap.
    if (x.offset > region.bytes || x.bytes > region.bytes - x.offset || x.offset % x.align != 0) {
      return absl::InvalidArgumentError(absl::StrCat(x.name, ": ", x.offset, " (", x.bytes,
                                                     " bytes); expected a multiple of ", x.align, " with offset + ",
                                                     x.bytes, " <= the region's ", region.bytes, " bytes"));
    }
    if (x.offset < region.reserved) {
      return absl::InvalidArgumentError(absl::StrCat(x.name, ": ", x.offset, "; expected >= ", region.reserved,
                                                     " (the region's first bytes hold its doorbell ring)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace latentd::server::dataplane
