// latentd.v1.DecodeService on gRPC's callback API. Each Decode stream owns a reactor
// with its own lock: steps are validated and handed to Engine::Submit as they are read,
// and results are coalesced into one outstanding write at a time as StepDone callbacks
// arrive. Buffers (step inputs, out/lse, response messages) are recycled per stream so
// the steady state allocates nothing beyond what protobuf parsing needs.
#include "server/service.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/params.h"
#include "server/auth.h"
#include "spdlog/spdlog.h"

namespace latentd::server {
namespace {

using grpc::CallbackServerContext;
using grpc::ServerUnaryReactor;

constexpr int kDtypeBytes = 2;

grpc::Status Unavailable() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "server is shutting down; retry on another replica");
}

// Wraps an engine/validation error with the RPC's context.
grpc::Status Prefixed(const absl::Status& s, absl::string_view prefix) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), absl::StrCat(prefix, s.message()));
}

absl::Status CheckIdField(absl::string_view field, absl::string_view id, bool allow_empty) {
  if (id.empty()) {
    if (allow_empty) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": empty; expected the id of a sequence made by CreateSequence"));
  }
  if (!IsValidSequenceId(id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": malformed id (", id.size(), " bytes); expected 1 to 128 characters from [A-Za-z0-9._:-]"));
  }
  return absl::OkStatus();
}

absl::Status CheckLayer(absl::string_view field, int layer, int num_layers) {
  if (layer < 0 || layer >= num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", layer, " is out of range; expected 0 <= layer < ", num_layers));
  }
  return absl::OkStatus();
}

v1::DType ToProto(kernels::DType d) { return d == kernels::DType::kFP16 ? v1::FP16 : v1::BF16; }

}  // namespace

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

bool IsValidSequenceId(absl::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == ':' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------
// Decode: one reactor per stream.

class DecodeReactor final : public grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse>,
                            public engine::StepCallback {
 public:
  DecodeReactor(DecodeServiceImpl* service, CallbackServerContext* ctx, grpc::Status initial)
      : service_(service), ctx_(ctx) {
    if (!initial.ok()) {
      absl::MutexLock l(&mu_);
      finished_ = true;
      Finish(std::move(initial));  // nothing can call back before the constructor returns
      return;
    }
    registered_ = true;
    service_->Register(this);
    Plan p;
    {
      absl::MutexLock l(&mu_);
      draining_ = service_->draining();
      p = PlanLocked();
    }
    Act(p);
  }

  void OnReadDone(bool ok) override {
    Plan p;
    bool process = false;
    {
      absl::MutexLock l(&mu_);
      reading_ = false;
      if (!ok) reads_done_ = true;
      if (!ok || finished_ || cancelled_.load(std::memory_order_acquire)) {
        // Steps in a read that completes after Finish (or after the client went away)
        // are never accepted; the client learns that from the stream's status.
        p = PlanLocked();
      } else {
        processing_ = true;  // no Finish until every step of this read is accounted for
        process = true;
      }
    }
    if (process) {
      const int n = request_.steps_size();
      for (int i = 0; i < n; ++i) HandleStep(request_.mutable_steps(i), i);
      absl::MutexLock l(&mu_);
      processing_ = false;
      p = PlanLocked();
    }
    Act(p);
  }

  void OnWriteDone(bool ok) override {
    Plan p;
    {
      absl::MutexLock l(&mu_);
      writing_ = false;
      if (!ok) write_failed_ = true;  // the client is gone; later results are dropped
      p = PlanLocked();
    }
    Act(p);
  }

  void OnCancel() override {
    cancelled_.store(true, std::memory_order_release);
    Plan p;
    {
      absl::MutexLock l(&mu_);
      p = PlanLocked();
    }
    Act(p);
  }

  void OnDone() override { Unref(); }

  // Engine thread. Must not block: a short critical section, then maybe a write start.
  void StepDone(engine::DecodeStep* step, absl::Status status) override {
    Slot* slot = static_cast<Slot*>(step);
    if (!status.ok()) SetError(&slot->result, status);
    Plan p;
    {
      absl::MutexLock l(&mu_);
      --inflight_;
      done_.push_back(slot);
      p = PlanLocked();
    }
    Act(p);
  }

  // Keeps the reactor alive across a call from outside gRPC's reactions (BeginDrain).
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  // The reactor lives until gRPC is done with it (OnDone) and no Act is in progress.
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      if (registered_) service_->Unregister(this);
      delete this;
    }
  }

  void BeginDrain() {
    Plan p;
    {
      absl::MutexLock l(&mu_);
      draining_ = true;
      p = PlanLocked();
    }
    Act(p);
  }

  // Cancels the stream if a response write has been pending since before `cutoff`: the
  // client stopped reading, and flow control would hold this stream (its slots and
  // results) until the client's deadline, or for ever without one. Returns true if so.
  // The caller holds a Ref.
  bool CancelIfStalled(absl::Time cutoff) {
    {
      absl::MutexLock l(&mu_);
      if (finished_ || !writing_ || write_started_ >= cutoff || cancelling_) return false;
      // No Finish until TryCancel has returned: the context lives until OnDone, which
      // only follows Finish. mu_ is not held across TryCancel, whose reactions (OnCancel,
      // OnWriteDone) may run inline on this thread.
      cancelling_ = true;
    }
    ctx_->TryCancel();
    Plan p;
    {
      absl::MutexLock l(&mu_);
      cancelling_ = false;
      p = PlanLocked();
    }
    Act(p);
    return true;
  }

 private:
  // One step's storage, owned by the stream and reused. The engine sees the DecodeStep
  // base only and hands it back in StepDone.
  struct Slot : engine::DecodeStep {
    std::string q_buf, kv_buf;  // inputs, swapped out of the request message
    v1::StepResult result;      // out/lse written by the engine in place
  };

  // What to do after a state change: decided under mu_, done after releasing it, since
  // gRPC may run reactions (even OnDone) at the end of a Start*/Finish call.
  struct Plan {
    bool read = false;
    bool write = false;
    bool finish = false;
    grpc::Status status;
    bool holds_ref = false;
  };

  Plan PlanLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Plan p;
    if (finished_) return p;
    const bool gone = cancelled_.load(std::memory_order_acquire) || write_failed_;
    if (gone) {
      // Answers have nowhere to go; recycle them.
      for (Slot* s : done_) free_.push_back(s);
      done_.clear();
    }
    if (!writing_ && !done_.empty()) {
      FillResponseLocked();
      writing_ = true;
      write_started_ = absl::Now();
      p.write = true;
    }
    const int64_t open = inflight_ + static_cast<int64_t>(done_.size());
    if (!reading_ && !processing_ && !reads_done_ && !gone && !draining_ &&
        open < service_->options().max_stream_inflight) {
      reading_ = true;
      p.read = true;
    }
    const bool idle = inflight_ == 0 && !writing_ && done_.empty() && !processing_;
    if (idle && !cancelling_ && (gone || (reads_done_ && !reading_) || draining_)) {
      finished_ = true;
      p.finish = true;
      if (gone) {
        p.status = grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
      } else if (draining_ && !reads_done_) {
        p.status = Unavailable();
      } else {
        p.status = grpc::Status::OK;
      }
    }
    if (p.read || p.write || p.finish) {
      refs_.fetch_add(1, std::memory_order_relaxed);
      p.holds_ref = true;
    }
    return p;
  }

  void Act(const Plan& p) {
    if (p.write) StartWrite(&response_);
    if (p.read) StartRead(&request_);
    if (p.finish) Finish(p.status);
    if (p.holds_ref) Unref();
  }

  // Moves finished results into response_, up to the byte cap (at least one result).
  void FillResponseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    response_.mutable_results()->Clear();  // keeps the element objects for reuse
    int64_t bytes = 0;
    size_t taken = 0;
    const int64_t cap = service_->options().max_response_bytes;
    while (taken < done_.size()) {
      Slot* s = done_[taken];
      const int64_t b = static_cast<int64_t>(s->result.out().size() + s->result.lse().size()) + 64;
      if (taken > 0 && bytes + b > cap) break;
      bytes += b;
      // Swap hands the result's buffers to the response and the response element's
      // (cleared, still allocated) buffers back to the slot.
      response_.add_results()->Swap(&s->result);
      free_.push_back(s);
      ++taken;
    }
    done_.erase(done_.begin(), done_.begin() + taken);
  }

  Slot* AcquireSlot() {
    absl::MutexLock l(&mu_);
    if (free_.empty()) {
      slots_.push_back(std::make_unique<Slot>());
      return slots_.back().get();
    }
    Slot* s = free_.back();
    free_.pop_back();
    return s;
  }

  static void SetError(v1::StepResult* r, const absl::Status& status) {
    r->clear_out();
    r->clear_lse();
    r->set_code(static_cast<int>(status.code()));
    r->set_message(std::string(status.message()));
  }

  // Validates one step and submits it, or answers it at once with its error.
  void HandleStep(v1::DecodeStep* in, int index) {
    const DecodeServiceImpl::Shape& sh = service_->shape();
    Slot* slot = AcquireSlot();
    v1::StepResult& r = slot->result;
    r.set_request_id(in->request_id());
    r.set_code(0);
    r.clear_message();
    absl::Status st = Validate(*in, index, sh);
    if (st.ok() && service_->draining()) {
      st = absl::UnavailableError("server is shutting down; step not accepted");
    }
    if (!st.ok()) {
      SetError(&r, st);
      absl::MutexLock l(&mu_);
      done_.push_back(slot);
      return;
    }
    const int s_q = static_cast<int>(in->q().size() / sh.q_row_bytes);
    slot->q_buf.swap(*in->mutable_q());
    slot->kv_buf.swap(*in->mutable_kv());
    slot->request_id = in->request_id();
    slot->sequence_id.assign(in->sequence_id());
    slot->layer = in->layer();
    slot->s_q = s_q;
    slot->causal = in->causal();
    slot->q = slot->q_buf;
    slot->kv = slot->kv_buf;
    std::string* out = r.mutable_out();
    out->resize(static_cast<size_t>(s_q * sh.out_row_bytes));
    std::string* lse = r.mutable_lse();
    lse->resize(static_cast<size_t>(s_q) * sh.h_q * sizeof(float));
    slot->out = &(*out)[0];
    slot->lse = reinterpret_cast<float*>(&(*lse)[0]);
    slot->deadline = in->timeout_ms() > 0 ? absl::Now() + absl::Milliseconds(in->timeout_ms())
                                          : absl::InfiniteFuture();
    slot->cancelled = &cancelled_;
    slot->callback = this;
    slot->engine_private = nullptr;
    {
      absl::MutexLock l(&mu_);
      ++inflight_;  // before Submit: StepDone may run before Submit returns
    }
    absl::Status submitted = service_->engine()->Submit(slot);
    if (!submitted.ok()) {
      SetError(&r, submitted);
      absl::MutexLock l(&mu_);
      --inflight_;
      done_.push_back(slot);
    }
  }

  static absl::Status Validate(const v1::DecodeStep& in, int index, const DecodeServiceImpl::Shape& sh) {
    absl::Status st = CheckIdField("sequence_id", in.sequence_id(), false);
    if (st.ok()) st = CheckLayer("layer", in.layer(), sh.num_layers);
    if (st.ok()) {
      const int64_t qb = static_cast<int64_t>(in.q().size());
      if (qb == 0 || qb % sh.q_row_bytes != 0 || qb / sh.q_row_bytes > sh.max_s_q) {
        st = absl::InvalidArgumentError(absl::StrCat(
            "q: ", qb, " bytes; expected s_q * h_q * 576 * 2 = s_q * ", sh.q_row_bytes, " bytes ([s_q, ", sh.h_q,
            ", 576] in the server dtype) with 1 <= s_q <= ", sh.max_s_q));
      } else {
        const int64_t s_q = qb / sh.q_row_bytes;
        if (static_cast<int64_t>(in.kv().size()) != s_q * sh.kv_row_bytes) {
          st = absl::InvalidArgumentError(absl::StrCat("kv: ", in.kv().size(),
                                                       " bytes; expected s_q * h_kv * 576 * 2 = ",
                                                       s_q * sh.kv_row_bytes, " bytes ([", s_q, ", ", sh.h_kv,
                                                       ", 576], one new row per query token)"));
        }
      }
    }
    if (st.ok()) return st;
    return absl::Status(st.code(), absl::StrCat("steps[", index, "] (request_id ", in.request_id(), ").",
                                                st.message()));
  }

  DecodeServiceImpl* const service_;
  CallbackServerContext* const ctx_;  // gRPC's; valid until OnDone
  bool registered_ = false;
  std::atomic<bool> cancelled_{false};
  std::atomic<int> refs_{1};  // gRPC's, dropped in OnDone; plus one per Act in progress

  // The read side is touched only between StartRead and the end of OnReadDone.
  v1::DecodeRequest request_;

  absl::Mutex mu_;
  std::vector<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);  // stable addresses
  std::vector<Slot*> free_ ABSL_GUARDED_BY(mu_);
  std::vector<Slot*> done_ ABSL_GUARDED_BY(mu_);  // answered, waiting for a write
  // The one outstanding write; filled under mu_, read by gRPC until OnWriteDone.
  v1::DecodeResponse response_;
  int64_t inflight_ ABSL_GUARDED_BY(mu_) = 0;  // accepted by the engine, not yet done
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool processing_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time write_started_ ABSL_GUARDED_BY(mu_);  // of the outstanding write
  bool cancelling_ ABSL_GUARDED_BY(mu_) = false;   // CancelIfStalled is in TryCancel
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

