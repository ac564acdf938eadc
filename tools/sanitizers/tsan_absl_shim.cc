// ThreadSanitizer support for Debian's uninstrumented abseil: tells TSan about the
// happens-before edges absl::Mutex, CondVar and Notification create. Linked only into
// --config=tsan builds (through //third_party:absl); see docs/testing.md.
//
// libabsl_synchronization.so is built without TSan, so TSan sees no synchronization in
// it and reports every ABSL_GUARDED_BY field as racy. This file defines the same member
// functions as that library. The executable's definitions win: our own code binds to
// them at link time, and gRPC's and abseil's calls through the PLT bind to them because
// the executable exports them (-rdynamic below). Each one forwards to the library's
// function (dlsym RTLD_NEXT) and adds the edge: acquire after taking the lock, release
// before dropping it, and both around waits that drop and retake it.
//
// Writers release and acquire on the mutex's address; readers release on address + 1,
// which only writers acquire, so two readers are not ordered with each other (as with
// a real reader lock) but each reader is ordered with the writers before and after it.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/base/config.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#ifndef __SANITIZE_THREAD__
#if defined(__has_feature)
#if !__has_feature(thread_sanitizer)
#error "tsan_absl_shim is for --config=tsan builds only"
#endif
#else
#error "tsan_absl_shim is for --config=tsan builds only"
#endif
#endif

