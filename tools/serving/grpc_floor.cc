// The gRPC floor under latentd's byte path: an echo over the same transport (callback
// server, raw ByteBuffers, bidi streams on loopback TCP) with nothing else on it, so a
// round trip of the daemon can be compared with what gRPC alone costs for its sizes.
// Run it twice: `grpc_floor --serve --port_file=F` and `grpc_floor --target=...`.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "server/lock_order.h"
#include "tools/serving/transport.h"

ABSL_FLAG(bool, serve, false, "run the echo server (else the client)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "server: listen address");
ABSL_FLAG(std::string, port_file, "", "server: write the bound port here");
ABSL_FLAG(std::string, target, "127.0.0.1:50052", "client: server address");
ABSL_FLAG(int, streams, 1, "client: concurrent bidi streams, one thread each");
ABSL_FLAG(int, connections, 1, "client: TCP connections the streams are spread over");
ABSL_FLAG(int64_t, request_bytes, 1 << 20, "client: bytes per request message");
ABSL_FLAG(int64_t, response_bytes, 1 << 20, "client: bytes per response message");
ABSL_FLAG(int, messages, 200, "client: round trips per stream (the first 10% are warm-up)");
ABSL_FLAG(int64_t, window_bytes, 0, "TransportOptions::stream_window_bytes on this side (0: gRPC's default)");
ABSL_FLAG(int, max_frame_bytes, 0, "TransportOptions::max_frame_bytes (0: gRPC's default)");
ABSL_FLAG(int, bdp_probe, -1, "TransportOptions::bdp_probe (-1: gRPC's default)");
ABSL_FLAG(int, read_chunk_bytes, 0, "TransportOptions min and max read chunk (0: gRPC's default)");
ABSL_FLAG(int, write_buffer_bytes, 0, "TransportOptions::write_buffer_bytes (0: gRPC's default)");

namespace latentd::tools {
namespace {

using Clock = std::chrono::steady_clock;

server::TransportOptions Transport() {
  server::TransportOptions t;
  t.stream_window_bytes = absl::GetFlag(FLAGS_window_bytes);
  t.max_frame_bytes = absl::GetFlag(FLAGS_max_frame_bytes);
  t.bdp_probe = absl::GetFlag(FLAGS_bdp_probe);
  t.min_read_chunk_bytes = t.max_read_chunk_bytes = absl::GetFlag(FLAGS_read_chunk_bytes);
  t.write_buffer_bytes = absl::GetFlag(FLAGS_write_buffer_bytes);
  return t;
}

std::string Describe(const server::TransportOptions& t) {
  return absl::StrCat("window ", t.stream_window_bytes, " frame ", t.max_frame_bytes, " bdp ", t.bdp_probe,
                      " read_chunk ", t.max_read_chunk_bytes, " write_buffer ", t.write_buffer_bytes);
}

// Echo: answers each request with a response of the size the request's first 8 bytes
// name, from one preallocated slice (gRPC references it; nothing is copied per message).
class EchoReactor final : public grpc::ServerGenericBidiReactor {
 public:
  EchoReactor() { StartRead(&in_); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    int64_t want = 0;
    std::vector<grpc::Slice> slices;
    // The first 8 bytes may span slices (a unix socket's reads split them anywhere).
    if (in_.Dump(&slices).ok()) {
      size_t got = 0;
      for (const grpc::Slice& sl : slices) {
        const size_t n = std::min(sizeof(want) - got, sl.size());
        std::memcpy(reinterpret_cast<char*>(&want) + got, sl.begin(), n);
        got += n;
        if (got == sizeof(want)) break;
      }
    }
    want = std::clamp<int64_t>(want, 1, int64_t{256} << 20);
    if (static_cast<int64_t>(payload_.size()) != want) payload_ = grpc::Slice(static_cast<size_t>(want));
    grpc::Slice ref = payload_;
    out_ = grpc::ByteBuffer(&ref, 1);
    StartWrite(&out_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::CANCELLED);
      return;
    }
    StartRead(&in_);
  }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer in_, out_;
  grpc::Slice payload_;
};

class EchoService final : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new EchoReactor();
  }
};

int Serve() {
  EchoService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  server::ApplyTransport(Transport(), &builder);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> srv = builder.BuildAndStart();
  const bool unix_socket = absl::StartsWith(absl::GetFlag(FLAGS_listen), "unix:");
  if (srv == nullptr || (port == 0 && !unix_socket)) return 1;
  if (const std::string pf = absl::GetFlag(FLAGS_port_file); !pf.empty()) {
    std::ofstream(pf + ".tmp") << port << "\n";
    std::rename((pf + ".tmp").c_str(), pf.c_str());
  }
  std::printf("grpc_floor serving on port %d (%s)\n", port, Describe(Transport()).c_str());
  std::fflush(stdout);
  srv->Wait();
  return 0;
}

