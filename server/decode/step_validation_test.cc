// Step and request validation of a Decode stream, without a daemon: every error is
// INVALID_ARGUMENT and names the field (and the step) to fix.
#include "server/decode/step_validation.h"

#include <string>

#include "absl/strings/match.h"
#include "engine/types.h"
#include "gtest/gtest.h"
#include "proto/ring.h"

namespace latentd::server::decode {
namespace {

StepShape Shape() {
  engine::ModelConfig m;
  m.num_layers = 2;
  m.num_heads_q = 16;
  m.num_heads_kv = 1;
  return StepShape::For(m, 4);
}

struct Step {
  std::string id = "seq-1";
  wire::StepFields f;
  Step() {
    f.request_id = 7;
    f.sequence_id = &id;
    f.sequence_id_bytes = static_cast<int64_t>(id.size());
  }
};

void ExpectInvalid(const absl::Status& st, absl::string_view field) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), field)) << st.message() << " should name " << field;
}

TEST(StepShape, RowBytesFollowTheModel) {
  const StepShape sh = Shape();
  EXPECT_EQ(sh.q_row_bytes, 16 * 576 * 2);
  EXPECT_EQ(sh.kv_row_bytes, 1 * 576 * 2);
  EXPECT_EQ(sh.out_row_bytes, 16 * 512 * 2);
  EXPECT_EQ(sh.lse_row_bytes, 16 * 4);
  EXPECT_EQ(sh.max_s_q, 4);
  EXPECT_EQ(sh.num_layers, 2);
}

TEST(StepValidation, SequenceIds) {
  EXPECT_TRUE(IsValidSequenceId("a.B_c:9-z"));
  EXPECT_FALSE(IsValidSequenceId(""));
  EXPECT_FALSE(IsValidSequenceId("has space"));
  EXPECT_FALSE(IsValidSequenceId(std::string(129, 'a')));
  EXPECT_TRUE(CheckIdField("new_sequence_id", "", /*allow_empty=*/true).ok());
  ExpectInvalid(CheckIdField("new_sequence_id", "", false), "new_sequence_id: empty");
  ExpectInvalid(CheckIdField("sequence_id", "a/b", false), "sequence_id: malformed id (3 bytes)");
  ExpectInvalid(CheckLayer("layer", 2, 2), "layer: 2 is out of range; expected 0 <= layer < 2");
  EXPECT_TRUE(CheckLayer("layer", 1, 2).ok());
}

TEST(StepValidation, ByteStepNamesTheStepAndField) {
  const StepShape sh = Shape();
  Step s;
  s.f.q_bytes = 2 * sh.q_row_bytes;
  s.f.kv_bytes = 2 * sh.kv_row_bytes;
  EXPECT_TRUE(ValidateByteStep(s.f, 3, sh).ok());

  Step q = s;
  q.f.sequence_id = &q.id;
  q.f.q_bytes = sh.q_row_bytes + 2;
  absl::Status st = ValidateByteStep(q.f, 3, sh);
  ExpectInvalid(st, "steps[3] (request_id 7).q: ");
  q.f.q_bytes = 5 * sh.q_row_bytes;  // over max_s_q
  ExpectInvalid(ValidateByteStep(q.f, 3, sh), ".q: ");
  q.f.q_bytes = 0;
  ExpectInvalid(ValidateByteStep(q.f, 3, sh), ".q: 0 bytes");

  Step kv = s;
  kv.f.sequence_id = &kv.id;
  kv.f.kv_bytes = sh.kv_row_bytes;
  ExpectInvalid(ValidateByteStep(kv.f, 0, sh), "steps[0] (request_id 7).kv: ");

  Step layer = s;
  layer.f.sequence_id = &layer.id;
  layer.f.layer = -1;
  ExpectInvalid(ValidateByteStep(layer.f, 1, sh), "steps[1] (request_id 7).layer: -1");

  Step id = s;
  id.f.sequence_id = &id.id;
  id.f.sequence_id_bytes = 200;  // too long to have been copied
  ExpectInvalid(ValidateByteStep(id.f, 1, sh), ".sequence_id: malformed id (200 bytes)");
}

