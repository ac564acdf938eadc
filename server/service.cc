// latentd.v1.DecodeService on gRPC's callback API: the service's wiring. It admits
// streams (auth, drain, max_streams), keeps the registry of open Decode streams for
// drain and housekeeping, holds the budgets every stream charges (in-flight bytes,
// regions, rings, uploads), runs the upload thread and answers the unary RPCs. Each
// Decode stream is a DecodeReactor (decode_reactor.h), each AppendKv stream an
// AppendKvReactor (append_kv_reactor.h).
#include "server/service.h"

#include <malloc.h>
#include <pthread.h>

#include <cmath>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/params.h"
#include "server/append_kv_reactor.h"
#include "server/auth.h"
#include "server/decode/step_shape.h"
#include "server/decode/step_validation.h"
#include "server/decode_reactor.h"
#include "server/export_reactor.h"
#include "server/import_reactor.h"
#include "server/rpc_status.h"
#include "server/transfer_worker.h"
#include "spdlog/spdlog.h"

namespace latentd::server {
namespace {

using grpc::CallbackServerContext;
using grpc::ServerUnaryReactor;

using decode::CheckIdField;

v1::DType ToProto(kernels::DType d) { return d == kernels::DType::kFP16 ? v1::FP16 : v1::BF16; }

}  // namespace

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

DecodeServiceImpl::DecodeServiceImpl(engine::Engine* engine, ServiceOptions options)
    : engine_(engine),
      options_(std::move(options)),
      inflight_(options_.max_inflight_bytes),
      transfers_(std::make_unique<TransferWorker>()) {
  shape_ = decode::StepShape::For(engine_->Info(), options_.max_s_q);
  uploader_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "latentd-upload");  // for top -H and debuggers
    UploadLoop();
  });
}

// The server has shut down before this runs, so no AppendKv stream is left waiting and
// every reactor has had its OnDone; one may still be finishing (an engine callback's
// reference outlives OnDone), so wait for the last.
DecodeServiceImpl::~DecodeServiceImpl() {
  {
    absl::MutexLock l(&reactors_mu_);
    const absl::Condition none(+[](int* n) { return *n == 0; }, &reactors_);
    while (!reactors_mu_.AwaitWithTimeout(none, absl::Seconds(5))) {
      spdlog::warn("waiting for {} stream(s) to finish before the service stops", reactors_);
    }
  }
  {
    absl::MutexLock l(&upload_mu_);
    stop_uploads_ = true;
  }
  uploader_.join();
}

void DecodeServiceImpl::AddReactor() {
  absl::MutexLock l(&reactors_mu_);
  ++reactors_;
}

void DecodeServiceImpl::RemoveReactor() {
  absl::MutexLock l(&reactors_mu_);
  --reactors_;
}

