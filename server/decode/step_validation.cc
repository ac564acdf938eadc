// The checks of a Decode stream's requests and steps; error texts are part of the API
// (clients and tests match on the field they name).
#include "server/decode/step_validation.h"

#include "absl/strings/str_cat.h"
#include "proto/ring.h"
#include "server/dataplane/region_layout.h"

namespace latentd::server::decode {
namespace {

// The fields every step has, wherever its tensors are.
absl::Status CheckIdAndLayer(const wire::StepFields& in, const StepShape& sh) {
  if (in.sequence_id_bytes > 128) {
    return absl::InvalidArgumentError(absl::StrCat("sequence_id: malformed id (", in.sequence_id_bytes,
                                                   " bytes); expected 1 to 128 characters from [A-Za-z0-9._:-]"));
  }
  absl::Status st = CheckIdField("sequence_id", *in.sequence_id, false);
  if (st.ok()) st = CheckLayer("layer", in.layer, sh.num_layers);
  return st;
}

absl::Status WithStep(const absl::Status& st, int index, uint64_t request_id) {
  if (st.ok()) return st;
  return absl::Status(st.code(), absl::StrCat("steps[", index, "] (request_id ", request_id, ").", st.message()));
}

}  // namespace

bool IsValidSequenceId(absl::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

absl::Status CheckIdField(absl::string_view field, absl::string_view id, bool allow_empty) {
  if (id.empty()) {
    if (allow_empty) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": empty; expected the id of a sequence made by CreateSequence"));
  }
  if (!IsValidSequenceId(id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": malformed id (", id.size(), " bytes); expected 1 to 128 characters from [A-Za-z0-9._:-]"));
  }
  return absl::OkStatus();
}

absl::Status CheckLayer(absl::string_view field, int layer, int num_layers) {
  if (layer < 0 || layer >= num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", layer, " is out of range; expected 0 <= layer < ", num_layers));
  }
  return absl::OkStatus();
}

absl::Status CheckOpenFields(const OpenFields& f) {
  if (f.region_bytes > 0 && f.cuda_region) {
    return absl::InvalidArgumentError(
        "DecodeRequest.open_region_bytes, open_cuda_region: expected at most one of them");
  }
  if (f.ring_entries == 0) return absl::OkStatus();
  if (f.region_bytes == 0 && !f.cuda_region) {
    return absl::InvalidArgumentError(
        "DecodeRequest.region_ring_entries: expected with open_region_bytes or open_cuda_region (a "
        "ring belongs to the region it opens)");
  }
  if (!ring::ValidEntries(f.ring_entries)) {
    return absl::InvalidArgumentError(absl::StrCat("DecodeRequest.region_ring_entries: ", f.ring_entries,
                                                   "; expected a power of two from 1 to ", ring::kMaxEntries));
  }
  const uint64_t ring_bytes = ring::RingBytes(static_cast<uint32_t>(f.ring_entries));
  if (!f.cuda_region && f.region_bytes < ring_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("DecodeRequest.open_region_bytes: ", f.region_bytes,
                                                   "; expected at least the ", ring_bytes, " bytes a ring of ",
                                                   f.ring_entries, " entries takes"));
  }
  return absl::OkStatus();
}

