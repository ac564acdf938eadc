// Response layout of a Decode stream: one allocation per response's worth of results,
// not per step, and no copy of out on the way to gRPC.
#include "server/decode/response_layout.h"

#include <algorithm>
#include <cstring>

namespace latentd::server::decode {
namespace {

wire::ResultView View(const Slot* s) {
  wire::ResultView v;
  v.request_id = s->request_id;
  v.code = s->code;
  if (s->code == 0) {
    if (!s->in_region) {  // region steps' results are already in place
      v.out = &s->out_buf;
      v.lse = &s->lse_buf;
    }
  } else {
    v.message = &s->message;
  }
  if (s->trace) v.timing = &s->timing;
  return v;
}

bool InPlace(const Slot* s) { return s->laid_out && s->code == 0; }

bool LaidOutHere(const Slot* s) { return s->code == 0 && !s->in_region; }

}  // namespace

size_t ResultBytes(const Slot* s, const StepShape& sh) {
  return wire::SuccessLayout(s->request_id, static_cast<size_t>(s->s_q * OutRowBytes(sh, s->layer_step)),
                             static_cast<size_t>(s->s_q * LseRowBytes(sh, s->layer_step)), s->trace)
      .bytes;
}

void LayOut(Slot* const* slots, int n, const StepShape& sh, size_t cap) {
  cap = std::max<size_t>(1, cap);
  for (int i = 0; i < n;) {
    size_t total = 0;
    int j = i;
    for (; j < n; ++j) {
      const Slot* s = slots[j];
      if (!LaidOutHere(s)) continue;
      const size_t b = ResultBytes(s, sh);
      if (total > 0 && total + b > cap) break;
      total += b;
    }
    if (total > 0) {
      grpc::Slice buffer(total);
      uint8_t* base = const_cast<uint8_t*>(buffer.begin());
      size_t at = 0;
      for (int k = i; k < j; ++k) {
        Slot* s = slots[k];
        if (!LaidOutHere(s)) continue;
        const size_t out_bytes = static_cast<size_t>(s->s_q * OutRowBytes(sh, s->layer_step));
        const wire::ResultLayout l = wire::SuccessLayout(s->request_id, out_bytes, s->lse_buf.size(), s->trace);
        wire::EncodeSuccessHead(s->request_id, out_bytes, s->lse_buf.size(), s->trace, base + at);
        (s->layer_step ? s->layer_out : s->out) = engine::TensorLocation::Host(base + at + l.out_at, out_bytes);
        s->part = buffer.sub(at, at + l.bytes);
        s->part_tail = l.tail_at;
        s->laid_out = true;
        at += l.bytes;
      }
    }
    i = j;
  }
}

size_t FillResponse(Slot* const* done, size_t n, int64_t cap, absl::Time now, std::vector<grpc::Slice>* parts,
                    grpc::ByteBuffer* response) {
  size_t bytes = 0, taken = 0;
  while (taken < n) {
    Slot* s = done[taken];
    if (s->trace) FillTiming(s, now);
    const size_t b = InPlace(s) ? s->part.size() : wire::EncodedResultSize(View(s));
    if (taken > 0 && static_cast<int64_t>(bytes + b) > cap) break;
    bytes += b;
    ++taken;
  }
  parts->clear();
  for (size_t i = 0; i < taken;) {
    Slot* s = done[i];
    if (InPlace(s)) {
      uint8_t* base = const_cast<uint8_t*>(s->part.begin());
      wire::EncodeSuccessTail(s->lse_buf, s->trace ? &s->timing : nullptr, base + s->part_tail);
      parts->push_back(s->part);
      ++i;
      continue;
    }
    size_t run = 0, j = i;  // consecutive serialized results share one slice
    for (; j < taken && !InPlace(done[j]); ++j) run += wire::EncodedResultSize(View(done[j]));
    grpc::Slice slice(run);
    uint8_t* p = const_cast<uint8_t*>(slice.begin());
    for (; i < j; ++i) p = wire::EncodeResult(View(done[i]), p);
    parts->push_back(std::move(slice));
  }
  *response = grpc::ByteBuffer(parts->data(), parts->size());
  parts->clear();  // the byte buffer holds its own references
  return taken;
}

void FillCompletion(Slot* s, absl::Time now, ring::CqEntry* c) {
  c->request_id = s->request_id;
  c->code = s->code;
  const size_t m = std::min<size_t>(s->message.size(), ring::kMaxMessage);
  c->message_bytes = static_cast<uint32_t>(m);
  if (m > 0) std::memcpy(c->message, s->message.data(), m);
  if (s->trace) {
    s->completed = now;
    FillTiming(s, now);
    const wire::Timing& t = s->timing;
    const int64_t stamps[8] = {t.received_us, t.parsed_us,   t.submitted_us, t.batched_us,
                               t.launched_us, t.finished_us, t.completed_us, t.response_us};
    std::memcpy(c->timing_us, stamps, sizeof(stamps));
  } else {
    std::memset(c->timing_us, 0, sizeof(c->timing_us));
  }
}

}  // namespace latentd::server::decode
