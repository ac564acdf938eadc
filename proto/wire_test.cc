// The hand-written wire reader/writer against protobuf's own serialization of the same
// messages: round trips, bounds, unknown fields, malformed bytes and the step count.
#include "proto/wire.h"

#include <cstring>
#include <random>
#include <string>

#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"
#include "proto/latentd.pb.h"

namespace latentd::wire {
namespace {

using google::protobuf::io::ArrayInputStream;

// Splits the input into small chunks so that fields cross buffer boundaries.
ArrayInputStream Stream(const std::string& bytes) { return ArrayInputStream(bytes.data(), bytes.size(), 7); }

v1::DecodeStep MakeStep(uint64_t id, const std::string& seq, int layer, int q_bytes, int kv_bytes) {
  v1::DecodeStep s;
  s.set_request_id(id);
  s.set_sequence_id(seq);
  s.set_layer(layer);
  std::string q(q_bytes, '\0'), kv(kv_bytes, '\0');
  for (int i = 0; i < q_bytes; ++i) q[i] = static_cast<char>(i * 7 + id);
  for (int i = 0; i < kv_bytes; ++i) kv[i] = static_cast<char>(i * 13 + id);
  s.set_q(q);
  s.set_kv(kv);
  s.set_causal(id % 2 == 1);
  s.set_timeout_ms(static_cast<uint32_t>(id * 10));
  return s;
}

struct Buffers {
  std::string id, q, kv;
  StepFields Fields() {
    StepFields f;
    f.sequence_id = &id;
    f.q = &q;
    f.kv = &kv;
    return f;
  }
};

TEST(WireTest, StepsRoundTripAgainstProtobuf) {
  v1::DecodeRequest req;
  for (int i = 0; i < 5; ++i) *req.add_steps() = MakeStep(100 + i, "seq-" + std::to_string(i), i, 40 * i, 8 * i);
  const std::string bytes = req.SerializeAsString();
  auto counted = Stream(bytes);
  ASSERT_EQ(*CountDecodeSteps(&counted, 100), 5);

  StepBounds b;
  b.max_q_bytes = 1000;
  b.max_kv_bytes = 1000;
  auto in = Stream(bytes);
  DecodeStepReader reader(&in);
  Buffers buf;
  for (int i = 0; i < 5; ++i) {
    StepFields f = buf.Fields();
    auto more = reader.Next(b, &f);
    ASSERT_TRUE(more.ok()) << more.status();
    ASSERT_TRUE(*more);
    const v1::DecodeStep& want = req.steps(i);
    EXPECT_EQ(f.request_id, want.request_id());
    EXPECT_EQ(buf.id, want.sequence_id());
    EXPECT_EQ(f.layer, want.layer());
    EXPECT_EQ(buf.q, want.q());
    EXPECT_EQ(buf.kv, want.kv());
    EXPECT_EQ(f.q_bytes, static_cast<int64_t>(want.q().size()));
    EXPECT_EQ(f.causal, want.causal());
    EXPECT_EQ(f.timeout_ms, want.timeout_ms());
  }
  StepFields f = buf.Fields();
  auto more = reader.Next(b, &f);
  ASSERT_TRUE(more.ok());
  EXPECT_FALSE(*more);
}

TEST(WireTest, OversizedFieldsAreSkippedWithTheirSize) {
  v1::DecodeRequest req;
  *req.add_steps() = MakeStep(1, std::string(300, 'a'), 0, 5000, 10);
  *req.add_steps() = MakeStep(2, "ok", 0, 16, 10);
  const std::string bytes = req.SerializeAsString();
  StepBounds b;
  b.max_q_bytes = 64;
  b.max_kv_bytes = 64;
  auto in = Stream(bytes);
  DecodeStepReader reader(&in);
  Buffers buf;
  StepFields f = buf.Fields();
  ASSERT_TRUE(*reader.Next(b, &f));
  EXPECT_EQ(f.sequence_id_bytes, 300);
  EXPECT_TRUE(buf.id.empty());
  EXPECT_EQ(f.q_bytes, 5000);
  EXPECT_TRUE(buf.q.empty());
  EXPECT_EQ(buf.kv.size(), 10u);
  f = buf.Fields();
  ASSERT_TRUE(*reader.Next(b, &f));  // the next step is read normally after the skip
  EXPECT_EQ(f.request_id, 2u);
  EXPECT_EQ(buf.id, "ok");
  EXPECT_EQ(buf.q, req.steps(1).q());
}

// q and kv go into the caller's memory when they fit there, into the strings when they
// do not, and nowhere when they are over their bounds; the sizes are the wire's.
TEST(WireTest, FieldsGoIntoRawMemoryWhenTheyFit) {
  v1::DecodeRequest req;
  *req.add_steps() = MakeStep(1, "fits", 0, 48, 16);
  *req.add_steps() = MakeStep(2, "q-too-big", 0, 80, 16);
  *req.add_steps() = MakeStep(3, "over-bound", 0, 48, 200);
  const std::string bytes = req.SerializeAsString();
  StepBounds b;
  b.max_q_bytes = 1000;
  b.max_kv_bytes = 100;
  auto in = Stream(bytes);
  DecodeStepReader reader(&in);
  Buffers buf;
  std::string raw_q(64, 'x'), raw_kv(32, 'y');
  auto fields = [&] {
    StepFields f = buf.Fields();
    f.q_dst = &raw_q[0];
    f.q_cap = 64;
    f.kv_dst = &raw_kv[0];
    f.kv_cap = 32;
    return f;
  };
  StepFields f = fields();
  ASSERT_TRUE(*reader.Next(b, &f));
  EXPECT_TRUE(f.q_raw);
  EXPECT_TRUE(f.kv_raw);
  EXPECT_EQ(f.q_bytes, 48);
  EXPECT_EQ(raw_q.substr(0, 48), req.steps(0).q());
  EXPECT_EQ(raw_q.substr(48), std::string(16, 'x'));  // nothing past the field
  EXPECT_EQ(raw_kv.substr(0, 16), req.steps(0).kv());
  EXPECT_TRUE(buf.q.empty());
  f = fields();
  ASSERT_TRUE(*reader.Next(b, &f));
  EXPECT_FALSE(f.q_raw);
  EXPECT_TRUE(f.kv_raw);
  EXPECT_EQ(buf.q, req.steps(1).q());
  EXPECT_EQ(raw_kv.substr(0, 16), req.steps(1).kv());
  f = fields();
  ASSERT_TRUE(*reader.Next(b, &f));
  EXPECT_TRUE(f.q_raw);
  EXPECT_FALSE(f.kv_raw);
  EXPECT_EQ(f.kv_bytes, 200);
  EXPECT_TRUE(buf.kv.empty());
  EXPECT_EQ(raw_q.substr(0, 48), req.steps(2).q());
}

TEST(WireTest, CountStopsAtTheLimitWithoutReadingFurther) {
  // 100000 empty steps: 2 bytes each on the wire.
  std::string bytes;
  for (int i = 0; i < 100000; ++i) bytes += std::string("\x0a\x00", 2);
  auto in = Stream(bytes);
  auto n = CountDecodeSteps(&in, 1024);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 1025);
  auto all = Stream(bytes);
  EXPECT_EQ(*CountDecodeSteps(&all, 1 << 20), 100000);
}

TEST(WireTest, UnknownFieldsAreSkipped) {
  v1::DecodeRequest req;
  *req.add_steps() = MakeStep(9, "s", 1, 8, 8);
  std::string bytes = req.SerializeAsString();
  // An unknown varint field 15 at the top level and an unknown bytes field 20 inside
  // a second step.
  bytes += std::string("\x78\x05", 2);
  std::string step = MakeStep(10, "t", 2, 8, 8).SerializeAsString();
  step += std::string("\xa2\x01\x03xyz", 6);
  bytes += '\x0a';
  bytes += static_cast<char>(step.size());
  bytes += step;
  auto counted = Stream(bytes);
  EXPECT_EQ(*CountDecodeSteps(&counted, 10), 2);
  auto in = Stream(bytes);
  DecodeStepReader reader(&in);
  Buffers buf;
  StepBounds b;
  b.max_q_bytes = b.max_kv_bytes = 100;
  StepFields f = buf.Fields();
  ASSERT_TRUE(*reader.Next(b, &f));
  EXPECT_EQ(f.request_id, 9u);
  f = buf.Fields();
  ASSERT_TRUE(*reader.Next(b, &f));
  EXPECT_EQ(f.request_id, 10u);
  EXPECT_EQ(buf.id, "t");
  EXPECT_EQ(f.layer, 2);
}

TEST(WireTest, MalformedBytesAreInvalidArgument) {
  v1::DecodeRequest req;
  *req.add_steps() = MakeStep(1, "s", 0, 100, 10);
  const std::string good = req.SerializeAsString();
  for (size_t cut = 1; cut < good.size(); ++cut) {
    const std::string bad = good.substr(0, cut);  // truncated inside the step
    auto in = Stream(bad);
    auto n = CountDecodeSteps(&in, 10);
    EXPECT_FALSE(n.ok()) << "cut " << cut;
    if (!n.ok()) {
      EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  const std::string garbage("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 11);
  auto in = Stream(garbage);
  EXPECT_FALSE(CountDecodeSteps(&in, 10).ok());
}

TEST(WireTest, ResultsParseAsDecodeResponse) {
  std::string out1(2048, 'o'), lse1(64, 'l'), msg2 = "steps[1]: bad", empty;
  ResultView r1;
  r1.request_id = 77;
  r1.out = &out1;
  r1.lse = &lse1;
  ResultView r2;
  r2.request_id = 0;
  r2.code = 3;
  r2.message = &msg2;
  ResultView r3;
  r3.request_id = 5;
  r3.code = -1;  // negative int32 takes ten bytes
  std::string buf(EncodedResultSize(r1) + EncodedResultSize(r2) + EncodedResultSize(r3), '\0');
  uint8_t* p = reinterpret_cast<uint8_t*>(&buf[0]);
  p = EncodeResult(r1, p);
  p = EncodeResult(r2, p);
  p = EncodeResult(r3, p);
  ASSERT_EQ(p, reinterpret_cast<uint8_t*>(&buf[0]) + buf.size());
  v1::DecodeResponse resp;
  ASSERT_TRUE(resp.ParseFromString(buf));
  ASSERT_EQ(resp.results_size(), 3);
  EXPECT_EQ(resp.results(0).request_id(), 77u);
  EXPECT_EQ(resp.results(0).out(), out1);
  EXPECT_EQ(resp.results(0).lse(), lse1);
  EXPECT_EQ(resp.results(0).code(), 0);
  EXPECT_EQ(resp.results(1).code(), 3);
  EXPECT_EQ(resp.results(1).message(), msg2);
  EXPECT_EQ(resp.results(2).code(), -1);
  EXPECT_EQ(resp.results(2).request_id(), 5u);
}

TEST(WireTest, TimingRoundTripsAndTraceIsRead) {
  std::string out(64, 'o'), lse(8, 'l');
  Timing t;
  t.received_us = 1'700'000'000'000'001;
  t.parsed_us = t.received_us + 3;
  t.batched_us = t.received_us + 300;  // submitted_us left zero: omitted on the wire
  t.response_us = t.received_us + 9999;
  ResultView r;
  r.request_id = 9;
  r.out = &out;
  r.lse = &lse;
  r.timing = &t;
  std::string buf(EncodedResultSize(r), '\0');
  ASSERT_EQ(EncodeResult(r, reinterpret_cast<uint8_t*>(&buf[0])), reinterpret_cast<uint8_t*>(&buf[0]) + buf.size());
  v1::DecodeResponse resp;
  ASSERT_TRUE(resp.ParseFromString(buf));
  ASSERT_EQ(resp.results_size(), 1);
  const v1::StepTiming& pt = resp.results(0).timing();
  EXPECT_EQ(pt.received_us(), t.received_us);
  EXPECT_EQ(pt.parsed_us(), t.parsed_us);
  EXPECT_EQ(pt.submitted_us(), 0);
  EXPECT_EQ(pt.batched_us(), t.batched_us);
  EXPECT_EQ(pt.response_us(), t.response_us);
  EXPECT_EQ(resp.results(0).out(), out);
  r.timing = nullptr;  // untraced results carry no timing at all
  std::string plain(EncodedResultSize(r), '\0');
  EncodeResult(r, reinterpret_cast<uint8_t*>(&plain[0]));
  ASSERT_TRUE(resp.ParseFromString(plain));
  EXPECT_FALSE(resp.results(0).has_timing());
  EXPECT_LT(plain.size(), buf.size());

  v1::DecodeRequest req;
  auto* s = req.add_steps();
  s->set_request_id(1);
  s->set_sequence_id("a");
  s->set_trace(true);
  req.add_steps()->set_request_id(2);
  const std::string bytes = req.SerializeAsString();
  auto in = Stream(bytes);
  DecodeStepReader reader(&in);
  std::string id, q, kv;
  StepFields f;
  f.sequence_id = &id;
  f.q = &q;
  f.kv = &kv;
  StepBounds b;
  b.max_q_bytes = b.max_kv_bytes = 1 << 20;
  ASSERT_TRUE(*reader.Next(b, &f));
  EXPECT_TRUE(f.trace);
  ASSERT_TRUE(*reader.Next(b, &f));
  EXPECT_FALSE(f.trace);  // reset for every step
}

// A result laid out ahead (head, out written in place, tail) is byte for byte what
// EncodeResult writes for the same result.
TEST(WireTest, SuccessLayoutMatchesEncodeResult) {
  std::mt19937 rng(3);
  for (uint64_t request_id : {uint64_t{0}, uint64_t{1}, uint64_t{300}, ~uint64_t{0}}) {
    for (size_t out_bytes : {size_t{2}, size_t{1024}, size_t{131072}}) {
      for (bool traced : {false, true}) {
        std::string out(out_bytes, '\0'), lse(out_bytes / 16 + 4, '\0');
        for (char& c : out) c = static_cast<char>(rng());
        for (char& c : lse) c = static_cast<char>(rng());
        Timing t;
        t.received_us = 1'700'000'000'000'000 + static_cast<int64_t>(rng());
        t.response_us = t.received_us + 17;
        ResultView v;
        v.request_id = request_id;
        v.out = &out;
        v.lse = &lse;
        v.timing = traced ? &t : nullptr;
        std::string want(EncodedResultSize(v), '\0');
        EncodeResult(v, reinterpret_cast<uint8_t*>(&want[0]));
        const ResultLayout l = SuccessLayout(request_id, out.size(), lse.size(), traced);
        ASSERT_EQ(l.bytes, want.size());
        std::string got(l.bytes, '\x7f');
        uint8_t* base = reinterpret_cast<uint8_t*>(&got[0]);
        EncodeSuccessHead(request_id, out.size(), lse.size(), traced, base);
        std::memcpy(base + l.out_at, out.data(), out.size());
        EncodeSuccessTail(lse, traced ? &t : nullptr, base + l.tail_at);
        ASSERT_EQ(got, want) << "request_id " << request_id << " out " << out_bytes << " traced " << traced;
      }
    }
  }
}

TEST(WireTest, RegionFieldsAndResponse) {
  v1::DecodeRequest req;
  req.set_open_region_bytes(uint64_t{5} << 30);
  auto* s = req.add_steps();
  s->set_request_id(4);
  s->mutable_region()->set_s_q(2);
  s->mutable_region()->set_q_offset(64);
  s->mutable_region()->set_kv_offset(uint64_t{1} << 40);
  s->mutable_region()->set_out_offset(6);
  s->mutable_region()->set_lse_offset(8);
  req.add_steps()->set_request_id(5);
  const std::string bytes = req.SerializeAsString();
  auto counted = Stream(bytes);
  uint64_t open = 0;
  auto n = CountDecodeSteps(&counted, 10, &open);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 2);
  EXPECT_EQ(open, uint64_t{5} << 30);
  auto in = Stream(bytes);
  DecodeStepReader reader(&in);
  std::string id, q, kv;
  StepFields f;
  f.sequence_id = &id;
  f.q = &q;
  f.kv = &kv;
  StepBounds b;
  ASSERT_TRUE(*reader.Next(b, &f));
  EXPECT_TRUE(f.has_region);
  EXPECT_EQ(f.region_s_q, 2u);
  EXPECT_EQ(f.q_offset, 64u);
  EXPECT_EQ(f.kv_offset, uint64_t{1} << 40);
  EXPECT_EQ(f.out_offset, 6u);
  EXPECT_EQ(f.lse_offset, 8u);
  ASSERT_TRUE(*reader.Next(b, &f));
  EXPECT_FALSE(f.has_region);  // reset for every step
  EXPECT_EQ(f.q_offset, 0u);

  v1::DecodeResponse resp;
  ASSERT_TRUE(resp.ParseFromString(EncodeRegionResponse("/proc/1/fd/7", 12345)));
  EXPECT_EQ(resp.region().path(), "/proc/1/fd/7");
  EXPECT_EQ(resp.region().bytes(), 12345u);
  EXPECT_EQ(resp.region().ring_bytes(), 0u);
  EXPECT_EQ(resp.results_size(), 0);
  // A CUDA region's separate ring file.
  ASSERT_TRUE(resp.ParseFromString(EncodeRegionResponse("/proc/1/fd/9", uint64_t{1} << 35, 73728)));
  EXPECT_EQ(resp.region().path(), "/proc/1/fd/9");
  EXPECT_EQ(resp.region().bytes(), uint64_t{1} << 35);
  EXPECT_EQ(resp.region().ring_bytes(), 73728u);
  // Handed over: no path, the socket and the ticket (binary bytes).
  const std::string ticket("\0\x01\xff ticket-bytes-16", 16);
  ASSERT_TRUE(resp.ParseFromString(EncodeRegionResponse("", 4096, 0, "@latentd-1-00ab", ticket)));
  EXPECT_EQ(resp.region().path(), "");
  EXPECT_EQ(resp.region().bytes(), 4096u);
  EXPECT_EQ(resp.region().ring_bytes(), 0u);
  EXPECT_EQ(resp.region().handoff_socket(), "@latentd-1-00ab");
  EXPECT_EQ(resp.region().ticket(), ticket);
}

TEST(WireTest, CudaRegionFields) {
  v1::DecodeRequest req;
  std::string handle(64, '\0');
  for (int i = 0; i < 64; ++i) handle[i] = static_cast<char>(i * 7 + 1);
  req.mutable_open_cuda_region()->set_ipc_handle(handle);
  req.mutable_open_cuda_region()->set_offset(uint64_t{3} << 33);
  req.mutable_open_cuda_region()->set_bytes(987654321);
  req.add_steps()->set_request_id(1);
  const std::string wire_bytes = req.SerializeAsString();  // Stream() reads it in place
  auto counted = Stream(wire_bytes);
  uint64_t open = 7;
  CudaRegionFields cuda;
  auto n = CountDecodeSteps(&counted, 10, &open, &cuda);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 1);
  EXPECT_EQ(open, 0u);
  EXPECT_TRUE(cuda.present);
  EXPECT_EQ(cuda.handle, handle);
  EXPECT_EQ(cuda.handle_bytes, 64);
  EXPECT_EQ(cuda.offset, uint64_t{3} << 33);
  EXPECT_EQ(cuda.bytes, 987654321u);

  // A handle over the bound is measured, not copied; a message without the field
  // leaves the previous message's fields behind.
  req.mutable_open_cuda_region()->set_ipc_handle(std::string(1000, 'h'));
  const std::string big_bytes = req.SerializeAsString();
  auto big = Stream(big_bytes);
  ASSERT_TRUE(CountDecodeSteps(&big, 10, &open, &cuda).ok());
  EXPECT_TRUE(cuda.present);
  EXPECT_EQ(cuda.handle_bytes, 1000);
  EXPECT_TRUE(cuda.handle.empty());
  req.clear_open_cuda_region();
  const std::string none_bytes = req.SerializeAsString();
  auto none = Stream(none_bytes);
  ASSERT_TRUE(CountDecodeSteps(&none, 10, &open, &cuda).ok());
  EXPECT_FALSE(cuda.present);
  EXPECT_EQ(cuda.handle_bytes, 0);

  // A truncated CudaRegion is malformed.
  req.mutable_open_cuda_region()->set_ipc_handle(handle);
  std::string bytes = req.SerializeAsString();
  bytes.resize(20);
  auto cut = Stream(bytes);
  EXPECT_FALSE(CountDecodeSteps(&cut, 10, &open, &cuda).ok());
}

TEST(WireTest, AppendKvRequest) {
  v1::AppendKvRequest req;
  req.set_sequence_id("abc");
  req.set_layer(3);
  req.set_kv(std::string(5000, 'k'));
  const std::string bytes = req.SerializeAsString();
  std::string id, kv;
  AppendFields f;
  f.sequence_id = &id;
  f.kv = &kv;
  auto in = Stream(bytes);
  ASSERT_TRUE(ReadAppendKvRequest(&in, 128, &f).ok());
  EXPECT_EQ(id, "abc");
  EXPECT_EQ(f.layer, 3);
  EXPECT_EQ(kv, req.kv());
  req.set_sequence_id(std::string(500, 'x'));
  const std::string long_id = req.SerializeAsString();
  auto in2 = Stream(long_id);
  ASSERT_TRUE(ReadAppendKvRequest(&in2, 128, &f).ok());
  EXPECT_EQ(f.sequence_id_bytes, 500);
  EXPECT_TRUE(id.empty());
  const std::string truncated = bytes.substr(0, bytes.size() - 1);  // outlives the stream
  auto in3 = Stream(truncated);
  EXPECT_FALSE(ReadAppendKvRequest(&in3, 128, &f).ok());
}

// The layer API's fields: hidden goes where q goes (never both), position is optional,
// and a region's layer step carries its hidden offset; AppendKvRequest.hidden.
TEST(WireTest, LayerStepFields) {
  v1::DecodeRequest req;
  v1::DecodeStep* a = req.add_steps();
  a->set_request_id(1);
  a->set_sequence_id("s");
  a->set_hidden(std::string(384, 'h'));
  a->set_position(0);  // present although 0
  v1::DecodeStep* b = req.add_steps();
  b->set_request_id(2);
  b->set_sequence_id("s");
  b->set_hidden(std::string(768, 'g'));
  v1::DecodeStep* c = req.add_steps();
  c->set_request_id(3);
  c->set_sequence_id("s");
  c->mutable_region()->set_s_q(2);
  c->mutable_region()->set_layer_step(true);
  c->mutable_region()->set_hidden_offset(4096);
  c->mutable_region()->set_out_offset(8192);
  c->mutable_region()->set_position(77);
  *req.add_steps() = MakeStep(4, "s", 1, 40, 8);
  v1::DecodeStep* d = req.mutable_steps(3);
  d->set_hidden(std::string(1000, 'x'));  // over the bound: skipped, size kept
  const std::string bytes = req.SerializeAsString();
  StepBounds bounds;
  bounds.max_q_bytes = 64;
  bounds.max_kv_bytes = 64;
  bounds.max_hidden_bytes = 768;
  auto in = Stream(bytes);
  DecodeStepReader reader(&in);
  Buffers buf;
  StepFields f = buf.Fields();
  ASSERT_TRUE(*reader.Next(bounds, &f));
  EXPECT_TRUE(f.has_hidden && f.has_position);
  EXPECT_EQ(f.position, 0);
  EXPECT_EQ(f.hidden_bytes, 384);
  EXPECT_EQ(f.q_bytes, 0);
  EXPECT_EQ(buf.q, a->hidden());
  ASSERT_TRUE(*reader.Next(bounds, &f));
  EXPECT_TRUE(f.has_hidden);
  EXPECT_FALSE(f.has_position);  // cleared from the step before
  EXPECT_EQ(buf.q, b->hidden());
  ASSERT_TRUE(*reader.Next(bounds, &f));
  EXPECT_FALSE(f.has_hidden);
  EXPECT_TRUE(f.has_region && f.region_layer_step && f.has_position);
  EXPECT_EQ(f.region_s_q, 2u);
  EXPECT_EQ(f.hidden_offset, 4096u);
  EXPECT_EQ(f.out_offset, 8192u);
  EXPECT_EQ(f.position, 77);
  ASSERT_TRUE(*reader.Next(bounds, &f));
  EXPECT_TRUE(f.has_hidden);
  EXPECT_FALSE(f.region_layer_step);
  EXPECT_EQ(f.hidden_bytes, 1000);
  EXPECT_EQ(f.q_bytes, 40);  // q stays counted: validation refuses a step with both
  EXPECT_FALSE(*reader.Next(bounds, &f));

  v1::AppendKvRequest up;
  up.set_sequence_id("s");
  up.set_hidden(std::string(3000, 'h'));
  const std::string ub = up.SerializeAsString();
  std::string id, kv, hidden;
  AppendFields af;
  af.sequence_id = &id;
  af.kv = &kv;
  af.hidden = &hidden;
  auto uin = Stream(ub);
  ASSERT_TRUE(ReadAppendKvRequest(&uin, 128, &af).ok());
  EXPECT_EQ(af.hidden_bytes, 3000);
  EXPECT_EQ(hidden, up.hidden());
  EXPECT_TRUE(kv.empty());
}

}  // namespace
}  // namespace latentd::wire
