// The Decode stream's reactor: one per stream, with its own lock, tying the units of
// server/decode/ together (read, validate, charge, submit a message at a time, coalesce
// results into one outstanding write) and the stream's same-host data plane
// (server/dataplane/). Private to //server:service, which creates it in Decode().
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/wire.h"
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
#include "server/service.h"

namespace latentd::server {

// The lifetime and start rules are decode::RefCount / StartGate (server/decode/
// stream_lifetime.h): every entry point holds a ScopedRef, and every Start* and Finish
// is decided under mu_ through the gate. The message rule is decode::MessageGroups.
class DecodeReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                            public engine::StepCallback {
  using Group = decode::Group;
  using Slot = decode::Slot;

 public:
  DecodeReactor(DecodeServiceImpl* service, grpc::CallbackServerContext* ctx, grpc::Status initial, uint64_t flow);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  // Engine thread. Must not block: a short critical section, then maybe a write start.
  void StepDone(engine::DecodeStep* step, absl::Status status) override { StepsDone(&step, &status, 1); }

  // A batch's steps of this stream, finished together: one pass under mu_ for all.
  void StepsDone(engine::DecodeStep* const* steps, const absl::Status* statuses, int n) override;

  // Lifetime rule (stream_lifetime.h).
  void Ref() { refs_.Ref(); }
  void Unref();

  // decode::Act's entry points: the Start* and Finish calls a plan decided, and the
  // next plan once they are out.
  void IssueWrite() { StartWrite(&write_buf_); }
  void IssueRead() { StartRead(&read_buf_); }
  void IssueFinish(const grpc::Status& status) { Finish(status); }
  decode::Plan Replan();

  // The caller holds a reference (the registry visit).
  void BeginDrain();

  // Cancels the stream if a response write has been pending since before `cutoff`, or
  // its ring's completions have waited since then with the client consuming none: the
  // client stopped reading, and flow control would hold this stream (its slots and
  // results) until the client's deadline, or for ever without one. Returns true if so.
  // The caller holds a reference.
  bool CancelIfStalled(absl::Time cutoff);

  // Frees spare slots when nothing has been in flight since the previous call, so a
  // stream's memory shrinks back after a burst. The caller holds a reference.
  int TrimIfIdle();

 private:
  bool GoneLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  decode::Plan PlanLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The response: up to --max_response_bytes of answered results (response_layout.h),
  // their slots taken back.
  void FillResponseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  size_t AcceptedAmong(size_t first_n) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void RecycleLocked(Slot* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The message's last step is answered: its results become writable together.
  void FlushLocked(Group* g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A result (or an error answered by the stream) for one of a message's valid steps.
  void AnsweredLocked(Slot* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A valid step that will never be submitted (the client went away).
  void DroppedLocked(Slot* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void FreePinned(Slot* s);

  // After a valid byte step of s_q tokens that did not fit the slot's registered inputs:
  // makes them large enough for it next time, charged like the slot's other buffers.
  // The stream stops trying once the engine does not register memory (the CPU backend,
  // unless kAlways); a refused budget only skips this growth.
  void GrowPinned(Slot* s, int64_t s_q, const decode::StepShape& sh);

  // decode::ChargeSlot against --max_inflight_bytes, counting a refusal.
  absl::Status ChargeSlot(Slot* s, int64_t extra);

  // Makes a message's n read slots one group: valid ones wait to be submitted, the
  // others are answered with the rest of the group. True if the caller is to submit.
  bool QueueGroupLocked(Slot* const* slots, int n, bool ring, absl::Time parsed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void DeleteSlot(Slot* s);

  void SetFatal(grpc::StatusCode code, absl::string_view message);

  // Reads one DecodeRequest: counts its steps first (nothing is copied for a message
  // over max_steps_per_message), then reads each step into a slot. A step that fails
  // validation is answered at once; valid ones queue in deferred_, from which at most
  // max_stream_inflight are in the engine at a time.
  void Process();

  // The stream's region as its steps are checked against (step_validation.h).
  decode::RegionExtent Region() const { return {region_ != nullptr, region_bytes_, ring_bytes_, region_is_cuda_}; }

  // Fills the engine's fields of a valid, charged step.
  void Prepare(Slot* slot, const wire::StepFields& f, const decode::StepShape& sh);

  // One thread at a time submits deferred steps, in order (steps of one sequence and
  // layer must reach the engine in the order sent). True if the caller is that thread.
  bool ClaimSubmitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Hands deferred steps to the engine while the stream has room; refused ones are
  // answered with the engine's error. Never blocks (Engine::Submit does not).
  // Each round takes every deferred step the stream has room for (a whole message,
  // normally) and submits them in one Engine::SubmitBatch.
  void SubmitDeferred();

  // Same-host data plane: a sealed memory file of `bytes` bytes (dataplane::SharedFile),
  // mapped here for the stream's life. Read side only.
  grpc::Status OpenRegion(uint64_t bytes);

  // How the client gets `file`: with the handoff (ServiceOptions::handoff) a one-time
  // ticket that only this stream's client sees, after which the daemon keeps no
  // descriptor of the file; without, its /proc path. Fills *path or *ticket.
  absl::Status HandOver(dataplane::SharedFile* file, std::string* path, std::string* ticket);
  std::string HandoffSocket(const std::string& ticket) const;

  // Same-host data plane on the GPU: the client's device allocation, opened through
  // CUDA IPC for the stream's life (dataplane::CudaRegion). Read side only.
  grpc::Status OpenCudaRegion(const wire::CudaRegionFields& req, uint64_t ring_entries);

  // A CUDA region's doorbell ring: host memory the device region cannot hold, as a
  // sealed memory file of its own (dataplane::SharedFile) charged to the regions' total.
  // The region is already set: the destructor frees both. Read side only.
  absl::Status OpenRingFile(uint64_t bytes, std::string* path, std::string* ticket);

  // Doorbell ring (dataplane::DoorbellRing). Called on the read side right after the
  // region was opened, before its answer is written: the ring's thread holds a reference
  // (lifetime rule) until it has stopped, and the stream does not finish while it runs.
  void StartRing(uint32_t entries);

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
  void RingLoop();

  void PlanAndAct();

  // Reads `take` published entries from `head` on into slots (each entry copied out of
  // the shared region once, then validated from the copy) and submits the valid ones as
  // one group, answered on the completion queue.
  void TakeRing(uint32_t head, uint32_t take);

  // A ring group's results: one completion entry each, published with one store of
  // cq_tail (and a futex wake if the client sleeps), and the slots taken back.
  void PostLocked(Group* g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  ~DecodeReactor() override;

  DecodeServiceImpl::ReactorHold hold_;  // first: destroyed last
  DecodeServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;  // gRPC's; valid until OnDone
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

}  // namespace latentd::server
