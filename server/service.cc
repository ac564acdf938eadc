// latentd.v1.DecodeService on gRPC's callback API: the service's wiring. Each Decode
// stream owns a reactor with its own lock that ties the units of server/decode/
// together: steps are read off the wire (proto/wire.h), validated (step_validation.h),
// charged (admission.h) and handed to Engine::SubmitBatch a message at a time
// (message_groups.h), and results are coalesced into one outstanding write at a time
// as StepDone callbacks arrive (response_layout.h), under the lifetime and start rules
// of stream_lifetime.h. The same-host data plane is server/dataplane/.
#include "server/service.h"

#include <malloc.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/slice.h"
#include "kernels/params.h"
#include "server/auth.h"
#include "server/dataplane/cuda_region.h"
#include "server/dataplane/doorbell_ring.h"
#include "server/dataplane/region_layout.h"
#include "server/dataplane/shared_region.h"
#include "server/decode/admission.h"
#include "server/decode/message_groups.h"
#include "server/decode/response_layout.h"
#include "server/decode/step_shape.h"
#include "server/decode/step_slot.h"
#include "server/decode/step_validation.h"
#include "server/decode/stream_lifetime.h"
#include "proto/ring.h"
#include "proto/wire.h"
#include "spdlog/spdlog.h"

namespace latentd::server {
namespace {

using grpc::CallbackServerContext;
using grpc::ServerUnaryReactor;

using decode::CheckIdField;
using decode::CheckLayer;
using decode::Group;
using decode::Slot;

grpc::Status Unavailable() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "server is shutting down; retry on another replica");
}

// Wraps an engine/validation error with the RPC's context.
grpc::Status Prefixed(const absl::Status& s, absl::string_view prefix) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), absl::StrCat(prefix, s.message()));
}

v1::DType ToProto(kernels::DType d) { return d == kernels::DType::kFP16 ? v1::FP16 : v1::BF16; }

}  // namespace

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

// ---------------------------------------------------------------------------------
// Decode: one reactor per stream.
//
// The lifetime and start rules are decode::RefCount / StartGate (server/decode/
// stream_lifetime.h): every entry point below holds a ScopedRef, and every Start* and
// Finish is decided under mu_ through the gate. The message rule is
// decode::MessageGroups.

class DecodeReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                            public engine::StepCallback {
 public:
  DecodeReactor(DecodeServiceImpl* service, CallbackServerContext* ctx, grpc::Status initial, uint64_t flow)
      : hold_(service), service_(service), ctx_(ctx), flow_(flow), pin_inputs_(service->options().pinned_step_inputs != ServiceOptions::PinnedInputs::kOff),
        pin_always_(service->options().pinned_step_inputs == ServiceOptions::PinnedInputs::kAlways) {
    if (!initial.ok()) {
      absl::MutexLock l(&mu_);
      gate_.Finishing();
      Finish(std::move(initial));  // nothing can call back before the constructor returns
      refs_.Publish();
      return;
    }
    registered_ = true;
    service_->Register(this);
    decode::Plan p;
    {
      absl::MutexLock l(&mu_);
      draining_ = service_->draining();
      p = PlanLocked();
    }
    decode::Act(this, p);
    refs_.Publish();
  }

  void OnReadDone(bool ok) override {
    decode::ScopedRef<DecodeReactor> ref(this);
    decode::Plan p;
    bool process = false;
    {
      absl::MutexLock l(&mu_);
      reading_ = false;
      if (!ok) reads_done_ = true;
      // Steps in a read that completes after Finish (or after the client went away, or
      // once draining began) are never accepted; the stream's status says so.
      if (ok && !gate_.finished() && !GoneLocked() && !draining_ && fatal_.ok()) {
        processing_ = true;  // no Finish until every step of this read is accounted for
        process = true;
      } else {
        p = PlanLocked();
      }
    }
    if (process) {
      Process();
      read_buf_.Clear();  // the message's bytes are not kept while the stream waits
      absl::MutexLock l(&mu_);
      processing_ = false;
      p = PlanLocked();
    }
    decode::Act(this, p);
  }

  void OnWriteDone(bool ok) override {
    decode::ScopedRef<DecodeReactor> ref(this);
    decode::Plan p;
    {
      absl::MutexLock l(&mu_);
      writing_ = false;
      (ok ? service_->results_delivered_ : service_->results_undelivered_)
          .fetch_add(write_results_, std::memory_order_relaxed);
      write_results_ = 0;
      write_buf_.Clear();
      if (!ok) write_failed_ = true;  // the client is gone; later results are dropped
      p = PlanLocked();
    }
    decode::Act(this, p);
  }

  void OnCancel() override {
    decode::ScopedRef<DecodeReactor> ref(this);
    cancelled_.store(true, std::memory_order_release);
    decode::Plan p;
    {
      absl::MutexLock l(&mu_);
      p = PlanLocked();
    }
    decode::Act(this, p);
  }

  void OnDone() override {
    // Leave the registry while gRPC's reference still keeps this alive (lifetime rule).
    if (registered_) service_->Unregister(this);
    service_->CloseCall();
    Unref();
  }

  // Engine thread. Must not block: a short critical section, then maybe a write start.
  void StepDone(engine::DecodeStep* step, absl::Status status) override { StepsDone(&step, &status, 1); }

  // A batch's steps of this stream, finished together: one pass under mu_ for all.
  void StepsDone(engine::DecodeStep* const* steps, const absl::Status* statuses, int n) override {
    decode::ScopedRef<DecodeReactor> ref(this);  // an accepted step keeps Finish, so gRPC's reference, away
    for (int i = 0; i < n; ++i)
      if (!statuses[i].ok()) decode::SetError(static_cast<Slot*>(steps[i]), statuses[i]);
    bool submit = false;
    {
      absl::MutexLock l(&mu_);
      for (int i = 0; i < n; ++i) {
        --inflight_;
        AnsweredLocked(static_cast<Slot*>(steps[i]));
      }
      submit = ClaimSubmitLocked();
    }
    if (submit) SubmitDeferred();
    PlanAndAct();
  }

  // Lifetime rule (stream_lifetime.h).
  void Ref() { refs_.Ref(); }
  void Unref() {
    if (refs_.Unref()) delete this;
  }

  // decode::Act's entry points: the Start* and Finish calls a plan decided, and the
  // next plan once they are out.
  void IssueWrite() { StartWrite(&write_buf_); }
  void IssueRead() { StartRead(&read_buf_); }
  void IssueFinish(const grpc::Status& status) { Finish(status); }
  decode::Plan Replan() {
    absl::MutexLock l(&mu_);
    gate_.Started();
    return PlanLocked();
  }

  // The caller holds a reference (the registry visit).
  void BeginDrain() {
    decode::Plan p;
    {
      absl::MutexLock l(&mu_);
      draining_ = true;
      p = PlanLocked();
    }
    decode::Act(this, p);
  }

  // Cancels the stream if a response write has been pending since before `cutoff`, or
  // its ring's completions have waited since then with the client consuming none: the
  // client stopped reading, and flow control would hold this stream (its slots and
  // results) until the client's deadline, or for ever without one. Returns true if so.
  // The caller holds a reference.
  bool CancelIfStalled(absl::Time cutoff) {
    {
      absl::MutexLock l(&mu_);
      if (gate_.finished() || cancelling_) return false;
      const bool write_stalled = decode::Stalled(writing_, write_started_, cutoff);
      // ring_ is set before ring_running_ (under mu_), and fixed from then on.
      const bool ring_stalled =
          ring_running_ &&
          ring_watch_.Observe(ring_->header()->cq_head.load(std::memory_order_acquire), cq_tail_, absl::Now()) < cutoff;
      if (!write_stalled && !ring_stalled) return false;
      // No Finish until TryCancel has returned: the context lives until OnDone, which
      // only follows Finish. mu_ is not held across TryCancel, whose reactions (OnCancel,
      // OnWriteDone) may run inline on this thread.
      cancelling_ = true;
    }
    ctx_->TryCancel();
    decode::Plan p;
    {
      absl::MutexLock l(&mu_);
      cancelling_ = false;
      p = PlanLocked();
    }
    decode::Act(this, p);
    return true;
  }

