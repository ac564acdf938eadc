// The rules that keep a Decode stream's reactor alive and its gRPC calls in order.
//
// Lifetime rule. A reactor is deleted by the Unref that takes its count to zero, and by
// nothing else. The count holds:
//   - one reference for gRPC, from construction until OnDone;
//   - one per thread inside any of its methods (ScopedRef at the top of every entry
//     point: gRPC reactions, engine StepDone, drain, housekeeping, the ring's thread).
// A reference may only be taken while another is held: the entry points are reached
// either from gRPC (which holds its own until OnDone), from the engine for an accepted
// step (no Finish, hence no OnDone, while a step is in flight), or from the stream
// registry, which a reactor leaves in OnDone before gRPC's reference is dropped, and
// whose visitors take their reference under the registry lock.
// Start rule. No StartRead/StartWrite is issued after Finish: every Start* is decided
// under the stream's lock (counted in StartGate until issued), and Finish is decided
// only when none is being issued, and then once (StartGate::Finishing).
#pragma once

#include <atomic>

#include "grpcpp/support/status.h"

namespace latentd::server::decode {

// The reactor's reference count (lifetime rule).
class RefCount {
 public:
  // Starts with gRPC's reference. Release: publishes what the constructor wrote before
  // the first Ref on another thread.
  RefCount() { refs_.store(1, std::memory_order_release); }
  // Acquire: the first Ref on another gRPC thread (OnCancel, say) then synchronizes with
  // the constructor's release store, an ordering gRPC provides but TSan cannot see.
  void Ref() { refs_.fetch_add(1, std::memory_order_acquire); }
  // True when this dropped the last reference: the caller deletes the reactor.
  bool Unref() { return refs_.fetch_sub(1, std::memory_order_acq_rel) == 1; }

 private:
  std::atomic<int> refs_{1};
};

// A reference for the scope of an entry point; T has Ref() and Unref() (which may
// delete it).
template <typename T>
class ScopedRef {
 public:
  explicit ScopedRef(T* t) : t_(t) { t_->Ref(); }
  ~ScopedRef() { t_->Unref(); }
  ScopedRef(const ScopedRef&) = delete;
  ScopedRef& operator=(const ScopedRef&) = delete;

 private:
  T* const t_;
};

// The start rule's state, guarded by the stream's lock.
class StartGate {
 public:
  bool finished() const { return finished_; }
  // A Start* was decided; it is issued after the lock is released.
  void Starting() { ++starting_; }
  // The Start* calls of one decision were issued.
  void Started() { --starting_; }
  // Finish may be decided now: not yet finished, and no Start* being issued.
  bool MayFinish() const { return !finished_ && starting_ == 0; }
  // Finish is decided (or the stream finished before it started).
  void Finishing() { finished_ = true; }

 private:
  int starting_ = 0;
  bool finished_ = false;
};

// What to do after a state change: decided under the stream's lock, done after
// releasing it, since gRPC may run reactions (even OnDone) at the end of a Start* or
// Finish call.
struct Plan {
  bool read = false;
  bool write = false;
  bool finish = false;
  grpc::Status status;
};

// Issues what the plan says through the reactor's entry points, then re-plans once the
// Start* calls are out (a Finish that had to wait for them is decided then). R has
// IssueWrite(), IssueRead(), IssueFinish(grpc::Status) (its StartWrite, StartRead and
// Finish) and Replan(), which takes the lock, calls StartGate::Started and returns the
// next plan.
template <typename R>
void Act(R* r, Plan p) {
  for (;;) {
    if (p.write) r->IssueWrite();
    if (p.read) r->IssueRead();
    if (p.finish) {
      r->IssueFinish(p.status);
      return;
    }
    if (!p.read && !p.write) return;
    p = r->Replan();
  }
}

}  // namespace latentd::server::decode
