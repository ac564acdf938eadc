// The doorbell ring's thread and its completion queue (doorbell_ring.h).
#include "server/dataplane/doorbell_ring.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace latentd::server::dataplane {

DoorbellRing::DoorbellRing(char* base, uint32_t entries, Options options)
    : base_(base), header_(reinterpret_cast<ring::Header*>(base)), entries_(entries), options_(options) {
  header_->entries = entries;  // the memory is fresh: every counter starts at 0
}

void DoorbellRing::RequestStop(Stop stop) {
  int cur = stop_.load(std::memory_order_relaxed);
  while (stop > cur) {
    if (stop_.compare_exchange_weak(cur, stop, std::memory_order_release, std::memory_order_relaxed)) {
      ring::FutexWake(&header_->sq_tail);
      return;
    }
  }
}

ring::SqEntry DoorbellRing::Entry(uint32_t index) const {
  ring::SqEntry e;
  std::memcpy(&e, base_ + ring::SqOffset() + static_cast<size_t>(index & (entries_ - 1)) * sizeof(ring::SqEntry),
              sizeof(e));
  return e;
}

ring::CqEntry* DoorbellRing::Completion(uint32_t index) {
  return reinterpret_cast<ring::CqEntry*>(base_ + ring::CqOffset(entries_) +
                                          static_cast<size_t>(index & (entries_ - 1)) * sizeof(ring::CqEntry));
}

void DoorbellRing::Publish(uint32_t tail) {
  // Before cq_tail: a client that saw cq_tail then wrote cq_head is checked against a
  // posted_ at least as far (Run reads cq_head first, then posted_).
  posted_.store(tail, std::memory_order_release);
  header_->cq_tail.store(tail, std::memory_order_seq_cst);
  if (header_->client_waiting.load(std::memory_order_seq_cst) != 0) ring::FutexWake(&header_->cq_tail);
}

void DoorbellRing::Run(Stream* stream) {
  ring::Header* const h = header_;
  const uint32_t n = entries_;
  uint32_t head = 0;
  uint32_t consumed = 0;  // the client's cq_head as last checked
  // When the submission tail last moved. The spin follows real work only: a futex return
  // (its timeout, a spurious wake, or any process of the user waking the word) finds
  // nothing new and sleeps again, so an idle ring costs no core whoever wakes it.
  absl::Time active = absl::InfinitePast();
  const absl::Duration spin = options_.spin;
  for (;;) {
    const int stop = stop_.load(std::memory_order_acquire);
    if (stop == kNow) break;
    const uint32_t tail = h->sq_tail.load(std::memory_order_acquire);
    const uint32_t avail = tail - head;
    if (avail > n) {
      stream->Fail(absl::InvalidArgumentError(absl::StrCat("ring.sq_tail: ", tail, " is ", avail,
                                                           " entries past sq_head ", head,
                                                           "; expected at most the ring's ", n, " entries")));
      break;
    }
    if (avail == 0) {
      if (stop == kDrained) break;
      if (absl::Now() - active < spin) continue;
      h->server_waiting.store(1, std::memory_order_seq_cst);
      if (h->sq_tail.load(std::memory_order_seq_cst) == tail && stop_.load(std::memory_order_acquire) == kRun) {
        sleeps_.fetch_add(1, std::memory_order_relaxed);
        ring::FutexWait(&h->sq_tail, tail, 5000);
      }
      h->server_waiting.store(0, std::memory_order_relaxed);
      continue;
    }
    // Completions not yet consumed, as the client reports them. A head that moved back,
    // or past what was posted, would leave the ring waiting for room that never comes.
    const uint32_t cq_head = h->cq_head.load(std::memory_order_acquire);
    const uint32_t posted = posted_.load(std::memory_order_acquire);
    if (cq_head - consumed > posted - consumed) {
      stream->Fail(absl::InvalidArgumentError(
          absl::StrCat("ring.cq_head: ", cq_head, "; expected from ", consumed, " (completions consumed before) to ",
                       posted, " (completions posted): the client moves it forward over completions it has read")));
      break;
    }
    consumed = cq_head;
    const uint32_t unconsumed = std::min(n, head - cq_head);
    if (unconsumed == n && stop == kDrained) {
      // Half-closed with its completion queue full: a client that no longer reads
      // would hold the stream open for ever. What was not taken was never
      // acknowledged (sq_head says how far the server got).
      break;
    }
    int64_t room = std::min<int64_t>({int64_t{avail}, int64_t{n - unconsumed}, options_.max_batch});
    room = std::min<int64_t>(room, stream->Room());
    if (room <= 0) {
      // Waits for results to come back (the engine's doing) or to be consumed (the
      // client's): briefly at first, then without burning the core.
      absl::SleepFor(absl::Now() - active < spin ? absl::Microseconds(20) : absl::Milliseconds(1));
      continue;
    }
    stream->Take(head, static_cast<uint32_t>(room));
    head += static_cast<uint32_t>(room);
    h->sq_head.store(head, std::memory_order_release);
    active = absl::Now();
  }
  h->closed.store(1, std::memory_order_seq_cst);
  ring::FutexWake(&h->cq_tail);
}

absl::Time CompletionWatch::Observe(uint32_t consumed, uint32_t posted, absl::Time now) {
  if (consumed == posted) {
    waiting_ = false;
    return absl::InfiniteFuture();
  }
  if (!waiting_ || consumed != consumed_) {
    waiting_ = true;
    consumed_ = consumed;
    since_ = now;
  }
  return since_;
}

}  // namespace latentd::server::dataplane
