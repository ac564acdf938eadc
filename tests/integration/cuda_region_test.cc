// The same-host data plane on the GPU (DecodeRequest.open_cuda_region) against the real
// daemon on the CUDA backend, in another process: this test's device allocation, shared
// through CUDA IPC, carries q/kv in and out/lse back, checked against the CPU
// implementation; handles the driver refuses and ranges past the allocation fail with
// the field named, and the daemon keeps serving. Needs a GPU; skips without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "clients/cpp/client.h"
#include "proto/ring.h"
#include "tests/integration/daemon.h"
#include "tests/integration/region_slots.h"
#include "tests/integration/tracker.h"

namespace latentd::testing {
namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::vector<std::string> CudaFlags() {
  return {"--backend=cuda", "--kv_memory_fraction=0", "--kv_pages=1024", "--num_layers=2", "--num_heads_q=32"};
}

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&ptr_, bytes) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  char* data() const { return static_cast<char*>(ptr_); }
  std::string Handle() const {
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, ptr_) != cudaSuccess) return "";
    return std::string(h.reserved, sizeof(h.reserved));
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

// Decodes rounds of 12 steps (mixed s_q, causal, both layers; a few on the bytes path in
// the same message) through `stream`'s CUDA region at `base` (device) and checks every
// result.
void DecodeThroughRegion(client::DecodeStream* stream, Tracker* tracker, const std::vector<std::string>& seqs,
                         const client::Shape& sh, char* base, int rounds) {
  const SlotLayout lay(sh, 0, 256);
  for (int round = 0; round < rounds; ++round) {
    v1::DecodeRequest req;
    std::map<uint64_t, int> slot_of;
    for (int i = 0; i < 12; ++i) {
      v1::DecodeStep* s = req.add_steps();
      *s = tracker->Step(seqs[i % seqs.size()], (i / 6 + round) % 2, 1 + (i + round) % 2, i % 3 == 0);
      if (i % 4 == 3) continue;  // stays on the bytes path
      const int s_q = static_cast<int>(s->q().size() / sh.q_row_bytes);
      char* slot = base + lay.slot * i;
      ASSERT_EQ(cudaMemcpy(slot + lay.q, s->q().data(), s->q().size(), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(slot + lay.kv, s->kv().data(), s->kv().size(), cudaMemcpyHostToDevice), cudaSuccess);
      // NaN where the results go (out, then lse): a step that wrote nothing would fail the check.
      ASSERT_EQ(cudaMemset(slot + lay.out, 0xff, (lay.lse - lay.out) + sh.LseBytes(s_q)),
                cudaSuccess);
      PointAtSlot(s, sh, lay, i);
      slot_of[s->request_id()] = i;
    }
    ASSERT_TRUE(stream->Write(req));
    int got = 0;
    v1::DecodeResponse resp;
    while (got < 12 && stream->Read(&resp)) {
      for (v1::StepResult r : resp.results()) {
        ++got;
        ASSERT_EQ(r.code(), 0) << r.message();
        auto it = slot_of.find(r.request_id());
        if (it != slot_of.end()) {
          EXPECT_TRUE(r.out().empty() && r.lse().empty()) << "region results come back in place only";
          const char* slot = base + lay.slot * it->second;
          const int s_q = req.steps(it->second).region().s_q();
          std::string out(sh.OutBytes(s_q), '\0'), lse(sh.LseBytes(s_q), '\0');
          ASSERT_EQ(cudaMemcpy(out.data(), slot + lay.out, out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
          ASSERT_EQ(cudaMemcpy(lse.data(), slot + lay.lse, lse.size(), cudaMemcpyDeviceToHost), cudaSuccess);
          r.set_out(out);
          r.set_lse(lse);
        }
        ASSERT_TRUE(tracker->Check(r).ok()) << "round " << round << ": " << tracker->Check(r);
      }
    }
    ASSERT_EQ(got, 12);
  }
}

TEST(CudaRegionTest, StepsThroughDeviceMemoryMatchTheCpuImplementation) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  Daemon daemon(CudaFlags());
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  const client::Shape sh = (*c)->shape();
  const SlotLayout lay(sh, 0, 256);
  std::vector<std::string> seqs;
  for (int i = 0; i < 6; ++i) {
    auto s = tracker.NewSequence({10 + 37 * i, 64 * i});
    ASSERT_TRUE(s.ok()) << s.status();
    seqs.push_back(*s);
  }
  // The region starts 4096 bytes into the allocation: offsets are the region's.
  const uint64_t start = 4096, bytes = lay.slot * 12;
  DeviceBuffer buf(start + bytes);
  ASSERT_NE(buf.data(), nullptr);
  const std::string handle = buf.Handle();
  ASSERT_EQ(handle.size(), 64u);
  auto stream = (*c)->OpenDecodeStream();
  absl::Status st = stream->OpenCudaRegion(handle, start, bytes);
  ASSERT_TRUE(st.ok()) << st << "\n" << daemon.Log();
  DecodeThroughRegion(stream.get(), &tracker, seqs, sh, buf.data() + start, 4);
  EXPECT_TRUE(Close(stream.get()).ok());

  // A second stream may offer the same allocation again once the first has ended.
  auto again = (*c)->OpenDecodeStream();
  st = again->OpenCudaRegion(handle, 0, start + bytes);
  ASSERT_TRUE(st.ok()) << st;
  DecodeThroughRegion(again.get(), &tracker, seqs, sh, buf.data(), 1);
  EXPECT_TRUE(Close(again.get()).ok());
}

TEST(CudaRegionTest, RefusedHandlesAndRangesNameTheFieldAndTheDaemonServesOn) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  Daemon daemon(CudaFlags());
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  const client::Shape sh = (*c)->shape();
  const SlotLayout lay(sh, 0, 256);
  DeviceBuffer buf(lay.slot * 12);
  ASSERT_NE(buf.data(), nullptr);
  const std::string handle = buf.Handle();
  ASSERT_EQ(handle.size(), 64u);

  std::mt19937 rng(7);
  std::string garbage(64, '\0');
  for (char& ch : garbage) ch = static_cast<char>(rng());
  struct Case {
    std::string handle;
    uint64_t offset, bytes;
    const char* names;
  };
  const Case cases[] = {
      {garbage, 0, 4096, "open_cuda_region.ipc_handle: cudaIpcOpenMemHandle"},
      {std::string(64, '\0'), 0, 4096, "open_cuda_region.ipc_handle"},
      {handle, 0, lay.slot * 12 + 1, "allocation's"},
      {handle, lay.slot * 12, 1, "allocation's"},
      {handle, ~uint64_t{0} - 10, 4096, "allocation's"},
  };
  for (const Case& k : cases) {
    auto stream = (*c)->OpenDecodeStream();
    absl::Status st = stream->OpenCudaRegion(k.handle, k.offset, k.bytes);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << k.names << ": " << st;
    EXPECT_NE(std::string(st.message()).find(k.names), std::string::npos) << st;
  }

  // Steps past the region fail INVALID_ARGUMENT and write nothing; then the region
  // serves correct results, and so does a byte stream.
  std::vector<std::string> seqs;
  for (int i = 0; i < 3; ++i) {
    auto s = tracker.NewSequence({50 + 20 * i, 64});
    ASSERT_TRUE(s.ok()) << s.status();
    seqs.push_back(*s);
  }
  auto stream = (*c)->OpenDecodeStream();
  ASSERT_TRUE(stream->OpenCudaRegion(handle, 0, lay.slot * 12).ok());
  v1::DecodeRequest bad;
  v1::DecodeStep* s = bad.add_steps();
  *s = tracker.Step(seqs[0], 0, 1, false);
  s->clear_q();
  s->clear_kv();
  s->mutable_region()->set_s_q(1);
  s->mutable_region()->set_q_offset(lay.slot * 12 - 2);
  ASSERT_TRUE(stream->Write(bad));
  v1::DecodeResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  ASSERT_EQ(resp.results_size(), 1);
  EXPECT_EQ(resp.results(0).code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(resp.results(0).message().find("region.q_offset"), std::string::npos) << resp.results(0).message();
  tracker.Refused(resp.results(0).request_id());
  DecodeThroughRegion(stream.get(), &tracker, seqs, sh, buf.data(), 2);
  EXPECT_TRUE(Close(stream.get()).ok());
}

}  // namespace
}  // namespace latentd::testing