// The layer API's part of a layer step: the API is served and the position fits.
absl::Status CheckLayerStep(const wire::StepFields& in, int64_t s_q, const StepShape& sh) {
  if (sh.hidden_row_bytes == 0) {
    return absl::FailedPreconditionError(
        "hidden: this daemon serves the kernel-level API only (ServerInfo.layer_api is false; start it with "
        "--model_dir holding the checkpoint's attention weights)");
  }
  if (in.has_position && (in.position < 0 || in.position > sh.max_positions - s_q)) {
    return absl::OutOfRangeError(absl::StrCat("position: ", in.position, "; expected 0 <= position <= ",
                                              sh.max_positions - s_q, " for ", s_q, " tokens (--max_positions ",
                                              sh.max_positions, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateByteStep(const wire::StepFields& in, int index, const StepShape& sh) {
  absl::Status st = CheckIdAndLayer(in, sh);
  if (st.ok() && in.has_hidden) {
    const int64_t hb = in.hidden_bytes, row = sh.hidden_row_bytes;
    if (in.q_bytes != 0 || in.kv_bytes != 0) {
      st = absl::InvalidArgumentError("q, kv: expected empty when hidden is set (a layer step)");
    } else if (row == 0) {
      st = CheckLayerStep(in, 1, sh);
    } else if (hb == 0 || hb % row != 0 || hb / row > sh.max_s_q) {
      st = absl::InvalidArgumentError(absl::StrCat("hidden: ", hb, " bytes; expected s_q * hidden_size * 2 = s_q * ",
                                                   row, " bytes ([s_q, ", row / 2,
                                                   "] in the server dtype) with 1 <= s_q <= ", sh.max_s_q));
    } else {
      st = CheckLayerStep(in, hb / row, sh);
    }
    return WithStep(st, index, in.request_id);
  }
  if (st.ok() && in.has_position) st = absl::InvalidArgumentError("position: only for layer steps (hidden set)");
  if (st.ok()) {
    const int64_t qb = in.q_bytes;
    if (qb == 0 || qb % sh.q_row_bytes != 0 || qb / sh.q_row_bytes > sh.max_s_q) {
      st = absl::InvalidArgumentError(absl::StrCat(
          "q: ", qb, " bytes; expected s_q * h_q * 576 * 2 = s_q * ", sh.q_row_bytes, " bytes ([s_q, ", sh.h_q,
          ", 576] in the server dtype) with 1 <= s_q <= ", sh.max_s_q));
    } else {
      const int64_t s_q = qb / sh.q_row_bytes;
      if (in.kv_bytes != s_q * sh.kv_row_bytes) {
        st = absl::InvalidArgumentError(absl::StrCat("kv: ", in.kv_bytes, " bytes; expected s_q * h_kv * 576 * 2 = ",
                                                     s_q * sh.kv_row_bytes, " bytes ([", s_q, ", ", sh.h_kv,
                                                     ", 576], one new row per query token)"));
      }
    }
  }
  return WithStep(st, index, in.request_id);
}

absl::Status ValidateRegionStep(const wire::StepFields& in, int index, const StepShape& sh,
                                const RegionExtent& region) {
  absl::Status st = CheckIdAndLayer(in, sh);
  if (st.ok() && !region.present) {
    st = absl::InvalidArgumentError(
        "region: this stream has no region; send DecodeRequest.open_region_bytes or open_cuda_region first");
  }
  if (st.ok() && (in.q_bytes != 0 || in.kv_bytes != 0)) {
    st = absl::InvalidArgumentError("q, kv: expected empty when region is set (the tensors are in the region)");
  }
  if (st.ok() && in.has_hidden) {
    st = absl::InvalidArgumentError(
        "hidden: expected empty when region is set (a layer step's hidden states are at region.hidden_offset)");
  }
  if (st.ok() && in.region_layer_step) {
    st = CheckLayerStep(in, in.region_s_q, sh);
    if (st.ok() && region.device) {
      st = absl::InvalidArgumentError(
          "region.layer_step: layer steps read and write their tensors on the host; use a shared region "
          "(open_region_bytes), not a CUDA region");
    }
  } else if (st.ok() && in.has_position) {
    st = absl::InvalidArgumentError("region.position: only for layer steps (region.layer_step set)");
  }
  if (st.ok()) {
    const dataplane::RowBytes rows{static_cast<uint64_t>(sh.q_row_bytes), static_cast<uint64_t>(sh.kv_row_bytes),
                                   static_cast<uint64_t>(sh.out_row_bytes), static_cast<uint64_t>(sh.lse_row_bytes),
                                   static_cast<uint64_t>(sh.hidden_row_bytes)};
    dataplane::RegionTensors t{in.region_s_q, in.q_offset, in.kv_offset, in.out_offset, in.lse_offset};
    t.layer_step = in.region_layer_step;
    t.hidden_offset = in.hidden_offset;
    st = dataplane::CheckRegionTensors(t, rows, static_cast<uint64_t>(sh.max_s_q), {region.bytes, region.ring_bytes});
  }
  return WithStep(st, index, in.request_id);
}

absl::Status CheckRingFlags(uint32_t entry, uint64_t request_id, uint32_t causal, uint32_t trace,
                            uint32_t layer_step, uint32_t has_position) {
  const std::pair<const char*, uint32_t> flags[] = {
      {"causal", causal}, {"trace", trace}, {"layer_step", layer_step}, {"has_position", has_position}};
  for (const auto& [name, value] : flags) {
    if (value > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("ring entry ", entry, " (request_id ", request_id, ").", name, ": ", value, "; expected 0 or 1"));
    }
  }
  return absl::OkStatus();
}

}  // namespace latentd::server::decode
