// The Decode stream's reactor (decode_reactor.h): the read side (Process, validation,
// admission), submission to the engine, the write side (response layout) and the
// stream's shared region, CUDA region and doorbell ring.
#include "server/decode_reactor.h"

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
#include "proto/ring.h"
#include "proto/wire.h"
#include "server/rpc_status.h"
#include "spdlog/spdlog.h"

namespace latentd::server {

using grpc::CallbackServerContext;

using decode::CheckIdField;
using decode::CheckLayer;
using decode::Group;
using decode::Slot;

DecodeReactor::DecodeReactor(DecodeServiceImpl* service, CallbackServerContext* ctx, grpc::Status initial, uint64_t flow)
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

void DecodeReactor::OnReadDone(bool ok) {
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

void DecodeReactor::OnWriteDone(bool ok) {
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

void DecodeReactor::OnCancel() {
  decode::ScopedRef<DecodeReactor> ref(this);
  cancelled_.store(true, std::memory_order_release);
  decode::Plan p;
  {
    absl::MutexLock l(&mu_);
    p = PlanLocked();
  }
  decode::Act(this, p);
}

void DecodeReactor::OnDone() {
  // Leave the registry while gRPC's reference still keeps this alive (lifetime rule).
  if (registered_) service_->Unregister(this);
  service_->CloseCall();
  Unref();
}

void DecodeReactor::StepsDone(engine::DecodeStep* const* steps, const absl::Status* statuses, int n) {
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

void DecodeReactor::Unref() {
  if (refs_.Unref()) delete this;
}

decode::Plan DecodeReactor::Replan() {
  absl::MutexLock l(&mu_);
  gate_.Started();
  return PlanLocked();
}

void DecodeReactor::BeginDrain() {
  decode::Plan p;
  {
    absl::MutexLock l(&mu_);
    draining_ = true;
    p = PlanLocked();
  }
  decode::Act(this, p);
}

bool DecodeReactor::CancelIfStalled(absl::Time cutoff) {
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

int DecodeReactor::TrimIfIdle() {
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

bool DecodeReactor::GoneLocked() const {
  return cancelled_.load(std::memory_order_acquire) || write_failed_;
}

decode::Plan DecodeReactor::PlanLocked() {
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

void DecodeReactor::FillResponseLocked() {
  const size_t taken = decode::FillResponse(done_.data(), done_.size(), service_->options().max_response_bytes,
                                            absl::Now(), &parts_, &write_buf_);
  write_results_ = AcceptedAmong(taken);
  for (size_t i = 0; i < taken; ++i) RecycleLocked(done_[i]);
  done_.erase(done_.begin(), done_.begin() + taken);
}

size_t DecodeReactor::AcceptedAmong(size_t first_n) const {
  size_t n = 0;
  for (size_t i = 0; i < first_n; ++i) n += done_[i]->accepted ? 1 : 0;
  return n;
}

void DecodeReactor::RecycleLocked(Slot* s) {
  decode::DropPart(s);
  slots_.Put(s);
}

void DecodeReactor::FlushLocked(Group* g) {
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

void DecodeReactor::AnsweredLocked(Slot* s) {
  ++held_;
  if (groups_.Answered(s)) FlushLocked(groups_.Find(s->group));
}

void DecodeReactor::DroppedLocked(Slot* s) {
  Group* g = groups_.Find(s->group);
  RecycleLocked(s);
  if (--g->remaining == 0) FlushLocked(g);
}

void DecodeReactor::FreePinned(Slot* s) {
  if (s->pin == nullptr) return;
  if (s->pin_device != 0) service_->engine()->UnregisterHostMemory(s->pin);
  munmap(s->pin, s->pin_bytes);
  s->pin = nullptr;
  s->pin_bytes = s->pin_kv_at = 0;
  s->pin_s_q = 0;
  s->pin_device = 0;
}

void DecodeReactor::GrowPinned(Slot* s, int64_t s_q, const decode::StepShape& sh) {
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

absl::Status DecodeReactor::ChargeSlot(Slot* s, int64_t extra) {
  absl::Status st = decode::ChargeSlot(s, extra, &service_->inflight_);
  if (!st.ok()) service_->refused_steps_bytes_.fetch_add(1, std::memory_order_relaxed);
  return st;
}

bool DecodeReactor::QueueGroupLocked(Slot* const* slots, int n, bool ring, absl::Time parsed) {
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

void DecodeReactor::DeleteSlot(Slot* s) {
  decode::DropPart(s);
  FreePinned(s);  // its bytes are part of s->charged, released below
  decode::ReleaseSlot(s, &service_->inflight_);
  delete s;
}

void DecodeReactor::SetFatal(grpc::StatusCode code, absl::string_view message) {
  service_->refused_messages_.fetch_add(1, std::memory_order_relaxed);
  absl::MutexLock l(&mu_);
  fatal_ = grpc::Status(code, std::string(message));
}

void DecodeReactor::Process() {
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
  bounds.max_hidden_bytes = sh.max_s_q * sh.hidden_row_bytes;
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
    if (st.ok() && !f.has_region) {
      const int64_t s_q = f.has_hidden ? f.hidden_bytes / sh.hidden_row_bytes : f.q_bytes / sh.q_row_bytes;
      extra = decode::ResultCharge(s_q, slot->lse_buf.capacity(), sh, f.has_hidden);
    }
    if (absl::Status charged = ChargeSlot(slot, extra); !charged.ok()) st = charged;
    if (st.ok()) Prepare(slot, f, sh);
    // The pinned buffer is sized for q and kv; a layer step's hidden uses it when it fits.
    if (st.ok() && !f.has_region && !f.has_hidden && !(f.q_raw && f.kv_raw)) GrowPinned(slot, slot->s_q, sh);
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

void DecodeReactor::Prepare(Slot* slot, const wire::StepFields& f, const decode::StepShape& sh) {
  const bool layer_step = f.has_region ? f.region_layer_step : f.has_hidden;
  const int s_q = f.has_region ? static_cast<int>(f.region_s_q)
                  : layer_step ? static_cast<int>(f.hidden_bytes / sh.hidden_row_bytes)
                               : static_cast<int>(f.q_bytes / sh.q_row_bytes);
  slot->layer = f.layer;
  slot->s_q = s_q;
  slot->causal = f.causal;
  slot->flow = flow_;
  slot->in_region = f.has_region;
  slot->layer_step = layer_step;
  slot->position = f.has_position ? f.position : -1;
  using engine::TensorLocation;
  if (layer_step) {
    // The engine computes q and kv and owns out and lse while the step runs; the layer
    // math reads hidden and writes layer_out on the host (a CUDA region was refused).
    slot->q = slot->kv = slot->out = slot->lse = TensorLocation();
    const size_t bytes = static_cast<size_t>(s_q * sh.hidden_row_bytes);
    if (f.has_region) {
      slot->hidden = TensorLocation::Host(region_ + f.hidden_offset, bytes);
      slot->layer_out = TensorLocation::Host(region_ + f.out_offset, bytes);
    } else {
      slot->hidden = f.q_raw ? TensorLocation::Host(slot->pin, bytes) : TensorLocation::Host(slot->q_buf.data(), bytes);
      slot->lse_buf.clear();
      slot->layer_out = TensorLocation();  // set by LayOut
    }
  } else if (f.has_region) {  // bounds and alignment checked in ValidateRegionStep
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
  if (!f.has_region && !layer_step) {
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

bool DecodeReactor::ClaimSubmitLocked() {
  if (submitting_ || deferred_.empty() || inflight_ >= service_->options().max_stream_inflight) return false;
  submitting_ = true;
  return true;
}

void DecodeReactor::SubmitDeferred() {
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

grpc::Status DecodeReactor::OpenRegion(uint64_t bytes) {
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

absl::Status DecodeReactor::HandOver(dataplane::SharedFile* file, std::string* path, std::string* ticket) {
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

std::string DecodeReactor::HandoffSocket(const std::string& ticket) const {
  return ticket.empty() ? std::string() : service_->options().handoff->name();
}

grpc::Status DecodeReactor::OpenCudaRegion(const wire::CudaRegionFields& req, uint64_t ring_entries) {
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

absl::Status DecodeReactor::OpenRingFile(uint64_t bytes, std::string* path, std::string* ticket) {
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

void DecodeReactor::StartRing(uint32_t entries) {
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

void DecodeReactor::RingLoop() {
  RingFeed feed(this);
  ring_->Run(&feed);
  {
    absl::MutexLock l(&mu_);
    ring_running_ = false;
  }
  PlanAndAct();
  Unref();
}

void DecodeReactor::PlanAndAct() {
  decode::Plan p;
  {
    absl::MutexLock l(&mu_);
    p = PlanLocked();
  }
  decode::Act(this, p);
}

void DecodeReactor::TakeRing(uint32_t head, uint32_t take) {
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
    f.region_layer_step = e.layer_step == 1;
    f.hidden_offset = e.hidden_offset;
    f.has_position = e.has_position == 1;
    f.position = e.position;
    f.sequence_id_bytes = e.sequence_id_bytes;
    f.sequence_id = &slot->sequence_id;
    slot->sequence_id.assign(e.sequence_id, std::min<uint32_t>(e.sequence_id_bytes, ring::kMaxSequenceId));
    decode::ResetSlot(slot, f.request_id, e.trace == 1, received);
    slot->complete_inline = true;  // its completion is a store into the ring (PostLocked)
    absl::Status st = decode::CheckRingFlags(head + i, e.request_id, e.causal, e.trace, e.layer_step, e.has_position);
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

void DecodeReactor::PostLocked(Group* g) {
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

DecodeReactor::~DecodeReactor() {
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
}  // namespace latentd::server
