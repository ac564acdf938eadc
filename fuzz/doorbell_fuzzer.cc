// libFuzzer target: the doorbell ring, the one input of the daemon that is shared
// memory rather than a message. Each input opens a Decode stream with a ring, then
// plays the client: publishes batches of submission entries (valid steps, or entries
// broken in one field: offsets out of the region, misaligned or inside the ring, bad
// sequence ids and their lengths, layers, s_q, flags), bumps sq_tail by the right or a
// wrong amount, lies in cq_head and the waiting flag, reads completions, and ends the
// stream by closing it or cancelling it. Valid steps use a slot of their own, so no two
// steps in flight share memory (overlapping tensors are the client's own garbage, not
// exercised here). Afterwards the server must still be healthy.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "fuzz/service_harness.h"
#include "proto/ring.h"

using latentd::fuzz::Fail;
using latentd::fuzz::Harness;
using latentd::fuzz::Input;
namespace ring = latentd::ring;

namespace {

constexpr uint32_t kEntries = 8;
constexpr int kSlots = static_cast<int>(kEntries);
constexpr int64_t kQ = 2 * latentd::fuzz::kQRowBytes, kKv = 2 * latentd::fuzz::kKvRowBytes,
                  kOut = 2 * latentd::fuzz::kOutRowBytes, kLse = 2 * latentd::fuzz::kHeadsQ * 4;
constexpr uint64_t kSlotBytes = (kQ + kKv + kOut + kLse + 63) / 64 * 64;
constexpr uint64_t kBase = ring::RingBytes(kEntries);
constexpr uint64_t kRegionBytes = kBase + kSlotBytes * kSlots;

uint64_t SlotAt(int i) { return kBase + kSlotBytes * static_cast<uint64_t>(i); }

uint64_t Wide(Input& in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | in.Byte();
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Harness& h = Harness::Get();
  Input in(data, size);
  const std::vector<std::string> ids = h.BeginInput(in.Range(1, 2));

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto stream = h.stub()->Decode(&ctx);
  latentd::v1::DecodeRequest ask;
  ask.set_open_region_bytes(kRegionBytes);
  ask.set_region_ring_entries(kEntries);
  latentd::v1::DecodeResponse answer;
  if (!stream->Write(ask) || !stream->Read(&answer)) {
    Fail(absl::StrCat("opening a ring failed: ", stream->Finish().error_message()));
  }
  // The daemon's memory file, opened the way a client on its host would.
  const int fd = ::open(answer.region().path().c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) Fail("cannot open the region's path " + answer.region().path());
  void* map = mmap(nullptr, kRegionBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (map == MAP_FAILED) Fail("cannot map the region");
  char* base = static_cast<char*>(map);
  auto* hdr = reinterpret_cast<ring::Header*>(base);
  auto* sq = reinterpret_cast<ring::SqEntry*>(base + ring::SqOffset());
  const auto* cq = reinterpret_cast<const ring::CqEntry*>(base + ring::CqOffset(kEntries));

  uint32_t tail = 0, head = 0;
  bool broken_ring = false;  // sq_tail published past what the server allows
  std::vector<int> slot_free(kSlots, 1);
  const int actions = in.Range(1, 12);
  for (int a = 0; a < actions && !in.empty(); ++a) {
    switch (in.Range(0, 5)) {
      case 0:
      case 1:
      case 2: {  // publish a batch
        const uint32_t room = kEntries - (tail - head);
        const int n = in.Range(0, static_cast<int>(room));
        for (int k = 0; k < n; ++k) {
          ring::SqEntry e{};
          e.request_id = static_cast<uint64_t>(in.Range(0, 1000));
          const std::string& id = ids[in.Range(0, static_cast<int>(ids.size()) - 1)];
          e.sequence_id_bytes = static_cast<uint32_t>(id.size());
          std::memcpy(e.sequence_id, id.data(), id.size());
          e.layer = in.Range(0, latentd::fuzz::kLayers - 1);
          e.s_q = static_cast<uint32_t>(in.Range(1, 2));
          e.causal = static_cast<uint32_t>(in.Range(0, 1));
          int slot = -1;
          for (int s = 0; s < kSlots; ++s)
            if (slot_free[s]) slot = s;
          if (slot >= 0) {
            // The entry owns this slot until everything in flight has completed,
            // whatever the field broken below (a step the server still accepts must
            // not share memory with another in flight).
            slot_free[slot] = 0;
            const uint64_t at = SlotAt(slot);
            const std::string seed = in.Bytes(in.Range(0, 8));
            const std::string q = latentd::fuzz::Rows(seed, static_cast<int>(e.s_q), latentd::fuzz::kQRowBytes);
            const std::string kv = latentd::fuzz::Rows(seed, static_cast<int>(e.s_q), latentd::fuzz::kKvRowBytes);
            std::memcpy(base + at, q.data(), q.size());
            std::memcpy(base + at + kQ, kv.data(), kv.size());
            e.q_offset = at;
            e.kv_offset = at + kQ;
            e.out_offset = at + kQ + kKv;
            e.lse_offset = at + kQ + kKv + kOut;
          } else {
            e.layer = latentd::fuzz::kLayers + 3;  // no free slot: refused before any tensor is read
          }
          switch (in.Range(0, 13)) {  // break one field now and then
            case 0: e.q_offset = Wide(in) | (uint64_t{1} << 40); break;  // past the region
            case 1: e.out_offset = kRegionBytes - static_cast<uint64_t>(in.Range(0, 64)); break;
            case 2: e.lse_offset += 1 + static_cast<uint64_t>(in.Range(0, 2)); break;  // misaligned
            case 3: e.kv_offset = static_cast<uint64_t>(in.Range(0, static_cast<int>(kBase) - 1)); break;  // the ring
            case 4: e.sequence_id_bytes = static_cast<uint32_t>(Wide(in)); break;
            case 5: e.sequence_id_bytes = 0; break;
            case 6: std::memcpy(e.sequence_id, "no-such-seq", 11); e.sequence_id_bytes = 11; break;
            case 7: e.layer = static_cast<int32_t>(Wide(in)); break;
            case 8: e.s_q = in.Range(0, 1) ? 0u : static_cast<uint32_t>(in.Range(5, 40)); break;  // max_s_q is 4
            case 9: e.causal = static_cast<uint32_t>(in.Range(2, 255)); break;
            case 10: e.trace = static_cast<uint32_t>(in.Range(0, 3)); break;
            default: break;
          }
          std::memcpy(&sq[(tail + static_cast<uint32_t>(k)) % kEntries], &e, sizeof(e));
        }
        uint32_t bump = static_cast<uint32_t>(n);
        if (in.Range(0, 15) == 0) {  // more than the ring holds: ends the stream
          bump = kEntries + 1 + static_cast<uint32_t>(in.Range(0, 2 * static_cast<int>(kEntries)));
          broken_ring = true;
        }
        tail += bump;
        hdr->sq_tail.store(tail, std::memory_order_seq_cst);
        if (hdr->server_waiting.load(std::memory_order_seq_cst) != 0) ring::FutexWake(&hdr->sq_tail);
        break;
      }
      case 3: {  // read what has completed, waiting a little
        const absl::Time until = absl::Now() + absl::Milliseconds(in.Range(0, 50));
        do {
          const uint32_t ct = hdr->cq_tail.load(std::memory_order_acquire);
          for (; head != ct; ++head) {
            const ring::CqEntry& c = cq[head % kEntries];
            if (c.code < 0 || c.code > 16) Fail(absl::StrCat("completion with code ", c.code));
            if (c.message_bytes > ring::kMaxMessage) Fail("completion message over its bound");
            if (c.code == 0 && c.message_bytes != 0) Fail("OK completion with a message");
          }
          hdr->cq_head.store(head, std::memory_order_release);
        } while (head != tail && !broken_ring && absl::Now() < until);
        if (head == tail) std::fill(slot_free.begin(), slot_free.end(), 1);  // nothing in flight
        break;
      }
      case 4:  // lies in the client's own words of the header
        hdr->cq_head.store(static_cast<uint32_t>(Wide(in)), std::memory_order_release);
        hdr->client_waiting.store(in.Byte(), std::memory_order_release);
        break;
      default:
        absl::SleepFor(absl::Microseconds(in.Range(0, 200)));
        break;
    }
  }
  if (in.Range(0, 1) == 0) {
    ctx.TryCancel();
  } else {
    stream->WritesDone();
  }
  latentd::v1::DecodeResponse resp;
  while (stream->Read(&resp)) {
  }
  const grpc::Status st = stream->Finish();
  if (broken_ring && st.ok()) Fail("a ring published past its entries ended OK");
  munmap(map, kRegionBytes);
  h.CheckHealthy(ids[0]);
  h.EndInput();
  return 0;
}