  // Frees spare slots when nothing has been in flight since the previous call, so a
  // stream's memory shrinks back after a burst. The caller holds a reference.
  int TrimIfIdle() {
    std::vector<Slot*> spare;
    {
      absl::MutexLock l(&mu_);
      const bool idle = inflight_ == 0 && held_ == 0 && done_.empty() && deferred_.empty() && !processing_;
      const bool was_idle = idle_since_trim_;
      idle_since_trim_ = idle;
      const size_t keep = static_cast<size_t>(service_->options().idle_stream_slots);
      if (!idle || !was_idle || slots_.size() <= keep) return 0;
      slots_.TakeSpare(keep, &spare);
      batch_.shrink_to_fit();
    }
    for (Slot* s : spare) DeleteSlot(s);  // outside mu_
    return static_cast<int>(spare.size());
  }

 private:
  bool GoneLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return cancelled_.load(std::memory_order_acquire) || write_failed_;
  }

  decode::Plan PlanLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    decode::Plan p;
    if (gate_.finished()) return p;
    const bool gone = GoneLocked();
    if (gone && !submitting_ && !deferred_.empty()) {
      // Never submitted: nothing to answer.
      std::deque<Slot*> never;
      never.swap(deferred_);
      for (Slot* s : never) DroppedLocked(s);
    }
    if (gone && !done_.empty()) {
      // Answers have nowhere to go; recycle them.
      service_->results_undelivered_.fetch_add(AcceptedAmong(done_.size()), std::memory_order_relaxed);
      for (Slot* s : done_) RecycleLocked(s);
      done_.clear();
    }
    if (!writing_ && !region_reply_.empty() && !gone) {
      grpc::Slice slice(region_reply_);
      write_buf_ = grpc::ByteBuffer(&slice, 1);
      std::string().swap(region_reply_);
      write_results_ = 0;
      writing_ = true;
      write_started_ = absl::Now();
      p.write = true;
    } else if (!writing_ && !done_.empty()) {
      FillResponseLocked();
      writing_ = true;
      write_started_ = absl::Now();
      p.write = true;
    }
    const int64_t open = decode::OpenSteps(inflight_, held_, done_.size(), deferred_.size());
    if (!reading_ && !processing_ && !reads_done_ && !gone && !draining_ && fatal_.ok() && deferred_.empty() &&
        open < service_->options().max_stream_inflight) {
      reading_ = true;
      p.read = true;
    }
    if (p.read || p.write) gate_.Starting();
    const bool over = gone || (reads_done_ && !reading_) || draining_ || !fatal_.ok();
    if (ring_running_) {
      // The ring's thread stops at once when the stream cannot go on, and after taking
      // what the client has published when the client has half-closed it.
      ring_->RequestStop((gone || draining_ || !fatal_.ok()) ? dataplane::DoorbellRing::kNow
                         : over                              ? dataplane::DoorbellRing::kDrained
                                                             : dataplane::DoorbellRing::kRun);
    }
    const bool idle = inflight_ == 0 && held_ == 0 && !writing_ && done_.empty() && deferred_.empty() &&
                      !submitting_ && !processing_ && (region_reply_.empty() || gone) && !ring_running_;
    if (idle && over && gate_.MayFinish() && !cancelling_) {
      gate_.Finishing();
      p.finish = true;
      if (gone) {
        p.status = grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
      } else if (!fatal_.ok()) {
        p.status = fatal_;
      } else if (draining_ && !reads_done_) {
        p.status = Unavailable();
      } else {
        p.status = grpc::Status::OK;
      }
    }
    return p;
  }

  // The response: up to --max_response_bytes of answered results (response_layout.h),
  // their slots taken back.
  void FillResponseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const size_t taken = decode::FillResponse(done_.data(), done_.size(), service_->options().max_response_bytes,
                                              absl::Now(), &parts_, &write_buf_);
    write_results_ = AcceptedAmong(taken);
    for (size_t i = 0; i < taken; ++i) RecycleLocked(done_[i]);
    done_.erase(done_.begin(), done_.begin() + taken);
  }

  size_t AcceptedAmong(size_t first_n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    size_t n = 0;
    for (size_t i = 0; i < first_n; ++i) n += done_[i]->accepted ? 1 : 0;
    return n;
  }

  void RecycleLocked(Slot* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    decode::DropPart(s);
    slots_.Put(s);
  }

  // The message's last step is answered: its results become writable together.
  void FlushLocked(Group* g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time now = absl::Now();
    if (g->ring) {
      PostLocked(g);
    }
    for (Slot* s = g->held; s != nullptr;) {
      Slot* next = s->group_next;
      s->group_next = nullptr;
      s->completed = now;
      done_.push_back(s);
      --held_;
      s = next;
    }
    g->held = nullptr;
    groups_.PopReleased();
  }

  // A result (or an error answered by the stream) for one of a message's valid steps.
  void AnsweredLocked(Slot* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++held_;
    if (groups_.Answered(s)) FlushLocked(groups_.Find(s->group));
  }

  // A valid step that will never be submitted (the client went away).
  void DroppedLocked(Slot* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Group* g = groups_.Find(s->group);
    RecycleLocked(s);
    if (--g->remaining == 0) FlushLocked(g);
  }

  void FreePinned(Slot* s) {
    if (s->pin == nullptr) return;
    if (s->pin_device != 0) service_->engine()->UnregisterHostMemory(s->pin);
    munmap(s->pin, s->pin_bytes);
    s->pin = nullptr;
    s->pin_bytes = s->pin_kv_at = 0;
    s->pin_s_q = 0;
    s->pin_device = 0;
  }

  // After a valid byte step of s_q tokens that did not fit the slot's registered inputs:
  // makes them large enough for it next time, charged like the slot's other buffers.
  // The stream stops trying once the engine does not register memory (the CPU backend,
  // unless kAlways); a refused budget only skips this growth.
  void GrowPinned(Slot* s, int64_t s_q, const decode::StepShape& sh) {
    if (!pin_inputs_ || s_q <= s->pin_s_q) return;
    const decode::PinnedSize size = decode::PinnedFor(s_q, sh);
    const size_t kv_at = size.kv_at, bytes = size.bytes;
    const int64_t old_bytes = static_cast<int64_t>(s->pin_bytes);
    const int64_t grow = static_cast<int64_t>(bytes) - old_bytes;
    if (grow > 0 && !service_->inflight_.Charge(grow)) return;
    FreePinned(s);  // its bytes stay charged until the new buffer is in place or refused
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    const uint64_t dev = m == MAP_FAILED ? 0 : service_->engine()->RegisterHostMemory(m, bytes);
    if (m == MAP_FAILED || (dev == 0 && !pin_always_)) {
      if (m != MAP_FAILED) munmap(m, bytes);
      pin_inputs_ = false;
      service_->inflight_.Release(grow + old_bytes);
      s->charged -= old_bytes;
      return;
    }
    s->pin = static_cast<char*>(m);
    s->pin_bytes = bytes;
    s->pin_kv_at = kv_at;
    s->pin_s_q = s_q;
    s->pin_device = dev;
    s->charged += grow;  // s_q only grows, so the buffer never shrinks here
  }

  // decode::ChargeSlot against --max_inflight_bytes, counting a refusal.
  absl::Status ChargeSlot(Slot* s, int64_t extra) {
    absl::Status st = decode::ChargeSlot(s, extra, &service_->inflight_);
    if (!st.ok()) service_->refused_steps_bytes_.fetch_add(1, std::memory_order_relaxed);
    return st;
  }

  // Makes a message's n read slots one group: valid ones wait to be submitted, the
  // others are answered with the rest of the group. True if the caller is to submit.
  bool QueueGroupLocked(Slot* const* slots, int n, bool ring, absl::Time parsed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Group* g = groups_.New();
    g->ring = ring;
    for (int i = 0; i < n; ++i) {
      Slot* s = slots[i];
      s->parsed = parsed;
      s->group = g->id;
      if (s->code == 0) {
        deferred_.push_back(s);
        ++g->remaining;
      } else {
        decode::MessageGroups::Hold(g, s);  // answered at once, delivered with the rest
        ++held_;
      }
    }
    if (g->remaining == 0) FlushLocked(g);
    return ClaimSubmitLocked();
  }

  void DeleteSlot(Slot* s) {
    decode::DropPart(s);
    FreePinned(s);  // its bytes are part of s->charged, released below
    decode::ReleaseSlot(s, &service_->inflight_);
    delete s;
  }

  void SetFatal(grpc::StatusCode code, absl::string_view message) {
    service_->refused_messages_.fetch_add(1, std::memory_order_relaxed);
    absl::MutexLock l(&mu_);
    fatal_ = grpc::Status(code, std::string(message));
  }

  // Reads one DecodeRequest: counts its steps first (nothing is copied for a message
  // over max_steps_per_message), then reads each step into a slot. A step that fails
  // validation is answered at once; valid ones queue in deferred_, from which at most
  // max_stream_inflight are in the engine at a time.
  void Process() {
    const absl::Time received = absl::Now();
    const ServiceOptions& o = service_->options();
    const decode::StepShape& sh = service_->shape();
    int count = 0;
    {
      grpc::ProtoBufferReader reader(&read_buf_);
      uint64_t open_region = 0, ring_entries = 0;
      auto n = wire::CountDecodeSteps(&reader, o.max_steps_per_message, &open_region, &cuda_region_, &ring_entries);
      if (!n.ok()) return SetFatal(grpc::StatusCode::INVALID_ARGUMENT, n.status().message());
      if (*n > o.max_steps_per_message) {
        return SetFatal(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("DecodeRequest.steps: more than ", o.max_steps_per_message,
                                     " steps in one message (--max_steps_per_message); send fewer per message"));
      }
      count = *n;
      if (absl::Status st = decode::CheckOpenFields({open_region, cuda_region_.present, ring_entries}); !st.ok()) {
        return SetFatal(grpc::StatusCode::INVALID_ARGUMENT, st.message());
      }
      if (ring_entries > 0) {
        if (region_ == nullptr) {
          ring_peer_ = ctx_->peer();
          if (absl::Status charged = service_->ChargeRing(ring_peer_); !charged.ok()) {
            return SetFatal(grpc::StatusCode::RESOURCE_EXHAUSTED, charged.message());
          }
        }
      }
      if (open_region > 0 || cuda_region_.present) {
        const bool fresh = region_ == nullptr;
        grpc::Status st = cuda_region_.present ? OpenCudaRegion(cuda_region_, fresh ? ring_entries : 0)
                                               : OpenRegion(open_region);
        if (ring_entries > 0 && fresh) {
          if (st.ok()) {
            StartRing(static_cast<uint32_t>(ring_entries));
          } else {
            service_->ReleaseRing(ring_peer_);
          }
        }
        if (!st.ok()) return SetFatal(st.error_code(), st.error_message());
      }
    }
    {
      absl::MutexLock l(&mu_);
      slots_.Take(count, &batch_);
    }
    wire::StepBounds bounds;
    bounds.max_q_bytes = sh.max_s_q * sh.q_row_bytes;
    bounds.max_kv_bytes = sh.max_s_q * sh.kv_row_bytes;
    grpc::ProtoBufferReader reader(&read_buf_);
    wire::DecodeStepReader steps(&reader);
    int read = 0;
    for (; read < count; ++read) {
      Slot* slot = batch_[read];
      wire::StepFields f;
      f.sequence_id = &slot->sequence_id;
      f.q = &slot->q_buf;
      f.kv = &slot->kv_buf;
      if (slot->pin != nullptr) {
        f.q_dst = slot->pin;
        f.q_cap = slot->pin_s_q * sh.q_row_bytes;
        f.kv_dst = slot->pin + slot->pin_kv_at;
        f.kv_cap = slot->pin_s_q * sh.kv_row_bytes;
      }
      auto more = steps.Next(bounds, &f);
      if (!more.ok() || !*more) {  // the count pass read the same bytes; defensive only
        SetFatal(grpc::StatusCode::INVALID_ARGUMENT, more.ok() ? "DecodeRequest: fewer steps than counted"
                                                               : more.status().message());
        break;
      }
      decode::ResetSlot(slot, f.request_id, f.trace, received);
      absl::Status st = f.has_region ? decode::ValidateRegionStep(f, read, sh, Region())
                                     : decode::ValidateByteStep(f, read, sh);
      int64_t extra = 0;  // the results' buffers, sized in Prepare
      if (st.ok() && !f.has_region) extra = decode::ResultCharge(f.q_bytes / sh.q_row_bytes, slot->lse_buf.capacity(), sh);
      if (absl::Status charged = ChargeSlot(slot, extra); !charged.ok()) st = charged;
      if (st.ok()) Prepare(slot, f, sh);
      if (st.ok() && !f.has_region && !(f.q_raw && f.kv_raw)) GrowPinned(slot, slot->s_q, sh);
      slot->code = static_cast<int32_t>(st.code());
      if (!st.ok()) decode::SetError(slot, st);
    }
    // Buffers of about one response each (--max_response_bytes).
    decode::LayOut(batch_.data(), read, sh,
                   static_cast<size_t>(std::max<int64_t>(1, service_->options().max_response_bytes)));
    const absl::Time parsed = absl::Now();
    bool submit = false;
    {
      absl::MutexLock l(&mu_);
      for (int i = read; i < count; ++i) slots_.Put(batch_[i]);  // never filled
      submit = QueueGroupLocked(batch_.data(), read, false, parsed);
    }
    if (submit) SubmitDeferred();
  }

  // The stream's region as its steps are checked against (step_validation.h).
  decode::RegionExtent Region() const { return {region_ != nullptr, region_bytes_, ring_bytes_}; }

  // Fills the engine's fields of a valid, charged step.
  void Prepare(Slot* slot, const wire::StepFields& f, const decode::StepShape& sh) {
    const int s_q = f.has_region ? static_cast<int>(f.region_s_q) : static_cast<int>(f.q_bytes / sh.q_row_bytes);
    slot->layer = f.layer;
    slot->s_q = s_q;
    slot->causal = f.causal;
    slot->flow = flow_;
    slot->in_region = f.has_region;
    using engine::TensorLocation;
    if (f.has_region) {  // bounds and alignment checked in ValidateRegionStep
      // A CUDA region is device memory; a shared region the engine registered is read
      // and written by the device in place; else its tensors are staged host bytes.
      const engine::MemoryRegion r{region_, region_device_, region_bytes_};
      auto at = [&](uint64_t offset, int64_t row_bytes) {
        const size_t bytes = static_cast<size_t>(s_q * row_bytes);
        if (region_is_cuda_) return TensorLocation::InDeviceRegion(r, offset, bytes);
        if (region_device_ != 0) return TensorLocation::InHostRegion(r, offset, bytes);
        return TensorLocation::Host(region_ + offset, bytes);
      };
      slot->q = at(f.q_offset, sh.q_row_bytes);
      slot->kv = at(f.kv_offset, sh.kv_row_bytes);
      slot->out = at(f.out_offset, sh.out_row_bytes);
      slot->lse = at(f.lse_offset, sh.lse_row_bytes);
    } else if (f.q_raw && f.kv_raw && slot->pin_device != 0) {
      // Both in the registered buffer: the device reads them there (no staging copy).
      const engine::MemoryRegion pin{slot->pin, slot->pin_device, slot->pin_bytes};
      slot->q = TensorLocation::InHostRegion(pin, 0, static_cast<size_t>(f.q_bytes));
      slot->kv = TensorLocation::InHostRegion(pin, slot->pin_kv_at, static_cast<size_t>(f.kv_bytes));
    } else {
      slot->q = f.q_raw ? TensorLocation::Host(slot->pin, static_cast<size_t>(f.q_bytes))
                        : TensorLocation::Host(slot->q_buf.data(), slot->q_buf.size());
      slot->kv = f.kv_raw ? TensorLocation::Host(slot->pin + slot->pin_kv_at, static_cast<size_t>(f.kv_bytes))
                          : TensorLocation::Host(slot->kv_buf.data(), slot->kv_buf.size());
    }
    if (!f.has_region) {
      if (f.q_raw && f.kv_raw) service_->steps_inputs_pinned_.fetch_add(1, std::memory_order_relaxed);
      slot->lse_buf.resize(static_cast<size_t>(s_q * sh.lse_row_bytes));
      slot->out = TensorLocation();  // set by LayOut
      slot->lse = TensorLocation::Host(&slot->lse_buf[0], slot->lse_buf.size());
    }
    if (engine::InputsDeviceDirect(*slot))
      service_->steps_inputs_device_direct_.fetch_add(1, std::memory_order_relaxed);
    slot->deadline =
        f.timeout_ms > 0 ? absl::Now() + absl::Milliseconds(f.timeout_ms) : absl::InfiniteFuture();
    slot->cancelled = &cancelled_;
    slot->callback = this;
    slot->engine_private = nullptr;
  }

  // One thread at a time submits deferred steps, in order (steps of one sequence and
  // layer must reach the engine in the order sent). True if the caller is that thread.
  bool ClaimSubmitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (submitting_ || deferred_.empty() || inflight_ >= service_->options().max_stream_inflight) return false;
    submitting_ = true;
    return true;
  }

  // Hands deferred steps to the engine while the stream has room; refused ones are
  // answered with the engine's error. Never blocks (Engine::Submit does not).
  // Each round takes every deferred step the stream has room for (a whole message,
  // normally) and submits them in one Engine::SubmitBatch.
  void SubmitDeferred() {
    const int64_t limit = service_->options().max_stream_inflight;
    for (;;) {
      {
        absl::MutexLock l(&mu_);
        if (deferred_.empty() || inflight_ >= limit || GoneLocked()) {
          submitting_ = false;
          return;
        }
        submit_.clear();
        while (!deferred_.empty() && inflight_ < limit) {
          Slot* s = deferred_.front();
          deferred_.pop_front();
          ++inflight_;  // before SubmitBatch: StepDone may run before it returns
          s->accepted = true;
          submit_.push_back(s);
        }
      }
      const int n = static_cast<int>(submit_.size());
      if (static_cast<int>(statuses_.size()) < n) statuses_.resize(static_cast<size_t>(n));
      const absl::Time now = absl::Now();
      for (engine::DecodeStep* s : submit_) static_cast<Slot*>(s)->submitted = now;
      service_->engine()->SubmitBatch(submit_.data(), n, statuses_.data());
      for (int i = 0; i < n; ++i) {
        if (statuses_[i].ok()) continue;
        Slot* s = static_cast<Slot*>(submit_[i]);
        s->accepted = false;
        decode::SetError(s, statuses_[i]);
        absl::MutexLock l(&mu_);
        --inflight_;
        AnsweredLocked(s);
      }
    }
  }

  // Same-host data plane: a sealed memory file of `bytes` bytes (dataplane::SharedFile),
  // mapped here for the stream's life. Read side only.
  grpc::Status OpenRegion(uint64_t bytes) {
    const ServiceOptions& o = service_->options();
    if (region_ != nullptr) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "DecodeRequest.open_region_bytes: this stream already has a shared region; open one per stream");
    }
    if (bytes > static_cast<uint64_t>(o.max_region_bytes)) {
      service_->refused_regions_.fetch_add(1, std::memory_order_relaxed);
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("DecodeRequest.open_region_bytes: ", bytes, " bytes is over --max_region_bytes=",
                                       o.max_region_bytes));
    }
    if (!service_->ChargeRegion(static_cast<int64_t>(bytes))) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("DecodeRequest.open_region_bytes: shared regions of all streams are at "
                                       "--max_region_total_bytes=",
                                       o.max_region_total_bytes, "; retry later or ask for less"));
    }
    absl::StatusOr<dataplane::SharedFile> file = dataplane::SharedFile::Make("latentd-region", bytes);
    if (!file.ok()) {
      service_->ReleaseRegion(static_cast<int64_t>(bytes));
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("DecodeRequest.open_region_bytes: cannot make a shared region of ", bytes,
                                       " bytes: ", file.status().message()));
    }
    region_file_ = *std::move(file);
    region_ = region_file_.data();
    region_bytes_ = bytes;
    // Pinned and mapped for the device where the backend can (CUDA): its steps then
    // travel between the region and the GPU with no staging copy. Costs about a touch
    // of every page, once per stream; 0 (staged copies) where not.
    region_device_ = service_->engine()->RegisterHostMemory(region_, bytes);
    std::string path, ticket;
    if (absl::Status st = HandOver(&region_file_, &path, &ticket); !st.ok()) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("DecodeRequest.open_region_bytes: cannot hand the region over: ", st.message()));
    }
    absl::MutexLock l(&mu_);
    region_reply_ = wire::EncodeRegionResponse(path, bytes, 0, HandoffSocket(ticket), ticket);
    return grpc::Status::OK;
  }

  // How the client gets `file`: with the handoff (ServiceOptions::handoff) a one-time
  // ticket that only this stream's client sees, after which the daemon keeps no
  // descriptor of the file; without, its /proc path. Fills *path or *ticket.
  absl::Status HandOver(dataplane::SharedFile* file, std::string* path, std::string* ticket) {
    dataplane::FdHandoff* handoff = service_->options().handoff;
    if (handoff == nullptr) {
      *path = file->ProcPath();
      return absl::OkStatus();
    }
    absl::StatusOr<std::string> t = handoff->Offer(file->fd());
    if (!t.ok()) return t.status();
    file->CloseFd();
    *ticket = *std::move(t);
    tickets_.push_back(*ticket);
    return absl::OkStatus();
  }
  std::string HandoffSocket(const std::string& ticket) const {
    return ticket.empty() ? std::string() : service_->options().handoff->name();
  }

  // Same-host data plane on the GPU: the client's device allocation, opened through
  // CUDA IPC for the stream's life (dataplane::CudaRegion). Read side only.
  grpc::Status OpenCudaRegion(const wire::CudaRegionFields& req, uint64_t ring_entries) {
    const ServiceOptions& o = service_->options();
    if (region_ != nullptr) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "DecodeRequest.open_cuda_region: this stream already has a region; open one per stream");
    }
    if (absl::Status st = dataplane::CudaRegion::CheckRequest(req, o.max_region_bytes); !st.ok()) {
      if (st.code() == absl::StatusCode::kResourceExhausted)
        service_->refused_regions_.fetch_add(1, std::memory_order_relaxed);
      return ToGrpc(st);
    }
    if (!service_->ChargeRegion(static_cast<int64_t>(req.bytes))) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("DecodeRequest.open_cuda_region: regions of all streams are at "
                                       "--max_region_total_bytes=",
                                       o.max_region_total_bytes, "; retry later or ask for less"));
    }
    absl::StatusOr<dataplane::CudaRegion> opened = dataplane::CudaRegion::Open(service_->engine(), req);
    if (!opened.ok()) {
      service_->ReleaseRegion(static_cast<int64_t>(req.bytes));
      return ToGrpc(opened.status());
    }
    cuda_region_mem_ = *std::move(opened);
    region_ = cuda_region_mem_.host();
    region_bytes_ = req.bytes;
    region_device_ = cuda_region_mem_.device();
    region_is_cuda_ = true;
    std::string ring_path, ticket;
    if (ring_entries > 0) {
      absl::Status made = OpenRingFile(ring::RingBytes(static_cast<uint32_t>(ring_entries)), &ring_path, &ticket);
      if (!made.ok()) return ToGrpc(made);
    }
    absl::MutexLock l(&mu_);
    region_reply_ =
        wire::EncodeRegionResponse(ring_path, req.bytes, ring_file_.bytes(), HandoffSocket(ticket), ticket);
    return grpc::Status::OK;
  }

  // A CUDA region's doorbell ring: host memory the device region cannot hold, as a
  // sealed memory file of its own (dataplane::SharedFile) charged to the regions' total.
  // The region is already set: the destructor frees both. Read side only.
  absl::Status OpenRingFile(uint64_t bytes, std::string* path, std::string* ticket) {
    const ServiceOptions& o = service_->options();
    if (!service_->ChargeRegion(static_cast<int64_t>(bytes))) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "DecodeRequest.region_ring_entries: the ring's ", bytes, " bytes of host memory would put regions of all "
          "streams over --max_region_total_bytes=", o.max_region_total_bytes, "; retry later or ask for fewer entries"));
    }
    absl::StatusOr<dataplane::SharedFile> file = dataplane::SharedFile::Make("latentd-ring", bytes);
    if (!file.ok()) {
      service_->ReleaseRegion(static_cast<int64_t>(bytes));
      return absl::ResourceExhaustedError(absl::StrCat("DecodeRequest.region_ring_entries: cannot make a ring of ",
                                                       bytes, " bytes: ", file.status().message()));
    }
    ring_file_ = *std::move(file);
    if (absl::Status st = HandOver(&ring_file_, path, ticket); !st.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("DecodeRequest.region_ring_entries: cannot hand the ring over: ", st.message()));
    }
    return absl::OkStatus();
  }

  // Doorbell ring (dataplane::DoorbellRing). Called on the read side right after the
  // region was opened, before its answer is written: the ring's thread holds a reference
  // (lifetime rule) until it has stopped, and the stream does not finish while it runs.
  void StartRing(uint32_t entries) {
    // In a file of its own beside a CUDA region; else at the start of the shared region,
    // whose tensors then lie after it.
    char* base = ring_file_.empty() ? region_ : ring_file_.data();
    ring_bytes_ = ring_file_.empty() ? ring::RingBytes(entries) : 0;
    const ServiceOptions& o = service_->options();
    ring_ = std::make_unique<dataplane::DoorbellRing>(
        base, entries, dataplane::DoorbellRing::Options{absl::Microseconds(o.ring_spin_us), o.max_steps_per_message});
    {
      absl::MutexLock l(&mu_);
      ring_running_ = true;
    }
    Ref();
    std::thread([this] { RingLoop(); }).detach();
  }

  // What the ring's thread asks of this stream (dataplane::DoorbellRing::Stream): room
  // under max_stream_inflight, the steps it takes (TakeRing), and the end of the stream
  // when the client breaks the ring's contract.
  class RingFeed final : public dataplane::DoorbellRing::Stream {
   public:
    explicit RingFeed(DecodeReactor* r) : r_(r) {}
    int64_t Room() override {
      absl::MutexLock l(&r_->mu_);
      const int64_t open = decode::OpenSteps(r_->inflight_, r_->held_, r_->done_.size(), r_->deferred_.size());
      return r_->service_->options().max_stream_inflight - open;
    }
    void Take(uint32_t head, uint32_t count) override { r_->TakeRing(head, count); }
    void Fail(absl::Status status) override {
      r_->SetFatal(static_cast<grpc::StatusCode>(status.code()), status.message());
      r_->PlanAndAct();
    }

   private:
    DecodeReactor* const r_;
  };

  // The ring's thread: DoorbellRing::Run until it stops, then the stream may finish.
  void RingLoop() {
    RingFeed feed(this);
    ring_->Run(&feed);
    {
      absl::MutexLock l(&mu_);
      ring_running_ = false;
    }
    PlanAndAct();
    Unref();
  }

  void PlanAndAct() {
    decode::Plan p;
    {
      absl::MutexLock l(&mu_);
      p = PlanLocked();
    }
    decode::Act(this, p);
  }

  // Reads `take` published entries from `head` on into slots (each entry copied out of
  // the shared region once, then validated from the copy) and submits the valid ones as
  // one group, answered on the completion queue.
  void TakeRing(uint32_t head, uint32_t take) {
    const absl::Time received = absl::Now();
    const decode::StepShape& sh = service_->shape();
    {
      absl::MutexLock l(&mu_);
      slots_.Take(static_cast<int>(take), &ring_batch_);
    }
    for (uint32_t i = 0; i < take; ++i) {
      Slot* slot = ring_batch_[i];
      const ring::SqEntry e = ring_->Entry(head + i);
      wire::StepFields f;
      f.request_id = e.request_id;
      f.layer = e.layer;
      f.causal = e.causal != 0;
      f.has_region = true;
      f.region_s_q = e.s_q;
      f.q_offset = e.q_offset;
      f.kv_offset = e.kv_offset;
      f.out_offset = e.out_offset;
      f.lse_offset = e.lse_offset;
      f.sequence_id_bytes = e.sequence_id_bytes;
      f.sequence_id = &slot->sequence_id;
      slot->sequence_id.assign(e.sequence_id, std::min<uint32_t>(e.sequence_id_bytes, ring::kMaxSequenceId));
      decode::ResetSlot(slot, f.request_id, e.trace == 1, received);
      slot->complete_inline = true;  // its completion is a store into the ring (PostLocked)
      absl::Status st = decode::CheckRingFlags(head + i, e.request_id, e.causal, e.trace);
      if (st.ok()) st = decode::ValidateRegionStep(f, static_cast<int>(i), sh, Region());
      if (absl::Status charged = ChargeSlot(slot, 0); !charged.ok()) st = charged;
      if (st.ok()) Prepare(slot, f, sh);
      slot->code = static_cast<int32_t>(st.code());
      if (!st.ok()) decode::SetError(slot, st);
    }
    service_->steps_ring_.fetch_add(take, std::memory_order_relaxed);
    const absl::Time parsed = absl::Now();
    bool submit = false;
    {
      absl::MutexLock l(&mu_);
      submit = QueueGroupLocked(ring_batch_.data(), static_cast<int>(take), true, parsed);
    }
    if (submit) SubmitDeferred();
  }

  // A ring group's results: one completion entry each, published with one store of
  // cq_tail (and a futex wake if the client sleeps), and the slots taken back.
  void PostLocked(Group* g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time now = absl::Now();
    uint64_t delivered = 0;
    for (Slot* s = g->held; s != nullptr;) {
      Slot* next = s->group_next;
      s->group_next = nullptr;
      decode::FillCompletion(s, now, ring_->Completion(cq_tail_));
      ++cq_tail_;
      delivered += s->accepted ? 1 : 0;
      --held_;
      RecycleLocked(s);
      s = next;
    }
    g->held = nullptr;
    service_->results_delivered_.fetch_add(delivered, std::memory_order_relaxed);
    ring_->Publish(cq_tail_);
  }

  ~DecodeReactor() override {
    // Every slot is in slots_, done_ or deferred_ by now (nothing in flight once Finish
    // was decided).
    for (Slot* s : slots_.all()) DeleteSlot(s);
    for (Slot* s : deferred_) DeleteSlot(s);
    for (Slot* s : done_) DeleteSlot(s);
    // No step reads or writes the region any more, and the ring's thread has stopped;
    // the members below unmap them after this body.
    if (region_ != nullptr) {
      if (!region_is_cuda_ && region_device_ != 0) service_->engine()->UnregisterHostMemory(region_);
      if (ring_ != nullptr) service_->ReleaseRing(ring_peer_);
      service_->ReleaseRegion(static_cast<int64_t>(region_bytes_));
    }
    if (!ring_file_.empty()) service_->ReleaseRegion(static_cast<int64_t>(ring_file_.bytes()));
    // Offers the client never collected.
    for (const std::string& t : tickets_) service_->options().handoff->Withdraw(t);
  }

  DecodeServiceImpl::ReactorHold hold_;  // first: destroyed last
  DecodeServiceImpl* const service_;
  CallbackServerContext* const ctx_;  // gRPC's; valid until OnDone
  const uint64_t flow_;               // the engine's fairness key for this stream's steps
  bool registered_ = false;
  std::atomic<bool> cancelled_{false};
  decode::RefCount refs_;  // the lifetime rule (stream_lifetime.h)

  // The read side is touched only between StartRead and the end of OnReadDone.
  grpc::ByteBuffer read_buf_;
  std::vector<Slot*> batch_;  // slots taken for the message being read
  // The stream's region (same-host data plane): set on the read side, read by steps in
  // flight, freed by the members' destructors. region_ is region_file_'s memory, or
  // cuda_region_mem_'s host placeholder.
  dataplane::SharedFile region_file_;
  dataplane::CudaRegion cuda_region_mem_;
  char* region_ = nullptr;
  // A CUDA region's ring lives in a memory file of its own (OpenRingFile).
  dataplane::SharedFile ring_file_;
  std::vector<std::string> tickets_;  // handoff offers of region_file_ and ring_file_ (HandOver)
  // Its doorbell ring (DecodeRequest.region_ring_entries): set on the read side before
  // the ring's thread starts, then fixed.
  std::unique_ptr<dataplane::DoorbellRing> ring_;
  uint64_t ring_bytes_ = 0;  // tensors lie after these first bytes of the region (0: ring in its own file)
  std::string ring_peer_;  // the connection its ring is counted against (ChargeRing)
  std::vector<Slot*> ring_batch_;  // the ring thread's slots for the batch it takes
  uint64_t region_device_ = 0;  // the device's address of region_, 0: not registered
  // Read side only: whether byte steps' inputs go into registered slot memory
  // (--pinned_step_inputs, until the engine first refuses to register some).
  bool pin_inputs_ = true;
  const bool pin_always_;  // kAlways: keep the buffers unregistered where registering fails
  uint64_t region_bytes_ = 0;
  bool region_is_cuda_ = false;  // open_cuda_region: region_ is cuda_region_mem_'s placeholder
  wire::CudaRegionFields cuda_region_;  // parse buffer of the read side
  // The submitting thread's (submitting_): one SubmitBatch's steps and answers.
  std::vector<engine::DecodeStep*> submit_;
  std::vector<absl::Status> statuses_;
  std::vector<grpc::Slice> parts_;  // FillResponseLocked's scratch (under mu_)

  absl::Mutex mu_;
  decode::SlotPool slots_ ABSL_GUARDED_BY(mu_);  // owned; spare slots
  std::vector<Slot*> done_ ABSL_GUARDED_BY(mu_);  // owned; answered, waiting for a write
  std::deque<Slot*> deferred_ ABSL_GUARDED_BY(mu_);  // owned; valid, not yet given to the engine
  bool submitting_ ABSL_GUARDED_BY(mu_) = false;     // a thread is in SubmitDeferred
  decode::MessageGroups groups_ ABSL_GUARDED_BY(mu_);  // messages not yet flushed
  int64_t held_ ABSL_GUARDED_BY(mu_) = 0;  // answered, waiting for the rest of their message
  // The one outstanding write; filled under mu_, read by gRPC until OnWriteDone.
  grpc::ByteBuffer write_buf_;
  size_t write_results_ ABSL_GUARDED_BY(mu_) = 0;
  std::string region_reply_ ABSL_GUARDED_BY(mu_);  // the region's answer, written first
  int64_t inflight_ ABSL_GUARDED_BY(mu_) = 0;  // accepted by the engine, not yet done
  decode::StartGate gate_ ABSL_GUARDED_BY(mu_);  // the start rule (stream_lifetime.h)
  grpc::Status fatal_ ABSL_GUARDED_BY(mu_);    // a message the stream cannot go on after
  bool ring_running_ ABSL_GUARDED_BY(mu_) = false;  // the ring's thread has not stopped
  uint32_t cq_tail_ ABSL_GUARDED_BY(mu_) = 0;        // completions posted to the ring
  dataplane::CompletionWatch ring_watch_ ABSL_GUARDED_BY(mu_);  // the stall rule's view of them
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool processing_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time write_started_ ABSL_GUARDED_BY(mu_);  // of the outstanding write
  bool cancelling_ ABSL_GUARDED_BY(mu_) = false;   // CancelIfStalled is in TryCancel
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool idle_since_trim_ ABSL_GUARDED_BY(mu_) = false;
};

