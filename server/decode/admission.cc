// Step-buffer accounting and slot reuse of a Decode stream.
#include "server/decode/admission.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace latentd::server::decode {

absl::Status ChargeSlot(Slot* s, int64_t extra, ByteBudget* budget) {
  const int64_t want = HeldBytes(s) + extra;
  if (want <= s->charged) return absl::OkStatus();
  if (budget->Charge(want - s->charged)) {
    s->charged = want;
    return absl::OkStatus();
  }
  std::string().swap(s->q_buf);
  std::string().swap(s->kv_buf);
  return absl::ResourceExhaustedError(
      absl::StrCat("server busy: step buffers of all streams are at --max_inflight_bytes=", budget->limit(),
                   "; retry after results come back"));
}

void ReleaseSlot(Slot* s, ByteBudget* budget) {
  if (s->charged > 0) budget->Release(s->charged);
  s->charged = 0;
}

int64_t ResultCharge(int64_t s_q, size_t lse_capacity, const StepShape& sh, bool layer_step) {
  return std::max<int64_t>(0, s_q * LseRowBytes(sh, layer_step) - static_cast<int64_t>(lse_capacity)) +
         s_q * (OutRowBytes(sh, layer_step) + 64);
}

PinnedSize PinnedFor(int64_t s_q, const StepShape& sh) {
  const size_t page = 4096;
  PinnedSize p;
  p.kv_at = static_cast<size_t>(s_q * sh.q_row_bytes + 255) / 256 * 256;
  p.bytes = (p.kv_at + static_cast<size_t>(s_q * sh.kv_row_bytes) + page - 1) / page * page;
  return p;
}

void SlotPool::Take(int n, std::vector<Slot*>* out) {
  out->clear();
  for (int i = 0; i < n; ++i) {
    if (free_.empty()) {
      out->push_back(new Slot());
    } else {
      out->push_back(free_.back());
      free_.pop_back();
    }
  }
}

void SlotPool::TakeSpare(size_t keep, std::vector<Slot*>* spare) {
  spare->clear();
  if (free_.size() <= keep) return;
  spare->assign(free_.begin() + static_cast<std::ptrdiff_t>(keep), free_.end());
  free_.resize(keep);
}

}  // namespace latentd::server::decode