namespace latentd::testing {
namespace {

// A doorbell ring beside a CUDA region (DecodeRequest.region_ring_entries with
// open_cuda_region): the ring is a host file of its own, the tensors stay in device
// memory from offset 0 on; results are checked in place, a step past the region fails on
// its completion only, and a second stream gets a ring again after the first ended.
TEST(CudaRegionTest, DoorbellRingBesideDeviceMemoryMatchesTheCpuImplementation) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  std::vector<std::string> flags = CudaFlags();
  flags.push_back("--max_rings=1");
  Daemon daemon(flags);
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  const client::Shape sh = (*c)->shape();
  const SlotLayout lay(sh, 0, 256);
  std::vector<std::string> seqs;
  for (int i = 0; i < 5; ++i) {
    auto s = tracker.NewSequence({30 + 41 * i, 64 * i + 1});
    ASSERT_TRUE(s.ok()) << s.status();
    seqs.push_back(*s);
  }
  constexpr int kSteps = 12;
  constexpr uint32_t kEntries = 16;
  DeviceBuffer buf(lay.slot * kSteps);
  ASSERT_NE(buf.data(), nullptr);
  const std::string handle = buf.Handle();
  ASSERT_EQ(handle.size(), 64u);
  for (int pass = 0; pass < 2; ++pass) {  // the second stream: the first one's ring was given back
    auto stream = (*c)->OpenDecodeStream();
    auto ring_file = stream->OpenCudaRegionWithRing(handle, 0, lay.slot * kSteps, kEntries);
    // The first stream's ring is given back as its reactor goes, just after the client
    // has its status (--max_rings=1): the second stream may have to ask again.
    for (int attempt = 0; pass == 1 && !ring_file.ok() && attempt < 50; ++attempt) {
      ASSERT_EQ(ring_file.status().code(), absl::StatusCode::kResourceExhausted) << ring_file.status();
      absl::SleepFor(absl::Milliseconds(20));
      stream = (*c)->OpenDecodeStream();
      ring_file = stream->OpenCudaRegionWithRing(handle, 0, lay.slot * kSteps, kEntries);
    }
    ASSERT_TRUE(ring_file.ok()) << ring_file.status() << "\n" << daemon.Log();
    ASSERT_EQ((*ring_file)->size(), ring::RingBytes(kEntries));
    client::Ring ring(ring_file->get(), kEntries);
    for (int round = 0; round < 3; ++round) {
      std::vector<v1::DecodeStep> steps(kSteps);
      std::vector<client::Ring::Step> rs(kSteps);
      std::map<uint64_t, int> slot_of;
      // A step whose out runs past the region (the last on its sequence and layer).
      const int bad = round == 1 ? kSteps - 1 : -1;
      for (int i = 0; i < kSteps; ++i) {
        steps[i] = tracker.Step(seqs[i % seqs.size()], (i / 6 + round) % 2, 1 + (i + round) % 2, i % 3 == 0);
        const int s_q = static_cast<int>(steps[i].q().size() / sh.q_row_bytes);
        char* slot = buf.data() + lay.slot * i;
        ASSERT_EQ(cudaMemcpy(slot + lay.q, steps[i].q().data(), steps[i].q().size(), cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpy(slot + lay.kv, steps[i].kv().data(), steps[i].kv().size(), cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_EQ(cudaMemset(slot + lay.out, 0xff, (lay.lse - lay.out) + sh.LseBytes(s_q)),
                  cudaSuccess);
        client::Ring::Step& r = rs[i];
        r.request_id = steps[i].request_id();
        r.sequence_id = steps[i].sequence_id();
        r.layer = steps[i].layer();
        r.s_q = static_cast<uint32_t>(s_q);
        r.causal = steps[i].causal();
        r.trace = i == 0;
        r.q_offset = lay.slot * i + lay.q;
        r.kv_offset = lay.slot * i + lay.kv;
        r.out_offset = i == bad ? lay.slot * kSteps - 2 : lay.slot * i + lay.out;
        r.lse_offset = lay.slot * i + lay.lse;
        slot_of[r.request_id] = i;
      }
      ASSERT_TRUE(ring.Submit(rs.data(), rs.size()).ok());
      std::vector<client::Ring::Completion> done;
      absl::Status w = ring.Wait(kSteps, &done, absl::Seconds(60));
      ASSERT_TRUE(w.ok()) << w << "\n" << daemon.Log();
      ASSERT_EQ(done.size(), static_cast<size_t>(kSteps));
      for (const client::Ring::Completion& d : done) {
        auto it = slot_of.find(d.request_id);
        ASSERT_NE(it, slot_of.end());
        const int i = it->second;
        if (i == bad) {
          EXPECT_EQ(d.code, static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
          EXPECT_NE(d.message.find("region.out_offset"), std::string::npos) << d.message;
          tracker.Refused(d.request_id);
          continue;
        }
        ASSERT_EQ(d.code, 0) << d.message;
        EXPECT_EQ(d.has_timing, i == 0);
        const int s_q = static_cast<int>(rs[i].s_q);
        const char* slot = buf.data() + lay.slot * i;
        v1::StepResult r;
        r.set_request_id(d.request_id);
        std::string out(sh.OutBytes(s_q), '\0'), lse(sh.LseBytes(s_q), '\0');
        ASSERT_EQ(cudaMemcpy(out.data(), slot + lay.out, out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(lse.data(), slot + lay.lse, lse.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        r.set_out(out);
        r.set_lse(lse);
        ASSERT_TRUE(tracker.Check(r).ok()) << "pass " << pass << " round " << round << ": " << tracker.Check(r);
      }
    }
    EXPECT_TRUE(Close(stream.get()).ok());
  }
}

}  // namespace
}  // namespace latentd::testing