// ---------------------------------------------------------------------------------
// AppendKv: a client stream of row chunks for one sequence, each applied on arrival.
// Its lifetime is simpler: gRPC deletes it through OnDone, which follows Finish, and no
// thread touches it after its own Finish or StartRead call; between a read completing
// and the upload thread applying it, no operation is outstanding.

class AppendKvReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  AppendKvReactor(DecodeServiceImpl* service, grpc::ByteBuffer* response, grpc::Status initial)
      : hold_(service), service_(service), response_(response) {
    if (!initial.ok()) {
      Finish(std::move(initial));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (messages_ == 0) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "AppendKv: the stream had no messages; expected at least one naming sequence_id"));
        return;
      }
      if (lengths_.empty()) {
        // No message carried rows: the lengths (and the sequence's existence) come from
        // the engine, so the response says what the API promises (a short KV-lock read).
        auto info = service_->engine()->GetSequence(sequence_id_);
        if (!info.ok()) {
          Finish(Prefixed(info.status(), "AppendKv: "));
          return;
        }
        lengths_ = std::move(info->lengths);
      }
      v1::AppendKvResponse r;
      r.set_sequence_id(sequence_id_);
      r.set_tokens_appended(rows_);
      for (int64_t len : lengths_) r.add_lengths(len);
      bool own = false;
      grpc::Status st = grpc::SerializationTraits<v1::AppendKvResponse>::Serialize(r, response_, &own);
      Finish(st);
      return;
    }
    charged_ = static_cast<int64_t>(request_.Length());
    if (!service_->EnqueueUpload(this, charged_)) {
      Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("AppendKv message ", messages_, ": the server already holds ",
                                       service_->options().max_upload_bytes,
                                       " bytes of uploads not yet applied (--max_upload_bytes); ", rows_,
                                       " rows of this stream were appended; retry the rest later")));
    }
    // Otherwise ApplyQueued runs on the upload thread; no read is outstanding meanwhile.
  }

  void OnDone() override {
    service_->CloseCall();
    delete this;
  }

  // The upload thread: applies the message just read, then reads the next or finishes.
  void ApplyQueued() {
    grpc::Status st = Apply();
    request_.Clear();
    service_->upload_bytes_.fetch_sub(charged_, std::memory_order_relaxed);
    charged_ = 0;
    if (!st.ok()) {
      Finish(st);
      return;
    }
    StartRead(&request_);
  }

 private:
  grpc::Status Apply() {
    const DecodeServiceImpl::Shape& sh = service_->shape();
    const std::string where = absl::StrCat("AppendKv message ", messages_, ": ");
    ++messages_;
    if (service_->draining()) return Unavailable();
    wire::AppendFields f;
    f.sequence_id = &id_buf_;
    f.kv = &kv_buf_;
    {
      grpc::ProtoBufferReader reader(&request_);
      absl::Status st = wire::ReadAppendKvRequest(&reader, 128, &f);
      if (!st.ok()) return Prefixed(st, where);
    }
    // Every message's id is checked; a client's bytes are never echoed back.
    absl::Status st;
    if (f.sequence_id_bytes > 128) {
      st = absl::InvalidArgumentError(absl::StrCat("sequence_id: malformed id (", f.sequence_id_bytes,
                                                   " bytes); expected 1 to 128 characters from [A-Za-z0-9._:-]"));
    } else {
      st = CheckIdField("sequence_id", id_buf_, /*allow_empty=*/messages_ > 1);
    }
    if (!st.ok()) return Prefixed(st, where);
    if (messages_ == 1) {
      sequence_id_ = id_buf_;
    } else if (!id_buf_.empty() && id_buf_ != sequence_id_) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat(where, "sequence_id: differs from the stream's first message; expected "
                                              "one sequence per AppendKv stream (empty or the same id)"));
    }
    st = CheckLayer("layer", f.layer, sh.num_layers);
    if (!st.ok()) return Prefixed(st, where);
    const int64_t kb = static_cast<int64_t>(kv_buf_.size());
    if (kb % sh.kv_row_bytes != 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat(where, "kv: ", kb, " bytes; expected a multiple of h_kv * 576 * 2 = ",
                                       sh.kv_row_bytes, " bytes ([n, ", sh.h_kv, ", 576] in the server dtype)"));
    }
    if (kb == 0) return grpc::Status::OK;  // nothing to append (e.g. a message naming the id only)
    // The engine copies the rows into its pool in bounded chunks under its KV lock.
    auto lengths = service_->engine()->AppendKv(sequence_id_, f.layer, kv_buf_);
    if (kv_buf_.capacity() > kKeepBufferBytes) std::string().swap(kv_buf_);
    if (!lengths.ok()) {
      return Prefixed(lengths.status(), absl::StrCat(where, "(", rows_, " rows appended before it) "));
    }
    rows_ += kb / sh.kv_row_bytes;
    lengths_ = std::move(lengths->lengths);
    return grpc::Status::OK;
  }

  static constexpr size_t kKeepBufferBytes = 4 << 20;

  DecodeServiceImpl::ReactorHold hold_;  // first: destroyed last
  DecodeServiceImpl* const service_;
  grpc::ByteBuffer* const response_;
  grpc::ByteBuffer request_;
  std::string id_buf_, kv_buf_;
  std::string sequence_id_;
  std::vector<int64_t> lengths_;
  int64_t rows_ = 0;
  int64_t charged_ = 0;  // bytes of the message waiting for the upload thread
  int messages_ = 0;
};