TEST(StepValidation, RegionStep) {
  const StepShape sh = Shape();
  Step s;
  s.f.has_region = true;
  s.f.region_s_q = 1;
  s.f.q_offset = 4096;
  s.f.kv_offset = 4096 + sh.q_row_bytes;
  s.f.out_offset = 65536;
  s.f.lse_offset = 65536 + sh.out_row_bytes;
  const RegionExtent region{true, 1 << 20, 4096};
  EXPECT_TRUE(ValidateRegionStep(s.f, 0, sh, region).ok());
  ExpectInvalid(ValidateRegionStep(s.f, 2, sh, RegionExtent()), "steps[2] (request_id 7).region: this stream has no region");

  Step inline_too = s;
  inline_too.f.sequence_id = &inline_too.id;
  inline_too.f.q_bytes = 10;
  ExpectInvalid(ValidateRegionStep(inline_too.f, 0, sh, region), ".q, kv: expected empty");

  Step in_ring = s;  // q inside the ring's bytes
  in_ring.f.sequence_id = &in_ring.id;
  in_ring.f.q_offset = 0;
  ExpectInvalid(ValidateRegionStep(in_ring.f, 0, sh, region), "region.q_offset");

  Step past = s;
  past.f.sequence_id = &past.id;
  past.f.lse_offset = (1 << 20) - 4;
  ExpectInvalid(ValidateRegionStep(past.f, 0, sh, region), "region.lse_offset");
}

// Layer steps (DecodeStep.hidden, RegionTensors.layer_step): refused without the layer
// API, sized by hidden_size, exclusive with q/kv, position bounded.
TEST(StepValidation, LayerSteps) {
  StepShape layered = Shape();
  layered.hidden_row_bytes = 256 * 2;
  layered.max_positions = 1000;
  Step s;
  s.f.has_hidden = true;
  s.f.hidden_bytes = 3 * 512;
  EXPECT_TRUE(ValidateByteStep(s.f, 0, layered).ok());
  const absl::Status plain = ValidateByteStep(s.f, 0, Shape());
  EXPECT_EQ(plain.code(), absl::StatusCode::kFailedPrecondition) << plain;
  EXPECT_TRUE(absl::StrContains(plain.message(), "hidden: this daemon serves the kernel-level API only")) << plain;
  s.f.hidden_bytes = 3 * 512 + 2;
  ExpectInvalid(ValidateByteStep(s.f, 0, layered), "steps[0] (request_id 7).hidden: 1538 bytes; expected s_q * hidden_size * 2");
  s.f.hidden_bytes = 5 * 512;  // s_q 5 > max_s_q 4
  ExpectInvalid(ValidateByteStep(s.f, 0, layered), "1 <= s_q <= 4");
  s.f.hidden_bytes = 0;
  ExpectInvalid(ValidateByteStep(s.f, 0, layered), "hidden: 0 bytes");
  s.f.hidden_bytes = 512;
  s.f.q_bytes = layered.q_row_bytes;
  ExpectInvalid(ValidateByteStep(s.f, 0, layered), "q, kv: expected empty when hidden is set");
  s.f.q_bytes = 0;
  s.f.has_position = true;
  s.f.position = 999;
  EXPECT_TRUE(ValidateByteStep(s.f, 0, layered).ok());
  s.f.position = 1000;
  absl::Status far = ValidateByteStep(s.f, 0, layered);
  EXPECT_EQ(far.code(), absl::StatusCode::kOutOfRange) << far;
  EXPECT_TRUE(absl::StrContains(far.message(), "position: 1000; expected 0 <= position <= 999")) << far;
  s.f.position = -1;
  EXPECT_EQ(ValidateByteStep(s.f, 0, layered).code(), absl::StatusCode::kOutOfRange);
  // A kernel-level step with a position.
  Step k;
  k.f.q_bytes = layered.q_row_bytes;
  k.f.kv_bytes = layered.kv_row_bytes;
  k.f.has_position = true;
  ExpectInvalid(ValidateByteStep(k.f, 0, layered), "position: only for layer steps");

  // In a region: hidden_offset and out_offset of s_q * hidden_size * 2 bytes; not in a CUDA region.
  const RegionExtent region{true, 1 << 20, 4096};
  Step r;
  r.f.has_region = true;
  r.f.region_s_q = 2;
  r.f.region_layer_step = true;
  r.f.hidden_offset = 4096;
  r.f.out_offset = 8192;
  EXPECT_TRUE(ValidateRegionStep(r.f, 0, layered, region).ok());
  r.f.hidden_offset = (1 << 20) - 512;  // one token of two fits
  ExpectInvalid(ValidateRegionStep(r.f, 0, layered, region), "region.hidden_offset");
  r.f.hidden_offset = 4097;
  ExpectInvalid(ValidateRegionStep(r.f, 0, layered, region), "region.hidden_offset: 4097");
  r.f.hidden_offset = 4096;
  r.f.out_offset = 0;  // inside the ring
  ExpectInvalid(ValidateRegionStep(r.f, 0, layered, region), "region.out_offset: 0; expected >= 4096");
  r.f.out_offset = 8192;
  RegionExtent cuda = region;
  cuda.device = true;
  ExpectInvalid(ValidateRegionStep(r.f, 0, layered, cuda), "region.layer_step: layer steps read and write");
  EXPECT_EQ(ValidateRegionStep(r.f, 0, Shape(), region).code(), absl::StatusCode::kFailedPrecondition);
  r.f.has_hidden = true;
  ExpectInvalid(ValidateRegionStep(r.f, 0, layered, region), "hidden: expected empty when region is set");
}

