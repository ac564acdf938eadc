// The daemon's side of a doorbell ring (proto/ring.h): the thread that takes the steps a
// same-host client publishes in its submission queue, and the completion queue it
// answers them on. The stream that owns the ring decides what a step is and when it may
// take more (DoorbellRing::Stream); this unit owns the ring's counters and the thread's
// waiting rule.
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/ring.h"

namespace latentd::server::dataplane {

class DoorbellRing {
 public:
  // How far the thread may go on. Only ever raised.
  enum Stop : int {
    kRun = 0,
    kDrained = 1,  // take what is published, then stop (the client half-closed the stream)
    kNow = 2,      // stop at once (the stream cannot go on)
  };

  // What the ring asks of the stream it feeds. Called on the ring's thread.
  class Stream {
   public:
    virtual ~Stream() = default;
    // Steps the stream can take now (its in-flight bound minus what it holds).
    virtual int64_t Room() = 0;
    // Entries [head, head + count) are published: read them (Entry) and submit them.
    virtual void Take(uint32_t head, uint32_t count) = 0;
    // The client broke the ring's contract: the stream ends with `status`; the thread
    // stops after this returns.
    virtual void Fail(absl::Status status) = 0;
  };

  struct Options {
    // How long the thread polls for more after taking a batch, before it sleeps on the
    // futex (a wake-up that brings nothing does not start it again).
    absl::Duration spin;
    int64_t max_batch = 1024;  // entries one Take hands over at most
  };

  // `base` is the ring's memory (RingBytes(entries) bytes, zeroed): the start of a shared
  // region, or a file of its own. Writes the header's size field.
  DoorbellRing(char* base, uint32_t entries, Options options);
  DoorbellRing(const DoorbellRing&) = delete;
  DoorbellRing& operator=(const DoorbellRing&) = delete;

  // The thread's loop: takes published entries in batches while the completion queue
  // (as the client reports consuming it) and the stream have room, until stopped; then
  // marks the ring closed and wakes the client.
  void Run(Stream* stream);
  // Raises the stop level (never lowers it) and wakes the thread. Any thread.
  void RequestStop(Stop stop);

  // Entry `index` (a free-running counter) of the submission queue, copied out of the
  // shared memory once, so the client cannot change it while it is validated.
  ring::SqEntry Entry(uint32_t index) const;
  // The completion entry for free-running counter `index`. Completions are written by
  // one thread at a time (the stream serialises them) and published with Publish.
  ring::CqEntry* Completion(uint32_t index);
  // Publishes completions up to `tail` (one store), waking the client if it sleeps.
  // The thread checks the client's cq_head against it: a head outside
  // [consumed so far, posted] ends the stream naming ring.cq_head.
  void Publish(uint32_t tail);

  uint32_t entries() const { return entries_; }
  ring::Header* header() const { return header_; }
  // How many times the thread went to sleep on sq_tail's futex (for tests).
  uint64_t sleeps() const { return sleeps_.load(std::memory_order_relaxed); }

 private:
  char* const base_;
  ring::Header* const header_;
  const uint32_t entries_;
  const Options options_;
  std::atomic<int> stop_{kRun};
  std::atomic<uint32_t> posted_{0};  // the last Publish's tail
  std::atomic<uint64_t> sleeps_{0};
};

// Since when a ring's client has left posted completions unconsumed, for the stream stall
// rule (--stream_stall_timeout_s): a ring's answer to a byte stream's pending write.
// Observed now and then by one thread (housekeeping, under the stream's lock).
class CompletionWatch {
 public:
  // `consumed`: the client's cq_head; `posted`: completions published. InfiniteFuture
  // while nothing waits; else the first observation of the client's current cq_head
  // with completions waiting (any progress starts the clock again).
  absl::Time Observe(uint32_t consumed, uint32_t posted, absl::Time now);

 private:
  bool waiting_ = false;
  uint32_t consumed_ = 0;
  absl::Time since_;
};

}  // namespace latentd::server::dataplane
