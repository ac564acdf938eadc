// Admission and flow control of a Decode stream: what a step may make the daemon hold.
// Step buffers are charged against one budget for all streams (--max_inflight_bytes),
// slots are reused per stream, a stream reads no more while it has
// --max_stream_inflight steps open, and a stream whose client stopped taking responses
// is stalled (and cancelled by the daemon's housekeeping).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/decode/step_shape.h"
#include "server/decode/step_slot.h"

namespace latentd::server::decode {

// Bytes charged against a limit by many threads; a charge over it is refused whole.
class ByteBudget {
 public:
  explicit ByteBudget(int64_t limit) : limit_(limit) {}
  // Charges `bytes`; false (nothing charged) when that would pass the limit.
  bool Charge(int64_t bytes) {
    if (used_.fetch_add(bytes, std::memory_order_relaxed) + bytes > limit_) {
      used_.fetch_sub(bytes, std::memory_order_relaxed);
      return false;
    }
    return true;
  }
  void Release(int64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }
  int64_t used() const { return used_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

// Brings the slot's charge up to what its buffers hold (HeldBytes) plus `extra` bytes
// they are about to grow by. Over the budget, gives the inputs just read back (so
// nothing stays held uncharged) and returns RESOURCE_EXHAUSTED naming
// --max_inflight_bytes. A slot's charge only grows until it is deleted (ReleaseSlot).
absl::Status ChargeSlot(Slot* s, int64_t extra, ByteBudget* budget);
// Gives the slot's whole charge back (it is being deleted).
void ReleaseSlot(Slot* s, ByteBudget* budget);

// What a byte step of s_q tokens adds to its slot before it runs: lse grows the slot's
// buffer (beyond the capacity it has), out goes into the message's response buffer
// (LayOut), counted with the slot that will hand it over.
int64_t ResultCharge(int64_t s_q, size_t lse_capacity, const StepShape& sh, bool layer_step = false);

// A slot's registered input buffer for s_q tokens: [q | kv at kv_at], whole pages.
struct PinnedSize {
  size_t kv_at = 0;
  size_t bytes = 0;
};
PinnedSize PinnedFor(int64_t s_q, const StepShape& sh);

// A stream's spare slots (not thread-safe: the stream's lock guards it). Taking reuses
// spare ones before making new ones, so a stream's steady state allocates nothing.
class SlotPool {
 public:
  SlotPool() = default;
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  // Slots for a message of n steps into *out (cleared first).
  void Take(int n, std::vector<Slot*>* out);
  void Put(Slot* s) { free_.push_back(s); }
  size_t size() const { return free_.size(); }
  // Moves the spare slots beyond the first `keep` into *spare, for the caller to delete.
  void TakeSpare(size_t keep, std::vector<Slot*>* spare);
  // Every spare slot, for the stream's destructor.
  std::vector<Slot*>& all() { return free_; }

 private:
  std::vector<Slot*> free_;
};

// Steps a stream holds open: in the engine, answered but waiting for the rest of their
// message, answered and waiting for a write, and read but not yet submitted. The stream
// reads again only while this is under --max_stream_inflight.
inline int64_t OpenSteps(int64_t inflight, int64_t held, size_t done, size_t deferred) {
  return inflight + held + static_cast<int64_t>(done + deferred);
}

// The stall rule: a response write pending since before `cutoff` means the client has
// stopped reading, and flow control would hold the stream (its slots and results) until
// the client's deadline, or for ever without one.
inline bool Stalled(bool writing, absl::Time write_started, absl::Time cutoff) {
  return writing && write_started < cutoff;
}

}  // namespace latentd::server::decode