TEST(StepValidation, OpenFields) {
  EXPECT_TRUE(CheckOpenFields({}).ok());
  EXPECT_TRUE(CheckOpenFields({1 << 20, false, 0}).ok());
  EXPECT_TRUE(CheckOpenFields({0, true, 64}).ok());
  ExpectInvalid(CheckOpenFields({4096, true, 0}), "DecodeRequest.open_region_bytes, open_cuda_region");
  ExpectInvalid(CheckOpenFields({0, false, 8}), "DecodeRequest.region_ring_entries: expected with");
  ExpectInvalid(CheckOpenFields({1 << 20, false, 3}), "DecodeRequest.region_ring_entries: 3; expected a power of two");
  ExpectInvalid(CheckOpenFields({1 << 20, false, 2 * ring::kMaxEntries}), "DecodeRequest.region_ring_entries");
  ExpectInvalid(CheckOpenFields({4096, false, 64}), "DecodeRequest.open_region_bytes: 4096; expected at least");
  EXPECT_TRUE(CheckOpenFields({ring::RingBytes(64), false, 64}).ok());
}

TEST(StepValidation, RingFlags) {
  EXPECT_TRUE(CheckRingFlags(5, 9, 1, 0).ok());
  ExpectInvalid(CheckRingFlags(5, 9, 2, 0), "ring entry 5 (request_id 9).causal: 2; expected 0 or 1");
  ExpectInvalid(CheckRingFlags(5, 9, 0, 3), "ring entry 5 (request_id 9).trace: 3; expected 0 or 1");
  ExpectInvalid(CheckRingFlags(5, 9, 0, 0, 2, 0), "ring entry 5 (request_id 9).layer_step: 2; expected 0 or 1");
  ExpectInvalid(CheckRingFlags(5, 9, 0, 0, 1, 7), "ring entry 5 (request_id 9).has_position: 7; expected 0 or 1");
}

}  // namespace
}  // namespace latentd::server::decode
