// The Slot helpers every decode unit shares.
#include "server/decode/step_slot.h"

namespace latentd::server::decode {

void ResetSlot(Slot* s, uint64_t request_id, bool trace, absl::Time received) {
  s->request_id = request_id;
  s->code = 0;
  s->accepted = false;
  s->message.clear();
  s->trace = trace;
  s->received = received;
  s->submitted = s->batched_at = s->launched_at = s->finished_at = s->completed = absl::Time();
  s->complete_inline = false;
  s->layer_step = false;
  s->hidden = s->layer_out = engine::TensorLocation();
  s->position = -1;
}

void SetError(Slot* s, const absl::Status& status) {
  s->code = static_cast<int32_t>(status.code());
  s->message.assign(status.message().data(), status.message().size());
}

void DropPart(Slot* s) {
  s->part = grpc::Slice();
  s->laid_out = false;
}

int64_t HeldBytes(const Slot* s) {
  return static_cast<int64_t>(s->q_buf.capacity() + s->kv_buf.capacity() + s->out_buf.capacity() +
                              s->lse_buf.capacity() + s->sequence_id.capacity() + s->message.capacity() +
                              s->pin_bytes);
}

void FillTiming(Slot* s, absl::Time response) {
  auto us = [](absl::Time t) { return t == absl::Time() ? int64_t{0} : absl::ToUnixMicros(t); };
  wire::Timing& t = s->timing;
  t.received_us = us(s->received);
  t.parsed_us = us(s->parsed);
  t.submitted_us = us(s->submitted);
  t.batched_us = us(s->batched_at);
  t.launched_us = us(s->launched_at);
  t.finished_us = us(s->finished_at);
  t.completed_us = us(s->completed);
  t.response_us = us(response);
}

}  // namespace latentd::server::decode