bool DecodeServiceImpl::EnqueueUpload(AppendKvReactor* reactor, int64_t bytes) {
  if (upload_bytes_.fetch_add(bytes, std::memory_order_relaxed) + bytes > options_.max_upload_bytes &&
      bytes > 0) {
    upload_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
    refused_uploads_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  absl::MutexLock l(&upload_mu_);
  uploads_.push_back(reactor);
  return true;
}

bool DecodeServiceImpl::OpenCall() {
  if (open_calls_.fetch_add(1, std::memory_order_relaxed) >= options_.max_streams) {
    refused_streams_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  return true;
}

bool DecodeServiceImpl::ChargeRegion(int64_t bytes) {
  if (region_bytes_.fetch_add(bytes, std::memory_order_relaxed) + bytes > options_.max_region_total_bytes) {
    region_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
    refused_regions_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  regions_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

absl::Status DecodeServiceImpl::ChargeRing(const std::string& peer) {
  if (rings_.fetch_add(1, std::memory_order_relaxed) >= options_.max_rings) {
    rings_.fetch_sub(1, std::memory_order_relaxed);
    refused_rings_.fetch_add(1, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(
        absl::StrCat("DecodeRequest.region_ring_entries: doorbell rings of all streams are at --max_rings=",
                     options_.max_rings, "; retry later, or send steps in DecodeRequest messages"));
  }
  // One connection may hold only its share, so that one client cannot take every ring
  // (as --max_streams_per_connection bounds its streams). Once per ring, never per step.
  absl::MutexLock l(&rings_mu_);
  int& mine = rings_by_peer_[peer];
  if (mine >= options_.max_rings_per_connection) {
    if (mine == 0) rings_by_peer_.erase(peer);
    rings_.fetch_sub(1, std::memory_order_relaxed);
    refused_rings_.fetch_add(1, std::memory_order_relaxed);
    return absl::ResourceExhaustedError(absl::StrCat(
        "DecodeRequest.region_ring_entries: this connection already holds --max_rings_per_connection=",
        options_.max_rings_per_connection, " doorbell rings; close one of its ring streams, or send steps in "
        "DecodeRequest messages"));
  }
  ++mine;
  return absl::OkStatus();
}

void DecodeServiceImpl::ReleaseRing(const std::string& peer) {
  rings_.fetch_sub(1, std::memory_order_relaxed);
  absl::MutexLock l(&rings_mu_);
  auto it = rings_by_peer_.find(peer);
  if (it != rings_by_peer_.end() && --it->second <= 0) rings_by_peer_.erase(it);
}

ServiceCounters DecodeServiceImpl::Counters() const {
  ServiceCounters c;
  c.open_streams = OpenStreams();
  c.open_calls = open_calls_.load(std::memory_order_relaxed);
  c.inflight_bytes = inflight_.used();
  c.upload_bytes = upload_bytes_.load(std::memory_order_relaxed);
  c.results_delivered = results_delivered_.load(std::memory_order_relaxed);
  c.results_undelivered = results_undelivered_.load(std::memory_order_relaxed);
  c.refused_streams = refused_streams_.load(std::memory_order_relaxed);
  c.refused_steps_bytes = refused_steps_bytes_.load(std::memory_order_relaxed);
  c.refused_messages = refused_messages_.load(std::memory_order_relaxed);
  c.refused_uploads = refused_uploads_.load(std::memory_order_relaxed);
  c.region_bytes = region_bytes_.load(std::memory_order_relaxed);
  c.regions = regions_.load(std::memory_order_relaxed);
  c.refused_regions = refused_regions_.load(std::memory_order_relaxed);
  c.steps_inputs_pinned = steps_inputs_pinned_.load(std::memory_order_relaxed);
  c.steps_inputs_device_direct = steps_inputs_device_direct_.load(std::memory_order_relaxed);
  c.rings = rings_.load(std::memory_order_relaxed);
  c.refused_rings = refused_rings_.load(std::memory_order_relaxed);
  c.steps_ring = steps_ring_.load(std::memory_order_relaxed);
  c.open_exports = open_exports_.load(std::memory_order_relaxed);
  c.open_imports = open_imports_.load(std::memory_order_relaxed);
  c.exports_started = exports_started_.load(std::memory_order_relaxed);
  c.refused_transfers = refused_transfers_.load(std::memory_order_relaxed);
  return c;
}

void DecodeServiceImpl::UploadLoop() {
  for (;;) {
    AppendKvReactor* r = nullptr;
    {
      absl::MutexLock l(&upload_mu_);
      upload_mu_.Await(absl::Condition(
          +[](DecodeServiceImpl* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->upload_mu_) {
            return self->stop_uploads_ || !self->uploads_.empty();
          },
          this));
      if (uploads_.empty()) return;  // stopping, and nothing left
      r = uploads_.front();
      uploads_.pop_front();
    }
    r->ApplyQueued();
  }
}

grpc::Status DecodeServiceImpl::CheckAuth(const grpc::CallbackServerContext* ctx) const {
  if (options_.auth_token.empty()) return grpc::Status::OK;
  grpc::Status st = CheckBearer(ctx->client_metadata(), options_.auth_token);
  if (!st.ok()) RecordAuthFailure(v1::DecodeService::service_full_name(), ctx->peer(), st);
  return st;
}

ServerUnaryReactor* DecodeServiceImpl::GetInfo(CallbackServerContext* ctx, const v1::GetInfoRequest*,
                                               v1::ServerInfo* response) {
  ServerUnaryReactor* reactor = ctx->DefaultReactor();
  grpc::Status st = CheckAuth(ctx);
  if (!st.ok()) {
    reactor->Finish(st);
    return reactor;
  }
  const engine::EngineInfo info = engine_->Info();
  const engine::EngineMetrics m = engine_->Metrics();
  response->set_num_layers(info.model.num_layers);
  response->set_num_heads_q(info.model.num_heads_q);
  response->set_num_heads_kv(info.model.num_heads_kv);
  response->set_head_dim_qk(kernels::kHeadDimQK);
  response->set_head_dim_v(kernels::kHeadDimV);
  response->set_page_size(kernels::kPageSize);
  response->set_dtype(ToProto(info.model.dtype));
  // 0 asks the engine for its default, which clients need to know to check results.
  response->set_softmax_scale(info.model.softmax_scale > 0 ? info.model.softmax_scale
                                                           : 1.f / std::sqrt(static_cast<float>(kernels::kHeadDimQK)));
  response->set_total_pages(info.total_pages);
  response->set_free_pages(info.free_pages);
  response->set_max_batch_size(info.max_batch_size);
  response->set_backend(info.backend);
  response->set_version(options_.version);
  // TODO: read max_s_q from EngineInfo once the facade reports it; until then the
  // server repeats what it passed in EngineOptions.
  response->set_max_s_q(options_.max_s_q);
  response->set_max_message_bytes(options_.max_message_bytes);
  response->set_sequences(m.sequences);
  response->set_steps_per_second(m.steps_per_second);
  response->set_steps_completed(m.steps_completed);
  response->set_queued_steps(m.queued_steps);
  response->set_draining(draining());
  response->set_kv_dtype(kernels::KvDTypeName(info.kv_dtype, info.model.dtype));
  response->set_kv_bytes_per_token(info.kv_bytes_per_token);
  response->set_steps_inputs_pinned(steps_inputs_pinned_.load(std::memory_order_relaxed));
  response->set_steps_inputs_device_direct(steps_inputs_device_direct_.load(std::memory_order_relaxed));
  response->set_layer_api(info.layer_api);
  response->set_hidden_size(info.hidden_size);
  response->set_tensor_parallel(std::max(1, options_.tensor_parallel));
  response->set_tensor_rank(options_.tensor_rank);
  response->set_weight_bytes(info.weight_bytes);
  response->set_max_positions(info.max_positions);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

ServerUnaryReactor* DecodeServiceImpl::CreateSequence(CallbackServerContext* ctx,
                                                      const v1::CreateSequenceRequest* request,
                                                      v1::CreateSequenceResponse* response) {
  ServerUnaryReactor* reactor = ctx->DefaultReactor();
  grpc::Status st = CheckAuth(ctx);
  if (st.ok() && draining()) st = Unavailable();
  if (st.ok()) st = ToGrpc(CheckIdField("sequence_id", request->sequence_id(), true));
  if (st.ok()) {
    if (request->page_keys_size() == 0) {
      auto id = engine_->CreateSequence(request->sequence_id());
      if (id.ok()) {
        response->set_sequence_id(*id);
        spdlog::debug("created sequence {}", *id);
      } else {
        st = ToGrpc(id.status());
      }
    } else {
      const std::vector<std::string> keys(request->page_keys().begin(), request->page_keys().end());
      auto created = engine_->CreateSequenceWithPrefix(request->sequence_id(), keys);
      if (created.ok()) {
        response->set_sequence_id(created->sequence_id);
        response->set_prefix_tokens(created->prefix_tokens);
        spdlog::debug("created sequence {} with {} of {} prefix pages cached", created->sequence_id,
                      created->prefix_tokens / kernels::kPageSize, keys.size());
      } else {
        st = ToGrpc(created.status());
      }
    }
  }
  reactor->Finish(st);
  return reactor;
}

ServerUnaryReactor* DecodeServiceImpl::ForkSequence(CallbackServerContext* ctx,
                                                    const v1::ForkSequenceRequest* request,
                                                    v1::ForkSequenceResponse* response) {
  ServerUnaryReactor* reactor = ctx->DefaultReactor();
  grpc::Status st = CheckAuth(ctx);
  if (st.ok() && draining()) st = Unavailable();
  if (st.ok()) st = ToGrpc(CheckIdField("sequence_id", request->sequence_id(), false));
  if (st.ok()) st = ToGrpc(CheckIdField("new_sequence_id", request->new_sequence_id(), true));
  if (st.ok()) {
    auto id = engine_->ForkSequence(request->sequence_id(), request->new_sequence_id());
    if (id.ok()) {
      response->set_sequence_id(*id);
    } else {
      st = ToGrpc(id.status());
    }
  }
  reactor->Finish(st);
  return reactor;
}

ServerUnaryReactor* DecodeServiceImpl::ReleaseSequence(CallbackServerContext* ctx,
                                                       const v1::ReleaseSequenceRequest* request,
                                                       v1::ReleaseSequenceResponse* response) {
  // Allowed while draining: releasing only frees memory.
  ServerUnaryReactor* reactor = ctx->DefaultReactor();
  grpc::Status st = CheckAuth(ctx);
  if (st.ok()) st = ToGrpc(CheckIdField("sequence_id", request->sequence_id(), false));
  if (st.ok()) {
    auto freed = engine_->ReleaseSequence(request->sequence_id());
    if (freed.ok()) {
      response->set_pages_freed(*freed);
    } else {
      st = ToGrpc(freed.status());
    }
  }
  reactor->Finish(st);
  return reactor;
}

ServerUnaryReactor* DecodeServiceImpl::GetSequence(CallbackServerContext* ctx,
                                                   const v1::GetSequenceRequest* request,
                                                   v1::SequenceInfo* response) {
  // Allowed while draining: a client resyncing needs it most then.
  ServerUnaryReactor* reactor = ctx->DefaultReactor();
  grpc::Status st = CheckAuth(ctx);
  if (st.ok()) st = ToGrpc(CheckIdField("sequence_id", request->sequence_id(), false));
  if (st.ok()) {
    auto info = engine_->GetSequence(request->sequence_id());
    if (info.ok()) {
      response->set_sequence_id(info->sequence_id);
      for (int64_t len : info->lengths) response->add_lengths(len);
      response->set_pages(info->pages);
      response->set_shared_pages(info->shared_pages);
      response->set_offloaded(info->offloaded);
    } else {
      st = ToGrpc(info.status());
    }
  }
  reactor->Finish(st);
  return reactor;
}

grpc::Status DecodeServiceImpl::AdmitStream(const CallbackServerContext* ctx) {
  const bool admitted = OpenCall();
  grpc::Status st = CheckAuth(ctx);
  if (st.ok() && draining()) st = Unavailable();
  if (st.ok() && !admitted) {
    st = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat("the server has ", options_.max_streams,
                                   " Decode and AppendKv streams open (--max_streams); close idle streams or retry "
                                   "later"));
  }
  return st;
}

grpc::ServerReadReactor<grpc::ByteBuffer>* DecodeServiceImpl::AppendKv(CallbackServerContext* ctx,
                                                                      grpc::ByteBuffer* response) {
  return new AppendKvReactor(this, response, AdmitStream(ctx));
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* DecodeServiceImpl::Decode(CallbackServerContext* ctx) {
  grpc::Status st = AdmitStream(ctx);
  const uint64_t flow = streams_opened_.fetch_add(1, std::memory_order_relaxed) + 1;
  return new DecodeReactor(this, ctx, std::move(st), flow);
}

grpc::Status DecodeServiceImpl::AdmitTransfer(const CallbackServerContext* ctx, bool import) {
  // Counted whatever the answer, as OpenCall does: every reactor gives it back in OnDone.
  std::atomic<int64_t>& open = import ? open_imports_ : open_exports_;
  const int limit = import ? options_.max_import_streams : options_.max_export_streams;
  const bool admitted = open.fetch_add(1, std::memory_order_relaxed) < limit;
  grpc::Status st = CheckAuth(ctx);
  if (st.ok() && import && draining()) st = Unavailable();
  if (st.ok() && !admitted) {
    refused_transfers_.fetch_add(1, std::memory_order_relaxed);
    st = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat("the server has ", limit, import ? " ImportSequence" : " ExportSequence",
                                   " streams open (", import ? "--max_import_streams" : "--max_export_streams",
                                   "); retry when one has ended"));
  }
  if (st.ok() && !import) exports_started_.fetch_add(1, std::memory_order_relaxed);
  return st;
}

TransferWorker& DecodeServiceImpl::transfers() { return *transfers_; }

void DecodeServiceImpl::CloseTransfer(bool import) {
  (import ? open_imports_ : open_exports_).fetch_sub(1, std::memory_order_relaxed);
}

grpc::ServerWriteReactor<v1::SequenceChunk>* DecodeServiceImpl::ExportSequence(
    CallbackServerContext* ctx, const v1::ExportSequenceRequest* request) {
  grpc::Status st = AdmitTransfer(ctx, /*import=*/false);
  if (st.ok()) st = ToGrpc(CheckIdField("sequence_id", request->sequence_id(), false));
  return new ExportReactor(this, *request, std::move(st));
}

grpc::ServerReadReactor<v1::SequenceChunk>* DecodeServiceImpl::ImportSequence(CallbackServerContext* ctx,
                                                                            v1::ImportSequenceResponse* response) {
  return new ImportReactor(this, ctx, response, AdmitTransfer(ctx, /*import=*/true));
}

void DecodeServiceImpl::RegisterImport(ImportReactor* reactor) {
  absl::MutexLock l(&imports_mu_);
  imports_.insert(reactor);
}

void DecodeServiceImpl::UnregisterImport(ImportReactor* reactor) {
  absl::MutexLock l(&imports_mu_);
  imports_.erase(reactor);
}

// A reactor leaves imports_ in OnDone, before it is deleted, so every one in the set is
// alive while imports_mu_ is held.
int DecodeServiceImpl::CancelStalledImports(absl::Duration stall) {
  const absl::Time cutoff = absl::Now() - stall;
  int cancelled = 0;
  absl::MutexLock l(&imports_mu_);
  for (ImportReactor* r : imports_) cancelled += r->CancelIfStalled(cutoff) ? 1 : 0;
  return cancelled;
}

void DecodeServiceImpl::Register(DecodeReactor* reactor) {
  absl::MutexLock l(&streams_mu_);
  streams_.insert(reactor);
}

void DecodeServiceImpl::Unregister(DecodeReactor* reactor) {
  absl::MutexLock l(&streams_mu_);
  streams_.erase(reactor);
}

int DecodeServiceImpl::OpenStreams() const {
  absl::MutexLock l(&streams_mu_);
  return static_cast<int>(streams_.size());
}

// A reactor leaves streams_ in OnDone, before gRPC's reference is dropped, so every
// reactor in the set holds at least that reference while streams_mu_ is held: taking one
// here is safe, and it keeps the reactor alive while `fn` runs unlocked.
template <typename Fn>
void DecodeServiceImpl::ForEachOpenStream(Fn fn) {
  std::vector<DecodeReactor*> open;
  {
    absl::MutexLock l(&streams_mu_);
    open.assign(streams_.begin(), streams_.end());
    for (DecodeReactor* r : open) r->Ref();
  }
  for (DecodeReactor* r : open) {
    fn(r);
    r->Unref();
  }
}

int DecodeServiceImpl::CancelStalledStreams(absl::Duration stall) {
  const absl::Time cutoff = absl::Now() - stall;
  int cancelled = 0;
  ForEachOpenStream([&](DecodeReactor* r) { cancelled += r->CancelIfStalled(cutoff) ? 1 : 0; });
  return cancelled;
}

int DecodeServiceImpl::TrimIdleStreams() {
  int freed = 0;
  ForEachOpenStream([&](DecodeReactor* r) { freed += r->TrimIfIdle(); });
  // Step buffers are below malloc's mmap threshold: without a trim the heap keeps their
  // pages resident after they are freed.
  if (freed > 0) malloc_trim(0);
  return freed;
}

void DecodeServiceImpl::BeginDrain() {
  draining_.store(true, std::memory_order_release);
  ForEachOpenStream([](DecodeReactor* r) { r->BeginDrain(); });
}

}  // namespace latentd::server
