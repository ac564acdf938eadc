// The doorbell ring of the same-host data plane: a Decode stream's shared region may
// start with a submission and a completion queue, so a client on the daemon's host hands
// steps over and learns of their results through shared memory, with no gRPC message
// per layer. The layout below is the contract between the daemon and its clients (C++
// and Python); docs/api.md describes it for other languages.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace latentd::ring {

constexpr uint32_t kMaxEntries = 4096;   // a power of two, 1 .. kMaxEntries
constexpr uint32_t kMaxSequenceId = 128;
constexpr uint32_t kMaxMessage = 168;    // a result's error message is cut to this many bytes

// At offset 0 of the region. Counters run freely (uint32, wrapping); an entry's index is
// its counter modulo `entries`. Each side writes only its own cache line.
struct Header {
  // Written by the client.
  std::atomic<uint32_t> sq_tail;         // steps published: entries [sq_head, sq_tail) are ready
  std::atomic<uint32_t> cq_head;         // completions consumed: their entries may be reused
  std::atomic<uint32_t> client_waiting;  // 1 while the client sleeps on cq_tail (futex)
  uint32_t client_pad[13];
  // Written by the server.
  std::atomic<uint32_t> sq_head;         // steps taken: their entries may be reused
  std::atomic<uint32_t> cq_tail;         // completions published: [cq_head, cq_tail) are ready
  std::atomic<uint32_t> server_waiting;  // 1 while the server sleeps on sq_tail (futex)
  std::atomic<uint32_t> closed;          // 1: the server takes no more steps from this ring
  uint32_t entries;                      // the ring's size, as opened
  uint32_t server_pad[11];
  uint8_t reserved[128];
};
static_assert(sizeof(Header) == 256, "the header is four cache lines");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared counters must be lock-free");

// One step. Tensor offsets and their rules are those of DecodeStep.region (RegionTensors);
// tensors may not overlap the ring itself.
struct SqEntry {
  uint64_t request_id;
  int32_t layer;
  uint32_t s_q;
  uint32_t causal;             // 0 or 1
  uint32_t sequence_id_bytes;  // 1 .. kMaxSequenceId
  uint64_t q_offset, kv_offset, out_offset, lse_offset;
  char sequence_id[kMaxSequenceId];
  uint32_t trace;              // 1: the completion carries the step's server timestamps
  // The layer API (RegionTensors.layer_step): 1 for a layer step, whose hidden states
  // are at hidden_offset and output goes to out_offset; has_position 1 gives position.
  uint32_t layer_step;
  uint64_t hidden_offset;
  int64_t position;
  uint32_t has_position;
  uint8_t reserved[44];
};
static_assert(offsetof(SqEntry, hidden_offset) == 192 && offsetof(SqEntry, has_position) == 208,
              "no padding: the layout is a wire format");
static_assert(sizeof(SqEntry) == 256, "submission entries are 256 bytes");

// One step's result: out and lse are in the region when code is 0 (google.rpc code).
// timing_us: for a traced step, StepTiming's eight stamps in field order (received ..
// response; microseconds since the Unix epoch), else zeros.
struct CqEntry {
  uint64_t request_id;
  int32_t code;
  uint32_t message_bytes;
  char message[kMaxMessage];
  int64_t timing_us[8];
  uint8_t reserved[8];
};
static_assert(sizeof(CqEntry) == 256, "completion entries are 256 bytes");

// Where the queues lie, and the bytes the ring takes at the start of the region (whole
// pages, so the tensors after it can start page-aligned).
constexpr uint64_t SqOffset() { return sizeof(Header); }
constexpr uint64_t CqOffset(uint32_t entries) { return SqOffset() + uint64_t{entries} * sizeof(SqEntry); }
constexpr uint64_t RingBytes(uint32_t entries) {
  return (CqOffset(entries) + uint64_t{entries} * sizeof(CqEntry) + 4095) / 4096 * 4096;
}
constexpr bool ValidEntries(uint64_t entries) {
  return entries >= 1 && entries <= kMaxEntries && (entries & (entries - 1)) == 0;
}

// Futex on a counter in a shared mapping (not a process-private futex: the other side
// is another process). Wait returns when *word != expected, on a wake, or after
// timeout_us; spurious returns are allowed, callers re-check.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_us);
void FutexWake(std::atomic<uint32_t>* word);

}  // namespace latentd::ring