// ---------------------------------------------------------------------------------

DecodeServiceImpl::DecodeServiceImpl(engine::Engine* engine, ServiceOptions options)
    : engine_(engine), options_(std::move(options)), inflight_(options_.max_inflight_bytes) {
  shape_ = decode::StepShape::For(engine_->Info().model, options_.max_s_q);
  uploader_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "latentd-upload");  // for top -H and debuggers
    UploadLoop();
  });
}

// The server has shut down before this runs, so no AppendKv stream is left waiting and
// every reactor has had its OnDone; one may still be finishing (an engine callback's
// reference outlives OnDone), so wait for the last.
DecodeServiceImpl::~DecodeServiceImpl() {
  {
    absl::MutexLock l(&reactors_mu_);
    const absl::Condition none(+[](int* n) { return *n == 0; }, &reactors_);
    while (!reactors_mu_.AwaitWithTimeout(none, absl::Seconds(5))) {
      spdlog::warn("waiting for {} stream(s) to finish before the service stops", reactors_);
    }
  }
  {
    absl::MutexLock l(&upload_mu_);
    stop_uploads_ = true;
  }
  uploader_.join();
}

void DecodeServiceImpl::AddReactor() {
  absl::MutexLock l(&reactors_mu_);
  ++reactors_;
}