void* Tag(int i) { return reinterpret_cast<void*>(static_cast<intptr_t>(i)); }

std::vector<double> Fail(const char* what, std::vector<double> v) {
  std::fprintf(stderr, "grpc_floor: %s failed\n", what);
  return v;
}

// One stream's round trips on a completion queue of its own (as a sync client would).
// Returns the measured round trips in microseconds; empty on a failure.
std::vector<double> RunStream(grpc::GenericStub* stub, int messages, int64_t req_bytes, int64_t resp_bytes) {
  std::vector<double> rtt;
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  auto call = stub->PrepareCall(&ctx, "/latentd.floor.Echo/Echo", &cq);
  void* got = nullptr;
  bool ok = false;
  call->StartCall(Tag(1));
  if (!cq.Next(&got, &ok) || !ok) return Fail("start", rtt);
  grpc::Slice payload(static_cast<size_t>(req_bytes));
  std::memcpy(const_cast<uint8_t*>(payload.begin()), &resp_bytes, std::min<int64_t>(8, req_bytes));
  const int warm = messages / 10;
  for (int m = 0; m < messages; ++m) {
    grpc::Slice ref = payload;
    grpc::ByteBuffer out(&ref, 1), in;
    const auto t0 = Clock::now();
    call->Write(out, Tag(2));
    if (!cq.Next(&got, &ok) || !ok) return Fail("write", {});
    call->Read(&in, Tag(3));
    if (!cq.Next(&got, &ok) || !ok) return Fail("read", {});
    const auto t1 = Clock::now();
    if (static_cast<int64_t>(in.Length()) != resp_bytes) return Fail("response size", {});
    if (m >= warm) rtt.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  call->WritesDone(Tag(4));
  cq.Next(&got, &ok);
  grpc::Status st;
  call->Finish(&st, Tag(5));
  cq.Next(&got, &ok);
  return rtt;
}

int Client() {
  const int streams = std::max(1, absl::GetFlag(FLAGS_streams));
  const int conns = std::clamp(absl::GetFlag(FLAGS_connections), 1, streams);
  const int64_t req = std::max<int64_t>(8, absl::GetFlag(FLAGS_request_bytes));
  const int64_t resp = std::max<int64_t>(1, absl::GetFlag(FLAGS_response_bytes));
  const int messages = std::max(10, absl::GetFlag(FLAGS_messages));
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  for (int c = 0; c < conns; ++c) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a TCP connection each
    server::ApplyTransport(Transport(), &args);
    stubs.push_back(std::make_unique<grpc::GenericStub>(grpc::CreateCustomChannel(
        absl::GetFlag(FLAGS_target), grpc::InsecureChannelCredentials(), args)));
  }
  std::vector<std::vector<double>> per(streams);
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int s = 0; s < streams; ++s)
    threads.emplace_back([&, s] { per[s] = RunStream(stubs[s % conns].get(), messages, req, resp); });
  for (auto& t : threads) t.join();
  const double wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<double> all;
  for (int s = 0; s < streams; ++s) {
    if (per[s].empty()) {
      std::fprintf(stderr, "grpc_floor: stream %d failed\n", s);
      return 1;
    }
    all.insert(all.end(), per[s].begin(), per[s].end());
  }
  std::sort(all.begin(), all.end());
  auto pct = [&](double p) { return all[std::min(all.size() - 1, static_cast<size_t>(p * all.size()))]; };
  const double rate = static_cast<double>(streams) * messages / wall_s;
  std::printf(
      "grpc_floor: %d streams on %d connections, %lld B up / %lld B down, %s: round trip p50 %.1f  p90 %.1f  "
      "p99 %.1f us; %.0f round trips/s; %.2f GB/s each way at p50\n",
      streams, conns, static_cast<long long>(req), static_cast<long long>(resp), Describe(Transport()).c_str(),
      pct(0.5), pct(0.9), pct(0.99), rate, static_cast<double>(std::max(req, resp)) / (pct(0.5) * 1e3));
  return 0;
}

}  // namespace
}  // namespace latentd::tools

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  latentd::server::SetLockOrderChecks(false);  // server/lock_order.h: a global lock per Mutex::Lock otherwise
  return absl::GetFlag(FLAGS_serve) ? latentd::tools::Serve() : latentd::tools::Client();
}