namespace {

#define LATENTD_STR2(x) #x
#define LATENTD_STR(x) LATENTD_STR2(x)

// Mangled names are "_ZN4absl" (or "_ZNK4absl" for const members), the inline
// namespace, then the class and member; the inline namespace differs between abseil
// builds (Debian's is "debian3"), so it is spliced in from the headers' option.
std::string Mangled(bool is_const, const char* rest) {
  const char* ns = LATENTD_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  std::string name = is_const ? "_ZNK4absl" : "_ZN4absl";
  name += std::to_string(std::strlen(ns));
  name += ns;
  name += rest;
  return name;
}

// The library's definition of `rest`; dies loudly if it is missing, since a silently
// skipped forward would lose the lock itself.
template <typename Fn>
Fn Real(bool is_const, const char* rest) {
  const std::string name = Mangled(is_const, rest);
  void* sym = dlsym(RTLD_NEXT, name.c_str());
  if (sym == nullptr) {
    std::fprintf(stderr, "tsan_absl_shim: %s not found: %s\n", name.c_str(), dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(sym);
}

#define REAL(Type, is_const, rest)                       \
  static const auto real = Real<Type>(is_const, rest); \
  (void)0

void* WriterAddr(const void* mu) { return const_cast<void*>(mu); }
void* ReaderAddr(const void* mu) {
  return static_cast<char*>(const_cast<void*>(mu)) + 1;
}

// After a write lock: everything any earlier writer or reader did.
void AcquireWrite(const void* mu) {
  __tsan_acquire(WriterAddr(mu));
  __tsan_acquire(ReaderAddr(mu));
}
// After a read lock: everything earlier writers did.
void AcquireRead(const void* mu) { __tsan_acquire(WriterAddr(mu)); }
void ReleaseWrite(const void* mu) { __tsan_release(WriterAddr(mu)); }
void ReleaseRead(const void* mu) { __tsan_release(ReaderAddr(mu)); }

using absl::Condition;

// Conditions (LockWhen, Await) are evaluated with the lock held but inside the
// library: by the waiting thread before the wrapper's own acquire, or by whichever
// thread is unlocking. Each condition is therefore wrapped: the waiter publishes the
// wrapper (release on its address), and the evaluation acquires it and the mutex's
// history before running the caller's condition and releases afterwards, so the reads
// in the condition are ordered with the lock's other holders. The wrapper goes to the
// library through Condition's void* constructor, which the library itself implements,
// so TSan sees no unordered read of the Condition object.
struct WrappedCondition {
  const absl::Mutex* mu;
  const Condition* cond;
};

bool EvalWrapped(void* arg) {
  __tsan_acquire(arg);
  auto* w = static_cast<WrappedCondition*>(arg);
  AcquireWrite(w->mu);
  const bool result = w->cond->Eval();
  ReleaseWrite(w->mu);
  return result;
}

// The wrapped condition for `cond` on `mu`, published before the library sees it.
#define WRAP_CONDITION(name, mu, cond)     \
  WrappedCondition name##_arg{mu, &cond};  \
  __tsan_release(&name##_arg);             \
  const Condition name(&EvalWrapped, &name##_arg)

// abseil's deadlock detector (on in Debian's build) keeps one global graph of lock
// ordering guarded by an internal SpinLock, which is uninstrumented too and has no
// exported entry points to wrap: TSan reports the graph's memmoves as races between
// any two threads that take a Mutex. ThreadSanitizer runs are about races, so the
// detector is switched off before main() starts any thread.
const bool kDeadlockDetectorOff = [] {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return true;
}();

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  REAL(void (*)(Mutex*), false, "5Mutex4LockEv");
  real(this);
  AcquireWrite(this);
}

void Mutex::Unlock() {
  REAL(void (*)(Mutex*), false, "5Mutex6UnlockEv");
  ReleaseWrite(this);
  real(this);
}

bool Mutex::TryLock() {
  REAL(bool (*)(Mutex*), false, "5Mutex7TryLockEv");
  const bool ok = real(this);
  if (ok) AcquireWrite(this);
  return ok;
}

void Mutex::ReaderLock() {
  REAL(void (*)(Mutex*), false, "5Mutex10ReaderLockEv");
  real(this);
  AcquireRead(this);
}

void Mutex::ReaderUnlock() {
  REAL(void (*)(Mutex*), false, "5Mutex12ReaderUnlockEv");
  ReleaseRead(this);
  real(this);
}

bool Mutex::ReaderTryLock() {
  REAL(bool (*)(Mutex*), false, "5Mutex13ReaderTryLockEv");
  const bool ok = real(this);
  if (ok) AcquireRead(this);
  return ok;
}

void Mutex::LockWhen(const Condition& cond) {
  REAL(void (*)(Mutex*, const Condition&), false, "5Mutex8LockWhenERKNS0_9ConditionE");
  WRAP_CONDITION(wrapped, this, cond);
  real(this, wrapped);
  AcquireWrite(this);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  REAL(bool (*)(Mutex*, const Condition&, absl::Duration), false,
       "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  WRAP_CONDITION(wrapped, this, cond);
  const bool ok = real(this, wrapped, timeout);
  AcquireWrite(this);
  return ok;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  REAL(bool (*)(Mutex*, const Condition&, absl::Time), false,
       "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  WRAP_CONDITION(wrapped, this, cond);
  const bool ok = real(this, wrapped, deadline);
  AcquireWrite(this);
  return ok;
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  REAL(void (*)(Mutex*, const Condition&), false, "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  WRAP_CONDITION(wrapped, this, cond);
  real(this, wrapped);
  AcquireRead(this);
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  REAL(bool (*)(Mutex*, const Condition&, absl::Duration), false,
       "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  WRAP_CONDITION(wrapped, this, cond);
  const bool ok = real(this, wrapped, timeout);
  AcquireRead(this);
  return ok;
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  REAL(bool (*)(Mutex*, const Condition&, absl::Time), false,
       "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  WRAP_CONDITION(wrapped, this, cond);
  const bool ok = real(this, wrapped, deadline);
  AcquireRead(this);
  return ok;
}

// Await drops the lock while it waits: release what this holder did, acquire what the
// holders in between did. (Called with a write lock in this project; for a reader the
// write-side release only adds ordering, it cannot invent a race.)
void Mutex::Await(const Condition& cond) {
  REAL(void (*)(Mutex*, const Condition&), false, "5Mutex5AwaitERKNS0_9ConditionE");
  ReleaseWrite(this);
  WRAP_CONDITION(wrapped, this, cond);
  real(this, wrapped);
  AcquireWrite(this);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  REAL(bool (*)(Mutex*, const Condition&, absl::Duration), false,
       "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  ReleaseWrite(this);
  WRAP_CONDITION(wrapped, this, cond);
  const bool ok = real(this, wrapped, timeout);
  AcquireWrite(this);
  return ok;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  REAL(bool (*)(Mutex*, const Condition&, absl::Time), false,
       "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  ReleaseWrite(this);
  WRAP_CONDITION(wrapped, this, cond);
  const bool ok = real(this, wrapped, deadline);
  AcquireWrite(this);
  return ok;
}

// CondVar waits drop and retake `mu` inside the library.
void CondVar::Wait(Mutex* mu) {
  REAL(void (*)(CondVar*, Mutex*), false, "7CondVar4WaitEPNS0_5MutexE");
  ReleaseWrite(mu);
  real(this, mu);
  AcquireWrite(mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  REAL(bool (*)(CondVar*, Mutex*, absl::Duration), false,
       "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  ReleaseWrite(mu);
  const bool timed_out = real(this, mu, timeout);
  AcquireWrite(mu);
  return timed_out;
}

bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  REAL(bool (*)(CondVar*, Mutex*, absl::Time), false,
       "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  ReleaseWrite(mu);
  const bool timed_out = real(this, mu, deadline);
  AcquireWrite(mu);
  return timed_out;
}

// Notification: Notify publishes, the waits (which may return on the fast path
// without locking anything) receive.
void Notification::Notify() {
  REAL(void (*)(Notification*), false, "12Notification6NotifyEv");
  __tsan_release(this);
  real(this);
}

void Notification::WaitForNotification() const {
  REAL(void (*)(const Notification*), true, "12Notification19WaitForNotificationEv");
  real(this);
  __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(absl::Duration timeout) const {
  REAL(bool (*)(const Notification*, absl::Duration), true,
       "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const bool notified = real(this, timeout);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(absl::Time deadline) const {
  REAL(bool (*)(const Notification*, absl::Time), true,
       "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  const bool notified = real(this, deadline);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl
