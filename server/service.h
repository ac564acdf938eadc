// The latentd.v1.DecodeService implementation on gRPC's callback API: unary handlers,
// the AppendKv upload reactor and the Decode bidi reactor. Nothing here blocks a gRPC
// thread: decode steps go to the engine's queue and results are written from the
// engine's StepDone callbacks. Every resource a client can make the server hold is
// bounded by a ServiceOptions field (and a daemon flag of the same name).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "server/dataplane/fd_handoff.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/latentd.grpc.pb.h"
#include "server/decode/admission.h"
#include "server/decode/step_shape.h"

namespace latentd::server {

struct ServiceOptions {
  std::string auth_token;          // empty: no authentication
  // --model_dir's tensor parallelism, reported in ServerInfo (the engine holds only this
  // rank's heads).
  int tensor_parallel = 1;
  int tensor_rank = 0;
  int max_s_q = 8;                 // largest s_q a step may carry (as the engine was told)
  int64_t max_message_bytes = 0;   // advertised in ServerInfo
  // Steps one DecodeRequest may hold; counted before any step is copied.
  int max_steps_per_message = 1024;
  // Steps one Decode stream may have in the engine at once. A message's steps beyond it
  // wait in the stream (at most max_steps_per_message of them), and the stream is not
  // read again until they have all gone in: flow control then holds the client back.
  int max_stream_inflight = 1024;
  // Step buffers (inputs and results) held for all streams together; steps beyond it
  // fail RESOURCE_EXHAUSTED.
  int64_t max_inflight_bytes = int64_t{2} << 30;
  // Decode and AppendKv streams open at once, over all clients.
  int max_streams = 4096;
  // AppendKv message bytes received and not yet applied, over all streams.
  int64_t max_upload_bytes = int64_t{256} << 20;
  int64_t max_response_bytes = 2 << 20;  // coalesced results per DecodeResponse (soft cap)
  // Same-host data plane: bytes of one stream's shared region, and of all streams'
  // regions together (memory the daemon maps for clients).
  int64_t max_region_bytes = int64_t{1} << 30;
  int64_t max_region_total_bytes = int64_t{8} << 30;
  // Doorbell rings (DecodeRequest.region_ring_entries): rings open at once over all
  // streams (each has a thread of the daemon polling it while the stream lasts), and how
  // long that thread spins on an idle ring before it sleeps on its futex (a sleeping
  // ring costs the client a futex wake per submission, and 20-30 us of wake-up).
  // Where region files go to their stream's client (SharedRegion.ticket), owned by the
  // caller and outliving the service. Null: regions are named by /proc paths instead,
  // which any process of the daemon's user can open (--data_plane_proc_paths).
  dataplane::FdHandoff* handoff = nullptr;
  int max_rings = 64;
  // Of those, rings one connection (gRPC peer) may hold; at most max_rings.
  int max_rings_per_connection = 16;
  int ring_spin_us = 1000;
  // Byte steps' q and kv are read into host memory registered with the engine (CUDA:
  // pinned and mapped), which the device reads directly: no staging copy per step. Costs
  // one registration per step buffer as a stream warms up; counted in max_inflight_bytes.
  // kAlways keeps the buffers even where the engine registers none (the CPU backend),
  // which only tests want: the same path without a GPU.
  enum class PinnedInputs { kOff, kAuto, kAlways };
  PinnedInputs pinned_step_inputs = PinnedInputs::kAuto;
  // Free step buffers a stream keeps once it has had nothing in flight for a while.
  int idle_stream_slots = 8;
  // ExportSequence and ImportSequence streams open at once (each holds one chunk; an
  // import also holds the pages it reserved until it commits or ends), the row bytes
  // per export chunk unless the request asks for fewer, and the most either accepts.
  int max_export_streams = 16;
  int max_import_streams = 16;
  int64_t transfer_chunk_bytes = int64_t{1} << 20;
  int64_t max_transfer_chunk_bytes = int64_t{4} << 20;
  std::string version;
};

// What the service has done and refused, for stats and metrics.
struct ServiceCounters {
  int64_t open_streams = 0;  // Decode streams not yet done
  int64_t open_calls = 0;    // Decode and AppendKv streams not yet done
  int64_t inflight_bytes = 0;
  int64_t upload_bytes = 0;
  // Results of steps the engine accepted: taken by the client's transport, or dropped
  // because the client went away or a write failed.
  uint64_t results_delivered = 0;
  uint64_t results_undelivered = 0;
  uint64_t refused_streams = 0;      // over max_streams
  uint64_t refused_steps_bytes = 0;
  uint64_t refused_messages = 0;     // over max_steps_per_message or malformed
  uint64_t refused_uploads = 0;      // over max_upload_bytes
  int64_t region_bytes = 0;          // shared regions mapped for open streams
  int64_t regions = 0;
  uint64_t refused_regions = 0;      // over max_region_bytes / max_region_total_bytes
  // Steps submitted with q and kv parsed into the stream's pinned-input buffer, and with
  // inputs the device reads in place (registered memory: no host staging copy).
  uint64_t steps_inputs_pinned = 0;
  uint64_t steps_inputs_device_direct = 0;
  int64_t rings = 0;            // doorbell rings open
  uint64_t refused_rings = 0;   // over max_rings
  uint64_t steps_ring = 0;      // steps taken from rings
  int64_t open_exports = 0, open_imports = 0;  // ExportSequence / ImportSequence streams
  uint64_t exports_started = 0;
  uint64_t refused_transfers = 0;  // over max_export_streams / max_import_streams
};

// Maps an absl::Status onto the gRPC status with the same code and message.
grpc::Status ToGrpc(const absl::Status& status);

class AppendKvReactor;
class DecodeReactor;
class ExportReactor;
class ImportReactor;
class TransferWorker;

// Decode and AppendKv are served raw (grpc::ByteBuffer) so that the server, not
// protobuf, decides what a message may make it hold; the other methods are typed (an
// ImportSequence chunk is bounded by --max_message_bytes and held one at a time).
using DecodeServiceBase = v1::DecodeService::WithCallbackMethod_GetInfo<
    v1::DecodeService::WithCallbackMethod_CreateSequence<v1::DecodeService::WithRawCallbackMethod_AppendKv<
        v1::DecodeService::WithRawCallbackMethod_Decode<v1::DecodeService::WithCallbackMethod_ForkSequence<
            v1::DecodeService::WithCallbackMethod_ReleaseSequence<v1::DecodeService::WithCallbackMethod_GetSequence<
                v1::DecodeService::WithCallbackMethod_ExportSequence<
                    v1::DecodeService::WithCallbackMethod_ImportSequence<v1::DecodeService::Service>>>>>>>>>;

class DecodeServiceImpl final : public DecodeServiceBase {
 public:
  DecodeServiceImpl(engine::Engine* engine, ServiceOptions options);
  ~DecodeServiceImpl() override;

  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* ctx, const v1::GetInfoRequest* request,
                                    v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext* ctx,
                                           const v1::CreateSequenceRequest* request,
                                           v1::CreateSequenceResponse* response) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* AppendKv(grpc::CallbackServerContext* ctx,
                                                      grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Decode(grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ForkSequence(grpc::CallbackServerContext* ctx,
                                         const v1::ForkSequenceRequest* request,
                                         v1::ForkSequenceResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseSequence(grpc::CallbackServerContext* ctx,
                                            const v1::ReleaseSequenceRequest* request,
                                            v1::ReleaseSequenceResponse* response) override;
  grpc::ServerUnaryReactor* GetSequence(grpc::CallbackServerContext* ctx, const v1::GetSequenceRequest* request,
                                        v1::SequenceInfo* response) override;
  grpc::ServerWriteReactor<v1::SequenceChunk>* ExportSequence(grpc::CallbackServerContext* ctx,
                                                             const v1::ExportSequenceRequest* request) override;
  grpc::ServerReadReactor<v1::SequenceChunk>* ImportSequence(grpc::CallbackServerContext* ctx,
                                                            v1::ImportSequenceResponse* response) override;

  // Refuses new work with UNAVAILABLE from now on; open Decode streams stop reading and
  // finish once every step they accepted has been answered.
  void BeginDrain();
  bool draining() const { return draining_.load(std::memory_order_acquire); }
  // Decode streams not yet finished.
  int OpenStreams() const;
  // ExportSequence streams open, and started so far (the drain's handoff watches both).
  int OpenExports() const { return static_cast<int>(open_exports_.load(std::memory_order_relaxed)); }
  uint64_t ExportsStarted() const { return exports_started_.load(std::memory_order_relaxed); }
  // Cancels Decode streams whose client has not taken a response for `stall` (a write
  // pending that long); returns how many. Their unstarted steps are dropped, as when a
  // client goes away.
  int CancelStalledStreams(absl::Duration stall);
  // Cancels ImportSequence streams whose client has sent no chunk for `stall` (their
  // reserved pages go back as the stream ends); returns how many.
  int CancelStalledImports(absl::Duration stall);
  // Gives back the spare step buffers of streams with nothing in flight (kept while a
  // stream is busy so that its steady state allocates nothing). Returns buffers freed.
  int TrimIdleStreams();

  // Every reactor holds one as its first member, so that it goes after everything else
  // the reactor does: reactors call into the service until their last line (giving back
  // rings, regions, streams), and one may outlive its OnDone while an engine callback
  // still holds it, so the service's destructor waits until none is left.
  class ReactorHold {
   public:
    explicit ReactorHold(DecodeServiceImpl* service) : service_(service) { service_->AddReactor(); }
    ~ReactorHold() { service_->RemoveReactor(); }
    ReactorHold(const ReactorHold&) = delete;
    ReactorHold& operator=(const ReactorHold&) = delete;

   private:
    DecodeServiceImpl* const service_;
  };

  ServiceCounters Counters() const;
  // Results of steps the engine accepted that no client received (the stream had gone
  // away or its write failed); read by the drain summary.
  uint64_t UndeliveredResults() const { return results_undelivered_.load(std::memory_order_relaxed); }

  // Fixed per-model sizes, computed once.
  using Shape = decode::StepShape;
  const Shape& shape() const { return shape_; }
  const ServiceOptions& options() const { return options_; }
  engine::Engine* engine() const { return engine_; }

  // OK, or UNAUTHENTICATED (counted and logged, see server/auth.h) when a token is
  // configured and the call lacks it.
  grpc::Status CheckAuth(const grpc::CallbackServerContext* ctx) const;

 private:
  friend class AppendKvReactor;
  friend class DecodeReactor;
  friend class ExportReactor;
  friend class ImportReactor;
  // The status a new ExportSequence / ImportSequence stream starts with: auth, the
  // stream limit, and for an import the drain (exports go on while draining). Counts
  // the stream whatever the answer; CloseTransfer, in every reactor's OnDone, gives it
  // back.
  grpc::Status AdmitTransfer(const grpc::CallbackServerContext* ctx, bool import);
  void CloseTransfer(bool import);
  void RegisterImport(ImportReactor* reactor);
  void UnregisterImport(ImportReactor* reactor);
  TransferWorker& transfers();
  void AddReactor();
  void RemoveReactor();
  void Register(DecodeReactor* reactor);
  void Unregister(DecodeReactor* reactor);
  // Counts a new Decode/AppendKv call (every reactor gives it back in OnDone); false
  // when that makes more than max_streams.
  bool OpenCall();
  // The status a new Decode/AppendKv stream starts with: auth, drain, max_streams.
  grpc::Status AdmitStream(const grpc::CallbackServerContext* ctx);
  void CloseCall() { open_calls_.fetch_sub(1, std::memory_order_relaxed); }
  // Charges a new shared region against max_region_total_bytes; false when over it.
  bool ChargeRegion(int64_t bytes);
  void ReleaseRegion(int64_t bytes) {
    region_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
    regions_.fetch_sub(1, std::memory_order_relaxed);
  }
  // Counts a new doorbell ring against max_rings and its connection's (`peer`'s) share,
  // max_rings_per_connection; RESOURCE_EXHAUSTED naming the flag (nothing counted) when
  // over either.
  absl::Status ChargeRing(const std::string& peer);
  void ReleaseRing(const std::string& peer);
  // Calls fn on every open Decode stream, outside streams_mu_, each kept alive meanwhile.
  template <typename Fn>
  void ForEachOpenStream(Fn fn);
  // AppendKv messages are applied on the upload thread, not on gRPC's: the copy into the
  // KV pool takes milliseconds for a large message. False when max_upload_bytes is full.
  bool EnqueueUpload(AppendKvReactor* reactor, int64_t bytes);
  void UploadLoop();

  engine::Engine* const engine_;
  const ServiceOptions options_;
  Shape shape_;
  decode::ByteBudget inflight_;  // step buffers of all streams, against max_inflight_bytes
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> streams_opened_{0};
  std::atomic<int64_t> open_calls_{0};
  std::atomic<int64_t> upload_bytes_{0};
  std::atomic<int64_t> region_bytes_{0}, regions_{0};
  std::atomic<uint64_t> refused_regions_{0};
  std::atomic<uint64_t> steps_inputs_pinned_{0}, steps_inputs_device_direct_{0};
  std::atomic<int64_t> rings_{0};
  absl::Mutex rings_mu_;  // touched once per ring stream
  absl::flat_hash_map<std::string, int> rings_by_peer_ ABSL_GUARDED_BY(rings_mu_);
  std::atomic<uint64_t> refused_rings_{0}, steps_ring_{0};
  std::atomic<uint64_t> results_delivered_{0}, results_undelivered_{0};
  std::atomic<uint64_t> refused_streams_{0}, refused_steps_bytes_{0},
      refused_messages_{0}, refused_uploads_{0};
  std::atomic<int64_t> open_exports_{0}, open_imports_{0};
  std::atomic<uint64_t> exports_started_{0}, refused_transfers_{0};

  // Touched once per stream (open, close, drain, housekeeping), never per step.
  mutable absl::Mutex streams_mu_;
  absl::flat_hash_set<DecodeReactor*> streams_ ABSL_GUARDED_BY(streams_mu_);
  // Open ImportSequence streams, for the stall check (once per stream, never per chunk).
  absl::Mutex imports_mu_;
  absl::flat_hash_set<ImportReactor*> imports_ ABSL_GUARDED_BY(imports_mu_);

  // Reactors alive (ReactorHold); a mutex, not an atomic, so that the destructor's wait
  // orders every reactor's last access before the members go.
  absl::Mutex reactors_mu_;
  int reactors_ ABSL_GUARDED_BY(reactors_mu_) = 0;

  absl::Mutex upload_mu_;
  std::deque<AppendKvReactor*> uploads_ ABSL_GUARDED_BY(upload_mu_);  // each with one message read
  bool stop_uploads_ ABSL_GUARDED_BY(upload_mu_) = false;
  std::unique_ptr<TransferWorker> transfers_;  // export and import copies
  std::thread uploader_;  // last member: started once the rest is built
};

}  // namespace latentd::server
