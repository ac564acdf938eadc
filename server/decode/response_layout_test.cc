// Response layout without a daemon: several steps' results laid out ahead of time,
// written in place as the engine would, and coalesced into DecodeResponses that
// protobuf reads back in order, split at the byte cap; ring completions likewise.
#include "server/decode/response_layout.h"

#include <cstring>
#include <string>
#include <vector>

#include "engine/types.h"
#include "gtest/gtest.h"
#include "proto/latentd.pb.h"

namespace latentd::server::decode {
namespace {

StepShape Shape() {
  engine::ModelConfig m;
  m.num_heads_q = 2;
  return StepShape::For(m, 4);
}

// A successful byte step of s_q tokens, as Prepare leaves it.
void ByteStep(Slot* s, uint64_t id, int s_q, const StepShape& sh) {
  ResetSlot(s, id, false, absl::Time());
  s->s_q = s_q;
  s->lse_buf.assign(static_cast<size_t>(s_q * sh.lse_row_bytes), static_cast<char>(id));
}

v1::DecodeResponse Parse(grpc::ByteBuffer* b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b->Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  v1::DecodeResponse r;
  EXPECT_TRUE(r.ParseFromString(bytes));
  return r;
}

TEST(ResponseLayout, SeveralStepsLaidOutThenCoalescedInOrder) {
  const StepShape sh = Shape();
  std::vector<Slot> slots(4);
  ByteStep(&slots[0], 10, 1, sh);
  ByteStep(&slots[1], 11, 3, sh);
  ByteStep(&slots[2], 12, 2, sh);
  SetError(&slots[2], absl::InvalidArgumentError("kv: bad"));  // failed: serialized, not laid out
  ByteStep(&slots[3], 13, 1, sh);
  slots[3].in_region = true;  // its result is in the client's region
  std::vector<Slot*> ptrs;
  for (Slot& s : slots) ptrs.push_back(&s);
  LayOut(ptrs.data(), 4, sh, 1 << 20);
  EXPECT_TRUE(slots[0].laid_out && slots[1].laid_out);
  EXPECT_FALSE(slots[2].laid_out || slots[3].laid_out);
  // One buffer for both (under the cap): their parts are neighbours in it.
  EXPECT_EQ(slots[0].part.begin() + slots[0].part.size(), slots[1].part.begin());
  // The engine writes out in place.
  for (int i = 0; i < 2; ++i)
    std::memset(slots[i].out.host(), 'a' + i, static_cast<size_t>(slots[i].s_q * sh.out_row_bytes));

  std::vector<grpc::Slice> parts;
  grpc::ByteBuffer response;
  const size_t taken = FillResponse(ptrs.data(), 4, 1 << 20, absl::Now(), &parts, &response);
  EXPECT_EQ(taken, 4u);
  const v1::DecodeResponse r = Parse(&response);
  ASSERT_EQ(r.results_size(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(r.results(i).request_id(), 10u + i);
  EXPECT_EQ(r.results(0).out(), std::string(static_cast<size_t>(sh.out_row_bytes), 'a'));
  EXPECT_EQ(r.results(1).out(), std::string(static_cast<size_t>(3 * sh.out_row_bytes), 'b'));
  EXPECT_EQ(r.results(1).lse(), slots[1].lse_buf);
  EXPECT_EQ(r.results(2).code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(r.results(2).message(), "kv: bad");
  EXPECT_TRUE(r.results(3).out().empty());
  EXPECT_EQ(r.results(3).code(), 0);
}

TEST(ResponseLayout, BuffersAndResponsesSplitAtTheCap) {
  const StepShape sh = Shape();
  std::vector<Slot> slots(3);
  std::vector<Slot*> ptrs;
  for (int i = 0; i < 3; ++i) {
    ByteStep(&slots[i], 20 + i, 2, sh);
    ptrs.push_back(&slots[i]);
  }
  const size_t one = ResultBytes(&slots[0], sh);
  LayOut(ptrs.data(), 3, sh, 2 * one);  // two results per buffer
  EXPECT_EQ(slots[0].part.begin() + one, slots[1].part.begin());
  EXPECT_NE(slots[1].part.begin() + one, slots[2].part.begin());
  for (Slot& s : slots) EXPECT_EQ(s.part.size(), one);

  std::vector<grpc::Slice> parts;
  grpc::ByteBuffer response;
  // A cap below one result still takes one.
  EXPECT_EQ(FillResponse(ptrs.data(), 3, 1, absl::Now(), &parts, &response), 1u);
  EXPECT_EQ(Parse(&response).results(0).request_id(), 20u);
  EXPECT_EQ(FillResponse(ptrs.data() + 1, 2, static_cast<int64_t>(2 * one), absl::Now(), &parts, &response), 2u);
  const v1::DecodeResponse r = Parse(&response);
  ASSERT_EQ(r.results_size(), 2);
  EXPECT_EQ(r.results(1).request_id(), 22u);
}

TEST(ResponseLayout, TracedResultsCarryTheirTiming) {
  const StepShape sh = Shape();
  Slot s;
  ByteStep(&s, 30, 1, sh);
  s.trace = true;
  s.received = absl::FromUnixMicros(100);
  s.finished_at = absl::FromUnixMicros(200);
  Slot* p = &s;
  LayOut(&p, 1, sh, 1 << 20);
  std::vector<grpc::Slice> parts;
  grpc::ByteBuffer response;
  ASSERT_EQ(FillResponse(&p, 1, 1 << 20, absl::FromUnixMicros(300), &parts, &response), 1u);
  const v1::DecodeResponse r = Parse(&response);
  ASSERT_EQ(r.results_size(), 1);
  EXPECT_EQ(r.results(0).timing().received_us(), 100);
  EXPECT_EQ(r.results(0).timing().finished_us(), 200);
  EXPECT_EQ(r.results(0).timing().response_us(), 300);
  EXPECT_EQ(r.results(0).timing().parsed_us(), 0);
}

TEST(ResponseLayout, CompletionEntries) {
  Slot s;
  ResetSlot(&s, 41, true, absl::FromUnixMicros(5));
  SetError(&s, absl::NotFoundError(std::string(400, 'm')));
  ring::CqEntry c;
  std::memset(&c, 0xff, sizeof(c));
  FillCompletion(&s, absl::FromUnixMicros(9), &c);
  EXPECT_EQ(c.request_id, 41u);
  EXPECT_EQ(c.code, static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_EQ(c.message_bytes, static_cast<uint32_t>(ring::kMaxMessage));  // cut to fit
  EXPECT_EQ(c.timing_us[0], 5);
  EXPECT_EQ(c.timing_us[6], 9);  // completed
  EXPECT_EQ(c.timing_us[7], 9);  // response

  Slot quiet;
  ResetSlot(&quiet, 42, false, absl::Time());
  FillCompletion(&quiet, absl::FromUnixMicros(9), &c);
  EXPECT_EQ(c.code, 0);
  EXPECT_EQ(c.message_bytes, 0u);
  for (int64_t t : c.timing_us) EXPECT_EQ(t, 0);
}

}  // namespace
}  // namespace latentd::server::decode