// ---------------------------------------------------------------------------------
// AppendKv: a client stream of row chunks for one sequence, each applied on arrival.

class AppendKvReactor final : public grpc::ServerReadReactor<v1::AppendKvRequest> {
 public:
  AppendKvReactor(DecodeServiceImpl* service, v1::AppendKvResponse* response, grpc::Status initial)
      : service_(service), response_(response) {
    if (!initial.ok()) {
      Finish(std::move(initial));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (messages_ == 0) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "AppendKv: the stream had no messages; expected at least one naming sequence_id"));
        return;
      }
      response_->set_sequence_id(sequence_id_);
      response_->set_tokens_appended(rows_);
      Finish(grpc::Status::OK);
      return;
    }
    service_->EnqueueUpload(this);  // ApplyQueued runs there; no read is outstanding meanwhile
  }

  void OnDone() override { delete this; }

  // The upload thread: applies the message just read, then reads the next or finishes.
  void ApplyQueued() {
    grpc::Status st = Apply();
    if (!st.ok()) {
      Finish(st);
      return;
    }
    StartRead(&request_);
  }

 private:
  grpc::Status Apply() {
    const DecodeServiceImpl::Shape& sh = service_->shape();
    const std::string where = absl::StrCat("AppendKv message ", messages_, ": ");
    ++messages_;
    if (service_->draining()) return Unavailable();
    if (messages_ == 1) {
      absl::Status st = CheckIdField("sequence_id", request_.sequence_id(), false);
      if (!st.ok()) return Prefixed(st, where);
      sequence_id_ = request_.sequence_id();
    } else if (!request_.sequence_id().empty() && request_.sequence_id() != sequence_id_) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat(where, "sequence_id: '", request_.sequence_id(),
                                       "' differs from the stream's first message ('", sequence_id_,
                                       "'); expected one sequence per AppendKv stream"));
    }
    absl::Status st = CheckLayer("layer", request_.layer(), sh.num_layers);
    if (!st.ok()) return Prefixed(st, where);
    const int64_t kb = static_cast<int64_t>(request_.kv().size());
    if (kb % sh.kv_row_bytes != 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat(where, "kv: ", kb, " bytes; expected a multiple of h_kv * 576 * 2 = ",
                                       sh.kv_row_bytes, " bytes ([n, ", sh.h_kv, ", 576] in the server dtype)"));
    }
    // The engine copies the rows into its pool under its KV lock (no batch is waited for).
    auto lengths = service_->engine()->AppendKv(sequence_id_, request_.layer(), request_.kv());
    if (!lengths.ok()) {
      return Prefixed(lengths.status(), absl::StrCat(where, "(", rows_, " rows appended before it) "));
    }
    rows_ += kb / sh.kv_row_bytes;
    response_->clear_lengths();
    for (int64_t len : lengths->lengths) response_->add_lengths(len);
    return grpc::Status::OK;
  }

  DecodeServiceImpl* const service_;
  v1::AppendKvResponse* const response_;
  v1::AppendKvRequest request_;
  std::string sequence_id_;
  int64_t rows_ = 0;
  int messages_ = 0;
};

