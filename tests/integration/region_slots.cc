// The data-plane tests' slot layout and the steps, ring entries and results that use it
// (region_slots.h).
#include "tests/integration/region_slots.h"

#include <cstring>

namespace latentd::testing {

SlotLayout::SlotLayout(const client::Shape& sh, uint64_t base_bytes, uint64_t align)
    : base(base_bytes), q(0), kv(sh.QBytes(2)), out(kv + sh.KvBytes(2)), lse(out + sh.OutBytes(2)),
      slot((lse + sh.LseBytes(2) + align - 1) / align * align) {}

int PointAtSlot(v1::DecodeStep* step, const client::Shape& sh, const SlotLayout& lay, int i) {
  const int s_q = static_cast<int>(step->q().size() / sh.q_row_bytes);
  step->clear_q();
  step->clear_kv();
  v1::RegionTensors* r = step->mutable_region();
  r->set_s_q(s_q);
  r->set_q_offset(lay.at(i) + lay.q);
  r->set_kv_offset(lay.at(i) + lay.kv);
  r->set_out_offset(lay.at(i) + lay.out);
  r->set_lse_offset(lay.at(i) + lay.lse);
  return s_q;
}

int IntoSlot(v1::DecodeStep* step, const client::Shape& sh, const SlotLayout& lay, char* region, int i) {
  char* p = region + lay.at(i);
  std::memcpy(p + lay.q, step->q().data(), step->q().size());
  std::memcpy(p + lay.kv, step->kv().data(), step->kv().size());
  return PointAtSlot(step, sh, lay, i);
}

client::Ring::Step IntoRingSlot(const v1::DecodeStep& step, const std::string& sequence_id,
                                const client::Shape& sh, const SlotLayout& lay, char* region, int i) {
  char* p = region + lay.at(i);
  std::memcpy(p + lay.q, step.q().data(), step.q().size());
  std::memcpy(p + lay.kv, step.kv().data(), step.kv().size());
  client::Ring::Step r;
  r.request_id = step.request_id();
  r.sequence_id = sequence_id;
  r.layer = step.layer();
  r.s_q = static_cast<uint32_t>(step.q().size() / sh.q_row_bytes);
  r.causal = step.causal();
  r.q_offset = lay.at(i) + lay.q;
  r.kv_offset = lay.at(i) + lay.kv;
  r.out_offset = lay.at(i) + lay.out;
  r.lse_offset = lay.at(i) + lay.lse;
  return r;
}

v1::StepResult InPlaceResult(uint64_t request_id, const client::Shape& sh, const SlotLayout& lay,
                             const char* region, int i, int s_q) {
  v1::StepResult r;
  r.set_request_id(request_id);
  const char* p = region + lay.at(i);
  r.set_out(std::string(p + lay.out, sh.OutBytes(s_q)));
  r.set_lse(std::string(p + lay.lse, sh.LseBytes(s_q)));
  return r;
}

grpc::Status Close(client::DecodeStream* stream) {
  stream->WritesDone();
  v1::DecodeResponse resp;
  while (stream->Read(&resp)) {
  }
  return stream->Finish();
}

}  // namespace latentd::testing
