// The latentd.v1.DecodeService implementation on gRPC's callback API: unary handlers,
// the AppendKv upload reactor and the Decode bidi reactor. Nothing here blocks a gRPC
// thread: decode steps go to the engine's queue and results are written from the
// engine's StepDone callbacks.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "proto/latentd.grpc.pb.h"

namespace latentd::server {

struct ServiceOptions {
  std::string auth_token;          // empty: no authentication
  int max_s_q = 8;                 // largest s_q a step may carry (as the engine was told)
  int64_t max_message_bytes = 0;   // advertised in ServerInfo
  int max_stream_inflight = 1024;  // steps one Decode stream may have unanswered
  int64_t max_response_bytes = 2 << 20;  // coalesced results per DecodeResponse (soft cap)
  std::string version;
};

// Maps an absl::Status onto the gRPC status with the same code and message.
grpc::Status ToGrpc(const absl::Status& status);

// Sequence ids are 1..128 characters from [A-Za-z0-9._:-]. Empty ids are checked by
// callers since some RPCs accept them (server-chosen id).
bool IsValidSequenceId(absl::string_view id);

class AppendKvReactor;
class DecodeReactor;

class DecodeServiceImpl final : public latentd::v1::DecodeService::CallbackService {
 public:
  DecodeServiceImpl(engine::Engine* engine, ServiceOptions options);
  ~DecodeServiceImpl() override;

  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* ctx, const v1::GetInfoRequest* request,
                                    v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext* ctx,
                                           const v1::CreateSequenceRequest* request,
                                           v1::CreateSequenceResponse* response) override;
  grpc::ServerReadReactor<v1::AppendKvRequest>* AppendKv(grpc::CallbackServerContext* ctx,
                                                         v1::AppendKvResponse* response) override;
  grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse>* Decode(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ForkSequence(grpc::CallbackServerContext* ctx,
                                         const v1::ForkSequenceRequest* request,
                                         v1::ForkSequenceResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseSequence(grpc::CallbackServerContext* ctx,
                                            const v1::ReleaseSequenceRequest* request,
                                            v1::ReleaseSequenceResponse* response) override;

  // Refuses new work with UNAVAILABLE from now on; open Decode streams stop reading and
  // finish once every step they accepted has been answered.
  void BeginDrain();
  bool draining() const { return draining_.load(std::memory_order_acquire); }
  // Decode streams not yet finished.
  int OpenStreams() const;
  // Step results that the engine produced but no client received (the stream had gone
  // away or its write failed); read by the drain summary.
  uint64_t UndeliveredResults() const;
  // Cancels Decode streams whose client has not taken a response for `stall` (a write
  // pending that long); returns how many. Their unstarted steps are dropped, as when a
  // client goes away.
  int CancelStalledStreams(absl::Duration stall);

  // Fixed per-model sizes, computed once.
  struct Shape {
    int num_layers = 0, h_q = 0, h_kv = 0, max_s_q = 0;
    int64_t q_row_bytes = 0;    // per query token: h_q * 576 * 2
    int64_t kv_row_bytes = 0;   // per token: h_kv * 576 * 2
    int64_t out_row_bytes = 0;  // per query token: h_q * 512 * 2
  };
  const Shape& shape() const { return shape_; }
  const ServiceOptions& options() const { return options_; }
  engine::Engine* engine() const { return engine_; }

  // OK, or UNAUTHENTICATED (counted and logged, see server/auth.h) when a token is
  // configured and the call lacks it.
  grpc::Status CheckAuth(const grpc::CallbackServerContext* ctx) const;

 private:
  friend class AppendKvReactor;
  friend class DecodeReactor;
  void Register(DecodeReactor* reactor);
  void Unregister(DecodeReactor* reactor);
  // Calls fn on every open Decode stream, outside streams_mu_, each kept alive meanwhile.
  template <typename Fn>
  void ForEachOpenStream(Fn fn);
  // AppendKv messages are applied on the upload thread, not on gRPC's: the copy into the
  // KV pool runs under the engine's KV lock and takes milliseconds for a large message.
  void EnqueueUpload(AppendKvReactor* reactor);
  void UploadLoop();

  engine::Engine* const engine_;
  const ServiceOptions options_;
  Shape shape_;
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> streams_opened_{0};
  std::atomic<uint64_t> undelivered_results_{0};  // see UndeliveredResults()

  // Touched once per stream (open, close, drain), never per step.
  mutable absl::Mutex streams_mu_;
  absl::flat_hash_set<DecodeReactor*> streams_ ABSL_GUARDED_BY(streams_mu_);

  absl::Mutex upload_mu_;
  std::deque<AppendKvReactor*> uploads_ ABSL_GUARDED_BY(upload_mu_);  // each with one message read
  bool stop_uploads_ ABSL_GUARDED_BY(upload_mu_) = false;
  std::thread uploader_;  // last member: started once the rest is built
};

}  // namespace latentd::server
