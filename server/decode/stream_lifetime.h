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

#if defined(__SANITIZE_THREAD__)
#define LATENTD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LATENTD_TSAN 1
#endif
#endif
#ifndef LATENTD_TSAN
#define LATENTD_TSAN 0
#endif
#if LATENTD_TSAN
#include <sanitizer/tsan_interface.h>
#endif

#include "grpcpp/support/status.h"

namespace latentd::server::decode {

// The reactor's reference count (lifetime rule).
class RefCount {
 public:
  // Starts with gRPC's reference.
  RefCount() = default;
  // Called last in the owner's constructor (on every path out of it): see AcquireForTsan.
  void Publish() { PublishForTsan(); }
  void Ref() {
    AcquireForTsan();
    refs_.fetch_add(1, std::memory_order_relaxed);
  }
  // True when this dropped the last reference: the caller deletes the reactor.
  bool Unref() { return refs_.fetch_sub(1, std::memory_order_acq_rel) == 1; }

 private:
  // gRPC calls a reactor back (OnCancel, for one, on its executor thread) only after the
  // handler has returned it, but hands it over through its own uninstrumented queues, so
  // under ThreadSanitizer the constructor's writes (this count's among them) look
  // unordered with the first Ref on another thread. An atomic acquire cannot say it:
  // TSan checks an access before applying its order. These annotate gRPC's ordering, and
  // compile to nothing outside TSan builds.
#if LATENTD_TSAN
  void PublishForTsan() { __tsan_release(this); }
  void AcquireForTsan() { __tsan_acquire(this); }
#else
  void PublishForTsan() {}
  void AcquireForTsan() {}
#endif

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