void DecodeServiceImpl::RemoveReactor() {
  absl::MutexLock l(&reactors_mu_);
  --reactors_;
}

bool DecodeServiceImpl::EnqueueUpload(AppendKvReactor* reactor, int64_t bytes) {
  if (upload_bytes_.fetch_add(bytes, std::memory_order_relaxed) + bytes > options_.max_upload_bytes &&
      bytes > 0) {
    upload_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
    refused_uploads_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  absl::MutexLock l(&upload_mu_);
  uploads_.push_back(reactor);
  return true;
}

bool DecodeServiceImpl::OpenCall() {
  if (open_calls_.fetch_add(1, std::memory_order_relaxed) >= options_.max_streams) {
    refused_streams_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  return true;
}

bool DecodeServiceImpl::ChargeRegion(int64_t bytes) {
  if (region_bytes_.fetch_add(bytes, std::memory_order_relaxed) + bytes > options_.max_region_total_bytes) {
    region_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
    refused_regions_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  regions_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

absl::Status DecodeServiceImpl::ChargeRing(const std::string& peer) {
  if (rings_.fetch_add(1, std::memory_order_relaxed) >= options_.max_rings) {
    rings_.fetch_sub(1, std::memory_order_relaxed);
    refused_rings_.fetch_add(1, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(
        absl::StrCat("DecodeRequest.region_ring_entries: doorbell rings of all streams are at --max_rings=",
                     options_.max_rings, "; retry later, or send steps in DecodeRequest messages"));
  }
  // One connection may hold only its share, so that one client cannot take every ring
  // (as --max_streams_per_connection bounds its streams). Once per ring, never per step.
  absl::MutexLock l(&rings_mu_);
  int& mine = rings_by_peer_[peer];
  if (mine >= options_.max_rings_per_connection) {
    if (mine == 0) rings_by_peer_.erase(peer);
    rings_.fetch_sub(1, std::memory_order_relaxed);
    refused_rings_.fetch_add(1, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(absl::StrCat(
        "DecodeRequest.region_ring_entries: this connection already holds --max_rings_per_connection=",
        options_.max_rings_per_connection, " doorbell rings; close one of its ring streams, or send steps in "
        "DecodeRequest messages"));
  }
  ++mine;
  return absl::OkStatus();
}

void DecodeServiceImpl::ReleaseRing(const std::string& peer) {
  rings_.fetch_sub(1, std::memory_order_relaxed);
  absl::MutexLock l(&rings_mu_);
  auto it = rings_by_peer_.find(peer);
  if (it != rings_by_peer_.end() && --it->second <= 0) rings_by_peer_.erase(it);
}

ServiceCounters DecodeServiceImpl::Counters() const {
  ServiceCounters c;
  c.open_streams = OpenStreams();
  c.open_calls = open_calls_.load(std::memory_order_relaxed);
  c.inflight_bytes = inflight_.used();
  c.upload_bytes = upload_bytes_.load(std::memory_order_relaxed);
  c.results_delivered = results_delivered_.load(std::memory_order_relaxed);
  c.results_undelivered = results_undelivered_.load(std::memory_order_relaxed);
  c.refused_streams = refused_streams_.load(std::memory_order_relaxed);
  c.refused_steps_bytes = refused_steps_bytes_.load(std::memory_order_relaxed);
  c.refused_messages = refused_messages_.load(std::memory_order_relaxed);
  c.refused_uploads = refused_uploads_.load(std::memory_order_relaxed);
  c.region_bytes = region_bytes_.load(std::memory_order_relaxed);
  c.regions = regions_.load(std::memory_order_relaxed);
  c.refused_regions = refused_regions_.load(std::memory_order_relaxed);
  c.steps_inputs_pinned = steps_inputs_pinned_.load(std::memory_order_relaxed);
  c.steps_inputs_device_direct = steps_inputs_device_direct_.load(std::memory_order_relaxed);
  c.rings = rings_.load(std::memory_order_relaxed);
  c.refused_rings = refused_rings_.load(std::memory_order_relaxed);
  c.steps_ring = steps_ring_.load(std::memory_order_relaxed);
  return c;
}

void DecodeServiceImpl::UploadLoop() {
  for (;;) {
    AppendKvReactor* r = nullptr;
    {
      absl::MutexLock l(&upload_mu_);
      upload_mu_.Await(absl::Condition(
          +[](DecodeServiceImpl* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->upload_mu_) {
            return self->stop_uploads_ || !self->uploads_.empty();
          },
          this));
      if (uploads_.empty()) return;  // stopping, and nothing left
      r = uploads_.front();
      uploads_.pop_front();
    }
    r->ApplyQueued();
  }
}

grpc::Status DecodeServiceImpl::CheckAuth(const grpc::CallbackServerContext* ctx) const {
  if (options_.auth_token.empty()) return grpc::Status::OK;
  grpc::Status st = CheckBearer(ctx->client_metadata(), options_.auth_token);
  if (!st.ok()) RecordAuthFailure(v1::DecodeService::service_full_name(), ctx->peer(), st);
  return st;
}

ServerUnaryReactor* DecodeServiceImpl::GetInfo(CallbackServerContext* ctx, const v1::GetInfoRequest*,
                                               v1::ServerInfo* response) {
  ServerUnaryReactor* reactor = ctx->DefaultReactor();
  grpc::Status st = CheckAuth(ctx);
  if (!st.ok()) {
    reactor->Finish(st);
    return reactor;
  }
  const engine::EngineInfo info = engine_->Info();
  const engine::EngineMetrics m = engine_->Metrics();
  response->set_num_layers(info.model.num_layers);
  response->set_num_heads_q(info.model.num_heads_q);
  response->set_num_heads_kv(info.model.num_heads_kv);
  response->set_head_dim_qk(kernels::kHeadDimQK);
  response->set_head_dim_v(kernels::kHeadDimV);
  response->set_page_size(kernels::kPageSize);
  response->set_dtype(ToProto(info.model.dtype));
  // 0 asks the engine for its default, which clients need to know to check results.
  response->set_softmax_scale(info.model.softmax_scale > 0 ? info.model.softmax_scale
                                                           : 1.f / std::sqrt(static_cast<float>(kernels::kHeadDimQK)));
  response->set_total_pages(info.total_pages);
  response->set_free_pages(info.free_pages);
  response->set_max_batch_size(info.max_batch_size);
  response->set_backend(info.backend);
  response->set_version(options_.version);
  // TODO: read max_s_q from EngineInfo once the facade reports it; until then the
  // server repeats what it passed in EngineOptions.
  response->set_max_s_q(options_.max_s_q);
  response->set_max_message_bytes(options_.max_message_bytes);
  response->set_sequences(m.sequences);
  response->set_steps_per_second(m.steps_per_second);
  response->set_steps_completed(m.steps_completed);
  response->set_queued_steps(m.queued_steps);
  response->set_draining(draining());
  response->set_kv_dtype(kernels::KvDTypeName(info.kv_dtype, info.model.dtype));
  response->set_kv_bytes_per_token(info.kv_bytes_per_token);
  response->set_steps_inputs_pinned(steps_inputs_pinned_.load(std::memory_order_relaxed));
  response->set_steps_inputs_device_direct(steps_inputs_device_direct_.load(std::memory_order_relaxed));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

ServerUnaryReactor* DecodeServiceImpl::CreateSequence(CallbackServerContext* ctx,
                                                      const v1::CreateSequenceRequest* request,
                                                      v1::CreateSequenceResponse* response) {
  ServerUnaryReactor* reactor = ctx->DefaultReactor();
  grpc::Status st = CheckAuth(ctx);
  if (st.ok() && draining()) st = Unavailable();
  if (st.ok()) st = ToGrpc(CheckIdField("sequence_id", request->sequence_id(), true));
  if (st.ok()) {
    auto id = engine_->CreateSequence(request->sequence_id());
    if (id.ok()) {
      response->set_sequence_id(*id);
      spdlog::debug("created sequence {}", *id);
    } else {
      st = ToGrpc(id.status());
    }
  }
  reactor->Finish(st);
  return reactor;
}

ServerUnaryReactor* DecodeServiceImpl::ForkSequence(CallbackServerContext* ctx,
                                                    const v1::ForkSequenceRequest* request,
                                                    v1::ForkSequenceResponse* response) {
  ServerUnaryReactor* reactor = ctx->DefaultReactor();
  grpc::Status st = CheckAuth(ctx);
  if (st.ok() && draining()) st = Unavailable();
  if (st.ok()) st = ToGrpc(CheckIdField("sequence_id", request->sequence_id(), false));
  if (st.ok()) st = ToGrpc(CheckIdField("new_sequence_id", request->new_sequence_id(), true));
  if (st.ok()) {
    auto id = engine_->ForkSequence(request->sequence_id(), request->new_sequence_id());
    if (id.ok()) {
      response->set_sequence_id(*id);
    } else {
      st = ToGrpc(id.status());
    }
  }
  reactor->Finish(st);
  return reactor;
}

ServerUnaryReactor* DecodeServiceImpl::ReleaseSequence(CallbackServerContext* ctx,
                                                       const v1::ReleaseSequenceRequest* request,
                                                       v1::ReleaseSequenceResponse* response) {
  // Allowed while draining: releasing only frees memory.
  ServerUnaryReactor* reactor = ctx->DefaultReactor();
  grpc::Status st = CheckAuth(ctx);
  if (st.ok()) st = ToGrpc(CheckIdField("sequence_id", request->sequence_id(), false));
  if (st.ok()) {
    auto freed = engine_->ReleaseSequence(request->sequence_id());
    if (freed.ok()) {
      response->set_pages_freed(*freed);
    } else {
      st = ToGrpc(freed.status());
    }
  }
  reactor->Finish(st);
  return reactor;
}

ServerUnaryReactor* DecodeServiceImpl::GetSequence(CallbackServerContext* ctx,
                                                   const v1::GetSequenceRequest* request,
                                                   v1::SequenceInfo* response) {
  // Allowed while draining: a client resyncing needs it most then.
  ServerUnaryReactor* reactor = ctx->DefaultReactor();
  grpc::Status st = CheckAuth(ctx);
  if (st.ok()) st = ToGrpc(CheckIdField("sequence_id", request->sequence_id(), false));
  if (st.ok()) {
    auto info = engine_->GetSequence(request->sequence_id());
    if (info.ok()) {
      response->set_sequence_id(info->sequence_id);
      for (int64_t len : info->lengths) response->add_lengths(len);
      response->set_pages(info->pages);
      response->set_shared_pages(info->shared_pages);
    } else {
      st = ToGrpc(info.status());
    }
  }
  reactor->Finish(st);
  return reactor;
}

grpc::Status DecodeServiceImpl::AdmitStream(const CallbackServerContext* ctx) {
  const bool admitted = OpenCall();
  grpc::Status st = CheckAuth(ctx);
  if (st.ok() && draining()) st = Unavailable();
  if (st.ok() && !admitted) {
    st = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat("the server has ", options_.max_streams,
                                   " Decode and AppendKv streams open (--max_streams); close idle streams or retry "
                                   "later"));
  }
  return st;
}

grpc::ServerReadReactor<grpc::ByteBuffer>* DecodeServiceImpl::AppendKv(CallbackServerContext* ctx,
                                                                      grpc::ByteBuffer* response) {
  return new AppendKvReactor(this, response, AdmitStream(ctx));
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* DecodeServiceImpl::Decode(CallbackServerContext* ctx) {
  grpc::Status st = AdmitStream(ctx);
  const uint64_t flow = streams_opened_.fetch_add(1, std::memory_order_relaxed) + 1;
  return new DecodeReactor(this, ctx, std::move(st), flow);
}

void DecodeServiceImpl::Register(DecodeReactor* reactor) {
  absl::MutexLock l(&streams_mu_);
  streams_.insert(reactor);
}

void DecodeServiceImpl::Unregister(DecodeReactor* reactor) {
  absl::MutexLock l(&streams_mu_);
  streams_.erase(reactor);
}

int DecodeServiceImpl::OpenStreams() const {
  absl::MutexLock l(&streams_mu_);
  return static_cast<int>(streams_.size());
}

// A reactor leaves streams_ in OnDone, before gRPC's reference is dropped, so every
// reactor in the set holds at least that reference while streams_mu_ is held: taking one
// here is safe, and it keeps the reactor alive while `fn` runs unlocked.
template <typename Fn>
void DecodeServiceImpl::ForEachOpenStream(Fn fn) {
  std::vector<DecodeReactor*> open;
  {
    absl::MutexLock l(&streams_mu_);
    open.assign(streams_.begin(), streams_.end());
    for (DecodeReactor* r : open) r->Ref();
  }
  for (DecodeReactor* r : open) {
    fn(r);
    r->Unref();
  }
}

int DecodeServiceImpl::CancelStalledStreams(absl::Duration stall) {
  const absl::Time cutoff = absl::Now() - stall;
  int cancelled = 0;
  ForEachOpenStream([&](DecodeReactor* r) { cancelled += r->CancelIfStalled(cutoff) ? 1 : 0; });
  return cancelled;
}

int DecodeServiceImpl::TrimIdleStreams() {
  int freed = 0;
  ForEachOpenStream([&](DecodeReactor* r) { freed += r->TrimIfIdle(); });
  // Step buffers are below malloc's mmap threshold: without a trim the heap keeps their
  // pages resident after they are freed.
  if (freed > 0) malloc_trim(0);
  return freed;
}

void DecodeServiceImpl::BeginDrain() {
  draining_.store(true, std::memory_order_release);
  ForEachOpenStream([](DecodeReactor* r) { r->BeginDrain(); });
}

}  // namespace latentd::server