// ---------------------------------------------------------------------------------

DecodeServiceImpl::DecodeServiceImpl(engine::Engine* engine, ServiceOptions options)
    : engine_(engine), options_(std::move(options)) {
  const engine::EngineInfo info = engine_->Info();
  shape_.num_layers = info.model.num_layers;
  shape_.h_q = info.model.num_heads_q;
  shape_.h_kv = info.model.num_heads_kv;
  shape_.max_s_q = options_.max_s_q;
  shape_.q_row_bytes = int64_t{shape_.h_q} * kernels::kHeadDimQK * kDtypeBytes;
  shape_.kv_row_bytes = int64_t{shape_.h_kv} * kernels::kHeadDimQK * kDtypeBytes;
  shape_.out_row_bytes = int64_t{shape_.h_q} * kernels::kHeadDimV * kDtypeBytes;
  uploader_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "latentd-upload");  // for top -H and debuggers
    UploadLoop();
  });
}

// The server has shut down before this runs, so no AppendKv stream is left waiting.
DecodeServiceImpl::~DecodeServiceImpl() {
  {
    absl::MutexLock l(&upload_mu_);
    stop_uploads_ = true;
  }
  uploader_.join();
}

void DecodeServiceImpl::EnqueueUpload(AppendKvReactor* reactor) {
  absl::MutexLock l(&upload_mu_);
  uploads_.push_back(reactor);
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

uint64_t DecodeServiceImpl::UndeliveredResults() const {
  return undelivered_results_.load(std::memory_order_relaxed);
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
    auto id = engine_->CreateSequence(request->sequence_id());
    if (id.ok()) {
      response->set_sequence_id(*id);
      spdlog::debug("created sequence {}", *id);
    } else {
      st = ToGrpc(id.status());
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

grpc::ServerReadReactor<v1::AppendKvRequest>* DecodeServiceImpl::AppendKv(CallbackServerContext* ctx,
                                                                         v1::AppendKvResponse* response) {
  grpc::Status st = CheckAuth(ctx);
  if (st.ok() && draining()) st = Unavailable();
  return new AppendKvReactor(this, response, std::move(st));
}

grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse>* DecodeServiceImpl::Decode(
    CallbackServerContext* ctx) {
  grpc::Status st = CheckAuth(ctx);
  if (st.ok() && draining()) st = Unavailable();
  return new DecodeReactor(this, ctx, std::move(st));
}

void DecodeServiceImpl::Register(DecodeReactor* reactor) {
  absl::MutexLock l(&streams_mu_);
  streams_.insert(reactor);
  streams_opened_.fetch_add(1, std::memory_order_relaxed);
}

void DecodeServiceImpl::Unregister(DecodeReactor* reactor) {
  absl::MutexLock l(&streams_mu_);
  streams_.erase(reactor);
}

int DecodeServiceImpl::OpenStreams() const {
  absl::MutexLock l(&streams_mu_);
  return static_cast<int>(streams_.size());
}

// Reactors unregister under streams_mu_ before they are deleted, so each one is alive
// while the lock is held; a reference keeps it so while `fn` runs unlocked (fn may finish
// the stream, and the last Unref unregisters).
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

void DecodeServiceImpl::BeginDrain() {
  draining_.store(true, std::memory_order_release);
  ForEachOpenStream([](DecodeReactor* r) { r->BeginDrain(); });
}

}  // namespace latentd::server
