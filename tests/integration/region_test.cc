// The same-host data plane against the real daemon (CPU backend, another process): a
// stream's shared region carries q/kv in and out/lse back, checked against the CPU
// implementation; bad offsets fail INVALID_ARGUMENT and touch nothing; region sizes are
// bounded; the daemon drops its mapping when the stream ends.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "clients/cpp/client.h"
#include "proto/handoff.h"
#include "proto/ring.h"
#include "tests/integration/daemon.h"
#include "tests/integration/region_slots.h"
#include "tests/integration/tracker.h"

namespace latentd::testing {
namespace {

int CountRegionMappings(pid_t pid) {
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  std::string line;
  int n = 0;
  while (std::getline(maps, line)) n += absl::StrContains(line, "latentd-region") ? 1 : 0;
  return n;
}

TEST(RegionTest, StepsThroughTheRegionMatchTheCpuImplementation) {
  // Regions by /proc path, and a dumpable daemon: its /proc/<pid>/maps stays readable to
  // this test when it does not run as root (and the older clients' path stays covered).
  Daemon daemon({"--num_layers=2", "--num_heads_q=32", "--data_plane_proc_paths"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  const client::Shape sh = (*c)->shape();
  const SlotLayout lay(sh);
  std::vector<std::string> seqs;
  for (int i = 0; i < 6; ++i) {
    auto s = tracker.NewSequence({10 + 37 * i, 64 * i});
    ASSERT_TRUE(s.ok()) << s.status();
    seqs.push_back(*s);
  }
  auto stream = (*c)->OpenDecodeStream();
  auto region = stream->OpenRegion(lay.slot * 12);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(CountRegionMappings(daemon.pid()), 1);
  for (int round = 0; round < 4; ++round) {
    v1::DecodeRequest req;
    std::map<uint64_t, int> slot_of;
    for (int i = 0; i < 12; ++i) {
      v1::DecodeStep* s = req.add_steps();
      *s = tracker.Step(seqs[i % 6], (i / 6 + round) % 2, 1 + (i + round) % 2, i % 3 == 0);
      if (i % 4 != 3) {  // a few steps stay on the bytes path, in the same message
        IntoSlot(s, sh, lay, (*region)->data(), i);
        slot_of[s->request_id()] = i;
      }
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
          const char* base = (*region)->data() + lay.slot * it->second;
          const int s_q = req.steps(it->second).region().s_q();
          r.set_out(std::string(base + lay.out, sh.OutBytes(s_q)));
          r.set_lse(std::string(base + lay.lse, sh.LseBytes(s_q)));
        }
        ASSERT_TRUE(tracker.Check(r).ok()) << "round " << round << ": " << tracker.Check(r);
      }
    }
    ASSERT_EQ(got, 12);
  }
  stream->WritesDone();
  v1::DecodeResponse extra;
  EXPECT_FALSE(stream->Read(&extra));
  EXPECT_TRUE(stream->Finish().ok());
  // The daemon's mapping went with the stream.
  for (int i = 0; i < 100 && CountRegionMappings(daemon.pid()) != 0; ++i) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(CountRegionMappings(daemon.pid()), 0);
}

// Only the stream's own client gets its region: the answer names no path, only a
// one-time ticket for the daemon's handoff socket. This process, holding neither the
// bearer token nor a stream, gets nothing for a wrong ticket or a used one, and cannot
// list the daemon's descriptors in /proc (unless it runs as root, which may).
TEST(RegionTest, OnlyTheStreamsClientGetsItsRegion) {
  Daemon daemon({"--num_layers=1", "--auth_token=region-test-token"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  client::ClientOptions options;
  options.auth_token = "region-test-token";
  auto c = daemon.Connect(options);
  ASSERT_TRUE(c.ok()) << c.status();
  auto stream = (*c)->OpenDecodeStream();
  v1::DecodeRequest req;
  req.set_open_region_bytes(1 << 16);
  ASSERT_TRUE(stream->Write(req));
  v1::DecodeResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  ASSERT_TRUE(resp.has_region());
  const v1::SharedRegion& region = resp.region();
  EXPECT_TRUE(region.path().empty()) << region.path();
  ASSERT_EQ(region.ticket().size(), handoff::kTicketBytes);
  ASSERT_FALSE(region.handoff_socket().empty());

  std::string wrong = region.ticket();
  wrong[3] ^= 0x10;
  EXPECT_EQ(handoff::CollectFd(region.handoff_socket(), wrong).status().code(),
            absl::StatusCode::kPermissionDenied);
  absl::StatusOr<int> fd = handoff::CollectFd(region.handoff_socket(), region.ticket());
  ASSERT_TRUE(fd.ok()) << fd.status();
  struct stat st;
  ASSERT_EQ(fstat(*fd, &st), 0);
  EXPECT_EQ(st.st_size, 1 << 16);  // the region's file
  close(*fd);
  EXPECT_EQ(handoff::CollectFd(region.handoff_socket(), region.ticket()).status().code(),
            absl::StatusCode::kPermissionDenied);  // a ticket works once

  const std::string fds = absl::StrCat("/proc/", daemon.pid(), "/fd");
  if (geteuid() == 0) {
    std::cerr << "running as root, which may read any process's " << fds << "; that part is not checked\n";
  } else {
    DIR* d = opendir(fds.c_str());
    EXPECT_EQ(d, nullptr) << fds << " is readable to another process of the daemon's user";
    if (d != nullptr) closedir(d);
  }
  EXPECT_TRUE(Close(stream.get()).ok());
}

TEST(RegionTest, BadOffsetsFailWithTheFieldAndTouchNothing) {
  Daemon daemon({"--num_layers=1"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  Tracker tracker(c->get());
  const client::Shape sh = (*c)->shape();
  const SlotLayout lay(sh);
  auto seq = tracker.NewSequence({70});
  ASSERT_TRUE(seq.ok());

  // A region step on a stream without a region.
  {
    auto stream = (*c)->OpenDecodeStream();
    v1::DecodeRequest req;
    *req.add_steps() = tracker.Step(*seq, 0);
    req.mutable_steps(0)->clear_q();
    req.mutable_steps(0)->clear_kv();
    req.mutable_steps(0)->mutable_region()->set_s_q(1);
    tracker.Refused(req.steps(0).request_id());
    ASSERT_TRUE(stream->Write(req));
    v1::DecodeResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    ASSERT_EQ(resp.results_size(), 1);
    EXPECT_EQ(resp.results(0).code(), 3);
    EXPECT_NE(resp.results(0).message().find("open_region_bytes"), std::string::npos) << resp.results(0).message();
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }

  auto stream = (*c)->OpenDecodeStream();
  const uint64_t bytes = lay.slot * 2;
  auto region = stream->OpenRegion(bytes);
  ASSERT_TRUE(region.ok()) << region.status();
  std::memset((*region)->data(), 0x5a, bytes);
  struct Bad {
    const char* field;
    void (*mutate)(v1::RegionTensors*, uint64_t bytes);
  };
  const Bad bad[] = {
      {"region.q_offset", [](v1::RegionTensors* r, uint64_t b) { r->set_q_offset(b - 2); }},
      {"region.kv_offset", [](v1::RegionTensors* r, uint64_t) { r->set_kv_offset(~uint64_t{0} - 7); }},
      {"region.out_offset", [](v1::RegionTensors* r, uint64_t b) { r->set_out_offset(b); }},
      {"region.out_offset", [](v1::RegionTensors* r, uint64_t) { r->set_out_offset(1); }},
      {"region.lse_offset", [](v1::RegionTensors* r, uint64_t) { r->set_lse_offset(6); }},
      {"region.lse_offset", [](v1::RegionTensors* r, uint64_t b) { r->set_lse_offset(b - 4); }},
      {"region.s_q", [](v1::RegionTensors* r, uint64_t) { r->set_s_q(0); }},
      {"region.s_q", [](v1::RegionTensors* r, uint64_t) { r->set_s_q(1u << 31); }},
  };
  for (const Bad& b : bad) {
    v1::DecodeRequest req;
    v1::DecodeStep s = tracker.Step(*seq, 0);
    tracker.Refused(s.request_id());
    s.clear_q();
    s.clear_kv();
    v1::RegionTensors* r = s.mutable_region();
    r->set_s_q(1);
    r->set_q_offset(lay.q);
    r->set_kv_offset(lay.kv);
    r->set_out_offset(lay.out);
    r->set_lse_offset(lay.lse);
    b.mutate(r, bytes);
    *req.add_steps() = s;
    ASSERT_TRUE(stream->Write(req));
    v1::DecodeResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    ASSERT_EQ(resp.results_size(), 1);
    EXPECT_EQ(resp.results(0).code(), 3) << b.field;
    EXPECT_NE(resp.results(0).message().find(b.field), std::string::npos) << resp.results(0).message();
  }
  {  // q bytes beside a region
    v1::DecodeRequest req;
    v1::DecodeStep s = tracker.Step(*seq, 0);
    tracker.Refused(s.request_id());
    s.mutable_region()->set_s_q(1);
    *req.add_steps() = s;
    ASSERT_TRUE(stream->Write(req));
    v1::DecodeResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    EXPECT_EQ(resp.results(0).code(), 3);
    EXPECT_NE(resp.results(0).message().find("expected empty when region is set"), std::string::npos);
  }
  for (uint64_t i = 0; i < bytes; ++i)
    ASSERT_EQ(static_cast<unsigned char>((*region)->data()[i]), 0x5a) << "byte " << i << " was written";
  auto info = (*c)->GetSequence(*seq);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->lengths(0), 70) << "a refused step appended rows";

  // A second region on the same stream ends it.
  v1::DecodeRequest again;
  again.set_open_region_bytes(4096);
  ASSERT_TRUE(stream->Write(again));
  v1::DecodeResponse resp;
  while (stream->Read(&resp)) {
  }
  grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("already has a shared region"), std::string::npos) << st.error_message();
  EXPECT_TRUE(daemon.Running());
}

TEST(RegionTest, RegionSizesAreBounded) {
  Daemon daemon({"--max_region_bytes=1048576", "--max_region_total_bytes=1572864"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  {
    auto stream = (*c)->OpenDecodeStream();
    auto region = stream->OpenRegion(2 << 20);
    ASSERT_FALSE(region.ok());
    EXPECT_EQ(region.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(region.status().message().find("--max_region_bytes"), std::string::npos) << region.status();
  }
  auto first = (*c)->OpenDecodeStream();
  auto r1 = first->OpenRegion(1 << 20);
  ASSERT_TRUE(r1.ok()) << r1.status();
  {
    auto second = (*c)->OpenDecodeStream();
    auto r2 = second->OpenRegion(1 << 20);
    ASSERT_FALSE(r2.ok());
    EXPECT_EQ(r2.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(r2.status().message().find("--max_region_total_bytes"), std::string::npos) << r2.status();
  }
  // Once the first stream ends, its bytes are free again.
  EXPECT_TRUE(Close(first.get()).ok());
  r1->reset();
  bool opened = false;
  for (int i = 0; i < 50 && !opened; ++i) {
    auto third = (*c)->OpenDecodeStream();
    auto r3 = third->OpenRegion(1 << 20);
    opened = r3.ok();
    if (opened) {
      EXPECT_TRUE(Close(third.get()).ok());
    } else {
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  EXPECT_TRUE(opened);
}

// A CUDA region (open_cuda_region) asked of this CPU daemon, and malformed ones: each
// ends the stream with the field named, and the daemon keeps serving.
grpc::Status OpenCudaRegionStatus(client::Client* c, const std::string& handle, uint64_t bytes,
                                  bool also_host_region = false, uint32_t ring_entries = 0) {
  auto stream = c->OpenDecodeStream();
  v1::DecodeRequest req;
  req.mutable_open_cuda_region()->set_ipc_handle(handle);
  req.mutable_open_cuda_region()->set_bytes(bytes);
  if (also_host_region) req.set_open_region_bytes(4096);
  req.set_region_ring_entries(ring_entries);
  stream->Write(req);
  return Close(stream.get());
}

TEST(RegionTest, CudaRegionsAreRefusedWithTheField) {
  Daemon daemon({"--max_region_bytes=1048576", "--max_rings=1"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto c = daemon.Connect();
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string handle(64, '\x5a');
  // Run on a GPU host with LATENTD_DAEMON_FLAGS=--backend=cuda, the daemon can open
  // handles: this one is then refused by the driver instead of by the backend.
  const bool cpu = absl::StartsWith((*c)->info().backend(), "cpu");
  const grpc::StatusCode refused = cpu ? grpc::StatusCode::FAILED_PRECONDITION : grpc::StatusCode::INVALID_ARGUMENT;
  const char* refused_names = cpu ? "CPU backend" : "open_cuda_region.ipc_handle: cudaIpcOpenMemHandle";
  struct Case {
    std::string handle;
    uint64_t bytes;
    bool both;
    grpc::StatusCode code;
    const char* names;
  };
  const Case cases[] = {
      {handle, 4096, false, refused, refused_names},
      {std::string(63, 'x'), 4096, false, grpc::StatusCode::INVALID_ARGUMENT, "open_cuda_region.ipc_handle: 63 bytes"},
      {std::string(65, 'x'), 4096, false, grpc::StatusCode::INVALID_ARGUMENT, "open_cuda_region.ipc_handle: 65 bytes"},
      {std::string(1 << 16, 'x'), 4096, false, grpc::StatusCode::INVALID_ARGUMENT, "ipc_handle: 65536 bytes"},
      {handle, 0, false, grpc::StatusCode::INVALID_ARGUMENT, "open_cuda_region.bytes: 0"},
      {handle, 2 << 20, false, grpc::StatusCode::RESOURCE_EXHAUSTED, "--max_region_bytes"},
      {handle, 4096, true, grpc::StatusCode::INVALID_ARGUMENT, "open_region_bytes, open_cuda_region"},
  };
  for (const Case& k : cases) {
    grpc::Status st = OpenCudaRegionStatus(c->get(), k.handle, k.bytes, k.both);
    EXPECT_EQ(st.error_code(), k.code) << k.names << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(k.names), std::string::npos) << st.error_message();
  }
  // With a doorbell ring (its own host file beside the device region): refused the same
  // way, a bad ring size first; each refusal gives the ring back (--max_rings=1).
  for (int i = 0; i < 3; ++i) {
    grpc::Status st = OpenCudaRegionStatus(c->get(), handle, 4096, false, 16);
    EXPECT_EQ(st.error_code(), refused) << st.error_message();
    EXPECT_NE(st.error_message().find(refused_names), std::string::npos) << st.error_message();
    st = OpenCudaRegionStatus(c->get(), handle, 4096, false, 3);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("region_ring_entries: 3"), std::string::npos) << st.error_message();
  }
  {
    auto ringed = (*c)->OpenDecodeStream();
    auto r = ringed->OpenRegion(ring::RingBytes(16) + 4096, 16);
    EXPECT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(Close(ringed.get()).ok());
  }
  // The client API says the same, and a byte stream of the same client still decodes.
  auto stream = (*c)->OpenDecodeStream();
  absl::Status st = stream->OpenCudaRegion(handle, 0, 4096);
  EXPECT_EQ(static_cast<int>(st.code()), static_cast<int>(refused)) << st;
  Tracker tracker(c->get());
  auto seq = tracker.NewSequence({70});
  ASSERT_TRUE(seq.ok()) << seq.status();
  auto good = (*c)->OpenDecodeStream();
  v1::DecodeRequest req;
  *req.add_steps() = tracker.Step(*seq, 0, 1, false);
  ASSERT_TRUE(good->Write(req));
  v1::DecodeResponse resp;
  ASSERT_TRUE(good->Read(&resp));
  ASSERT_EQ(resp.results_size(), 1);
  EXPECT_TRUE(tracker.Check(resp.results(0)).ok()) << tracker.Check(resp.results(0));
  EXPECT_TRUE(Close(good.get()).ok());
}

}  // namespace
}  // namespace latentd::testing
