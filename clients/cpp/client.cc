// The C++ client of latentd.v1.DecodeService; see client.h.
#include "clients/cpp/client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/handoff.h"
#include "proto/health.grpc.pb.h"
#include "proto/ring.h"

namespace latentd::client {

Shape::Shape(const v1::ServerInfo& info)
    : num_layers(info.num_layers()),
      h_q(info.num_heads_q()),
      h_kv(info.num_heads_kv()),
      q_row_bytes(int64_t{info.num_heads_q()} * info.head_dim_qk() * 2),
      kv_row_bytes(int64_t{info.num_heads_kv()} * info.head_dim_qk() * 2),
      out_row_bytes(int64_t{info.num_heads_q()} * info.head_dim_v() * 2) {}

grpc::Status FromAbsl(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

absl::Status ToAbsl(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

void Client::MakeChannel(const ClientOptions& options) {
  options_ = options;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(static_cast<int>(options.max_send_bytes));
  if (options.max_reconnect_backoff_ms > 0) {
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, options.max_reconnect_backoff_ms);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, std::min(options.max_reconnect_backoff_ms, 100));
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, std::min(options.max_reconnect_backoff_ms, 100));
  }
  if (options.own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_certs_pem;
    creds = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  }
  channel_ = grpc::CreateCustomChannel(options.target, creds, args);
  stub_ = v1::DecodeService::NewStub(channel_);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options, absl::Duration timeout) {
  std::unique_ptr<Client> c(new Client());
  c->MakeChannel(options);
  if (!c->channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    return absl::UnavailableError(absl::StrCat("cannot connect to ", options.target));
  }
  auto info = c->GetInfo(timeout);
  if (!info.ok()) return info.status();
  c->info_ = *info;
  c->shape_ = Shape(c->info_);
  return c;
}

std::unique_ptr<Client> Client::Open(const ClientOptions& options, const v1::ServerInfo& info) {
  std::unique_ptr<Client> c(new Client());
  c->MakeChannel(options);
  c->info_ = info;
  c->shape_ = Shape(info);
  return c;
}

void Client::Prepare(grpc::ClientContext* ctx) const {
  if (!options_.auth_token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.auth_token);
}

void Client::Prepare(grpc::ClientContext* ctx, absl::string_view route, absl::Duration timeout) const {
  Prepare(ctx);
  if (!route.empty()) ctx->AddMetadata(kRouteHeader, std::string(route));
  if (timeout != absl::InfiniteDuration()) ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

absl::StatusOr<v1::ServerInfo> Client::GetInfo(absl::Duration timeout) {
  grpc::ClientContext ctx;
  Prepare(&ctx, "", timeout);
  v1::ServerInfo info;
  grpc::Status st = stub_->GetInfo(&ctx, v1::GetInfoRequest(), &info);
  if (!st.ok()) return ToAbsl(st);
  return info;
}

absl::StatusOr<std::string> Client::CreateSequence(absl::string_view sequence_id, const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call.route.empty() ? sequence_id : call.route, call.timeout);
  v1::CreateSequenceRequest req;
  req.set_sequence_id(std::string(sequence_id));
  v1::CreateSequenceResponse resp;
  grpc::Status st = stub_->CreateSequence(&ctx, req, &resp);
  if (!st.ok()) return ToAbsl(st);
  return resp.sequence_id();
}

absl::StatusOr<v1::CreateSequenceResponse> Client::CreateSequenceWithPrefix(
    absl::string_view sequence_id, const std::vector<std::string>& page_keys, const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call.route.empty() ? sequence_id : call.route, call.timeout);
  v1::CreateSequenceRequest req;
  req.set_sequence_id(std::string(sequence_id));
  for (const std::string& k : page_keys) req.add_page_keys(k);
  v1::CreateSequenceResponse resp;
  grpc::Status st = stub_->CreateSequence(&ctx, req, &resp);
  if (!st.ok()) return ToAbsl(st);
  return resp;
}

absl::StatusOr<v1::AppendKvResponse> Client::AppendKv(absl::string_view sequence_id, int layer,
                                                      absl::string_view kv, const CallOptions& call) {
  return AppendKvParts(sequence_id, {{layer, kv}}, call);
}

absl::StatusOr<v1::AppendKvResponse> Client::AppendKvLayers(absl::string_view sequence_id,
                                                            const std::vector<absl::string_view>& kv_per_layer,
                                                            const CallOptions& call) {
  std::vector<std::pair<int, absl::string_view>> parts;
  for (int layer = 0; layer < static_cast<int>(kv_per_layer.size()); ++layer) {
    if (!kv_per_layer[layer].empty()) parts.emplace_back(layer, kv_per_layer[layer]);
  }
  return AppendKvParts(sequence_id, parts, call);
}

absl::StatusOr<v1::AppendKvResponse> Client::AppendHidden(absl::string_view sequence_id, int layer,
                                                          absl::string_view hidden, const CallOptions& call) {
  return AppendKvParts(sequence_id, {{layer, hidden}}, call, /*hidden=*/true);
}

absl::StatusOr<v1::AppendKvResponse> Client::AppendKvParts(
    absl::string_view sequence_id, const std::vector<std::pair<int, absl::string_view>>& parts,
    const CallOptions& call, bool hidden) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call.route.empty() ? sequence_id : call.route, call.timeout);
  v1::AppendKvResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::AppendKvRequest>> w = stub_->AppendKv(&ctx, &resp);
  const int64_t row = std::max<int64_t>(hidden ? int64_t{info_.hidden_size()} * 2 : shape_.kv_row_bytes, 1);
  const int64_t chunk = std::max<int64_t>(row, options_.append_chunk_bytes / row * row);
  v1::AppendKvRequest req;
  bool first = true;
  bool open = true;
  for (const auto& [layer, rows] : parts) {
    absl::string_view kv = rows;
    // An empty part still sends one message, so the server checks its layer.
    do {
      const absl::string_view piece = kv.substr(0, chunk);
      kv.remove_prefix(piece.size());
      req.Clear();
      if (first) req.set_sequence_id(std::string(sequence_id));
      first = false;
      req.set_layer(layer);
      if (hidden) {
        req.set_hidden(piece.data(), piece.size());
      } else {
        req.set_kv(piece.data(), piece.size());
      }
      open = w->Write(req);  // false: the server ended the stream; Finish has the status
    } while (open && !kv.empty());
    if (!open) break;
  }
  if (open) w->WritesDone();
  grpc::Status st = w->Finish();
  if (!st.ok()) return ToAbsl(st);
  return resp;
}

absl::StatusOr<std::string> Client::ForkSequence(absl::string_view sequence_id, absl::string_view new_sequence_id,
                                                 const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call.route.empty() ? sequence_id : call.route, call.timeout);
  v1::ForkSequenceRequest req;
  req.set_sequence_id(std::string(sequence_id));
  req.set_new_sequence_id(std::string(new_sequence_id));
  v1::ForkSequenceResponse resp;
  grpc::Status st = stub_->ForkSequence(&ctx, req, &resp);
  if (!st.ok()) return ToAbsl(st);
  return resp.sequence_id();
}

absl::StatusOr<int64_t> Client::ReleaseSequence(absl::string_view sequence_id, const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call.route.empty() ? sequence_id : call.route, call.timeout);
  v1::ReleaseSequenceRequest req;
  req.set_sequence_id(std::string(sequence_id));
  v1::ReleaseSequenceResponse resp;
  grpc::Status st = stub_->ReleaseSequence(&ctx, req, &resp);
  if (!st.ok()) return ToAbsl(st);
  return resp.pages_freed();
}

absl::StatusOr<v1::SequenceInfo> Client::GetSequence(absl::string_view sequence_id, const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call.route.empty() ? sequence_id : call.route, call.timeout);
  v1::GetSequenceRequest req;
  req.set_sequence_id(std::string(sequence_id));
  v1::SequenceInfo resp;
  grpc::Status st = stub_->GetSequence(&ctx, req, &resp);
  if (!st.ok()) return ToAbsl(st);
  return resp;
}

absl::Status Client::ExportSequence(absl::string_view sequence_id,
                                    const std::function<absl::Status(v1::SequenceChunk&)>& on_chunk,
                                    int64_t max_chunk_bytes, const CallOptions& call) {
  grpc::ClientContext ctx;
  Prepare(&ctx, call.route.empty() ? sequence_id : call.route, call.timeout);
  v1::ExportSequenceRequest req;
  req.set_sequence_id(std::string(sequence_id));
  req.set_max_chunk_bytes(max_chunk_bytes);
  std::unique_ptr<grpc::ClientReader<v1::SequenceChunk>> reader = stub_->ExportSequence(&ctx, req);
  v1::SequenceChunk chunk;
  absl::Status mine;
  while (reader->Read(&chunk)) {
    mine = on_chunk(chunk);
    if (!mine.ok()) {
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status st = reader->Finish();
  if (!mine.ok()) return mine;
  return ToAbsl(st);
}

absl::StatusOr<v1::ImportSequenceResponse> Client::ImportSequence(const std::vector<v1::SequenceChunk>& chunks,
                                                                  const CallOptions& call) {
  std::string route = call.route;
  if (route.empty() && !chunks.empty()) {
    route = !chunks[0].sequence_id().empty() ? chunks[0].sequence_id() : chunks[0].header().sequence_id();
  }
  grpc::ClientContext ctx;
  Prepare(&ctx, route, call.timeout);
  v1::ImportSequenceResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::SequenceChunk>> writer = stub_->ImportSequence(&ctx, &resp);
  for (const v1::SequenceChunk& c : chunks) {
    if (!writer->Write(c)) break;  // the server ended the stream: Finish says why
  }
  writer->WritesDone();
  grpc::Status st = writer->Finish();
  if (!st.ok()) return ToAbsl(st);
  return resp;
}

absl::StatusOr<Client::Moved> Client::MoveSequence(absl::string_view sequence_id, Client* to, const CallOptions& call,
                                                   const CallOptions& to_call) {
  // Each chunk goes on as it arrives; a failure on either side cancels the import, which
  // then leaves nothing on `to`.
  grpc::ClientContext import_ctx;
  to->Prepare(&import_ctx, to_call.route.empty() ? sequence_id : to_call.route, to_call.timeout);
  v1::ImportSequenceResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::SequenceChunk>> writer = to->stub()->ImportSequence(&import_ctx, &resp);
  bool import_broke = false;
  absl::Status exported = ExportSequence(
      sequence_id,
      [&](v1::SequenceChunk& c) {
        if (writer->Write(c)) return absl::OkStatus();
        import_broke = true;
        return absl::CancelledError("the import stream ended");
      },
      0, call);
  if (!exported.ok() && !import_broke) {
    import_ctx.TryCancel();
    writer->Finish();
    return exported;
  }
  writer->WritesDone();
  grpc::Status st = writer->Finish();
  if (!st.ok()) return ToAbsl(st);
  Moved moved;
  moved.imported = std::move(resp);
  absl::StatusOr<int64_t> released = ReleaseSequence(sequence_id, call);
  moved.released = released.status();
  return moved;
}

absl::StatusOr<std::string> Client::Health(absl::Duration timeout) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status st = health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp);
  if (!st.ok()) return ToAbsl(st);
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
}

std::unique_ptr<DecodeStream> Client::OpenDecodeStream(absl::string_view route) {
  return std::make_unique<DecodeStream>(this, route);
}

absl::StatusOr<std::map<uint64_t, v1::StepResult>> Client::DecodeAll(const std::vector<v1::DecodeStep>& steps,
                                                                     int steps_per_message, const CallOptions& call) {
  auto stream = std::make_unique<DecodeStream>(this,
                                               !call.route.empty() ? absl::string_view(call.route)
                                               : steps.empty()     ? absl::string_view()
                                                                   : absl::string_view(steps.front().sequence_id()),
                                               call.timeout);
  std::map<uint64_t, v1::StepResult> results;
  std::thread reader([&] {
    v1::DecodeResponse resp;
    while (stream->Read(&resp)) {
      for (auto& r : *resp.mutable_results()) {
        const uint64_t id = r.request_id();
        results[id] = std::move(r);
      }
    }
  });
  v1::DecodeRequest req;
  for (size_t i = 0; i < steps.size(); ++i) {
    *req.add_steps() = steps[i];
    if (req.steps_size() >= steps_per_message || i + 1 == steps.size()) {
      if (!stream->Write(req)) break;
      req.Clear();
    }
  }
  stream->WritesDone();
  reader.join();
  grpc::Status st = stream->Finish();
  if (!st.ok()) return ToAbsl(st);
  return results;
}

DecodeStream::DecodeStream(Client* client, absl::string_view route, absl::Duration timeout) {
  client->Prepare(&ctx_, route, timeout);
  rw_ = client->stub()->Decode(&ctx_);
}

DecodeStream::~DecodeStream() = default;

SharedRegion::~SharedRegion() { munmap(data_, size_); }

absl::StatusOr<v1::SharedRegion> DecodeStream::AskForRegion(const v1::DecodeRequest& req, uint64_t bytes) {
  v1::DecodeResponse resp;
  if (!rw_->Write(req) || !rw_->Read(&resp)) {
    grpc::Status st = rw_->Finish();
    return st.ok() ? absl::UnavailableError("Decode stream ended before the region's answer") : ToAbsl(st);
  }
  if (!resp.has_region() || resp.region().bytes() != bytes)
    return absl::InternalError("Decode stream: the first response is not the region's answer");
  return resp.region();
}

namespace {

// Maps `bytes` bytes of the memory file the daemon shares: collected from its handoff
// socket with the region's one-time ticket, or opened by path from a daemon run with
// --data_plane_proc_paths.
absl::StatusOr<std::unique_ptr<SharedRegion>> MapShared(const v1::SharedRegion& answer, uint64_t bytes) {
  std::string what;
  int fd = -1;
  if (!answer.ticket().empty()) {
    what = absl::StrCat("shared region from ", answer.handoff_socket());
    absl::StatusOr<int> got = handoff::CollectFd(answer.handoff_socket(), answer.ticket());
    if (!got.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": ", got.status().message(), " (the daemon's host is needed)"));
    }
    fd = *got;
  } else {
    what = absl::StrCat("shared region ", answer.path());
    fd = open(answer.path().c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": ", std::strerror(errno), " (same host and user as the daemon needed)"));
    }
  }
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);  // the mapping keeps the file
  if (map == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap ", what, ": ", std::strerror(err)));
  return std::make_unique<SharedRegion>(static_cast<char*>(map), bytes);
}

v1::DecodeRequest CudaRegionRequest(absl::string_view ipc_handle, uint64_t offset, uint64_t bytes,
                                    uint32_t ring_entries) {
  v1::DecodeRequest req;
  v1::CudaRegion* region = req.mutable_open_cuda_region();
  region->set_ipc_handle(std::string(ipc_handle));
  region->set_offset(offset);
  region->set_bytes(bytes);
  req.set_region_ring_entries(ring_entries);
  return req;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedRegion>> DecodeStream::OpenRegion(uint64_t bytes, uint32_t ring_entries) {
  v1::DecodeRequest req;
  req.set_open_region_bytes(bytes);
  req.set_region_ring_entries(ring_entries);
  absl::StatusOr<v1::SharedRegion> answer = AskForRegion(req, bytes);
  if (!answer.ok()) return answer.status();
  return MapShared(*answer, bytes);
}

absl::Status DecodeStream::OpenCudaRegion(absl::string_view ipc_handle, uint64_t offset, uint64_t bytes) {
  return AskForRegion(CudaRegionRequest(ipc_handle, offset, bytes, 0), bytes).status();
}

absl::StatusOr<std::unique_ptr<SharedRegion>> DecodeStream::OpenCudaRegionWithRing(absl::string_view ipc_handle,
                                                                                   uint64_t offset, uint64_t bytes,
                                                                                   uint32_t ring_entries) {
  absl::StatusOr<v1::SharedRegion> answer =
      AskForRegion(CudaRegionRequest(ipc_handle, offset, bytes, ring_entries), bytes);
  if (!answer.ok()) return answer.status();
  if (answer->ring_bytes() != ring::RingBytes(ring_entries) || (answer->path().empty() && answer->ticket().empty()))
    return absl::InternalError("Decode stream: the region's answer holds no ring of the size asked for");
  return MapShared(*answer, answer->ring_bytes());
}

bool DecodeStream::Write(const v1::DecodeRequest& request) { return rw_->Write(request); }
bool DecodeStream::Read(v1::DecodeResponse* response) { return rw_->Read(response); }
bool DecodeStream::WritesDone() { return rw_->WritesDone(); }
grpc::Status DecodeStream::Finish() { return rw_->Finish(); }

}  // namespace latentd::client

namespace latentd::client {

Ring::Ring(SharedRegion* region, uint32_t entries, int spin_us)
    : base_(region->data()), entries_(entries), spin_us_(spin_us) {}

uint64_t Ring::bytes() const { return ring::RingBytes(entries_); }

absl::Status Ring::Submit(const Step* steps, size_t n) {
  auto* h = reinterpret_cast<ring::Header*>(base_);
  if (h->closed.load(std::memory_order_acquire) != 0)
    return absl::UnavailableError("ring: the server closed it (its Decode stream ended or the server is draining)");
  if (n > entries_ - outstanding()) {
    return absl::ResourceExhaustedError(absl::StrCat("ring: ", n, " steps with ", outstanding(),
                                                     " outstanding is over its ", entries_, " entries"));
  }
  char* sq = base_ + ring::SqOffset();
  for (size_t i = 0; i < n; ++i) {
    const Step& s = steps[i];
    if (s.sequence_id.size() > ring::kMaxSequenceId)
      return absl::InvalidArgumentError(absl::StrCat("ring: sequence_id of ", s.sequence_id.size(), " bytes"));
    auto* e = reinterpret_cast<ring::SqEntry*>(sq + static_cast<size_t>((tail_ + i) & (entries_ - 1)) *
                                                        sizeof(ring::SqEntry));
    e->request_id = s.request_id;
    e->layer = s.layer;
    e->s_q = s.s_q;
    e->causal = s.causal ? 1 : 0;
    e->trace = s.trace ? 1 : 0;
    e->sequence_id_bytes = static_cast<uint32_t>(s.sequence_id.size());
    e->q_offset = s.q_offset;
    e->kv_offset = s.kv_offset;
    e->out_offset = s.out_offset;
    e->lse_offset = s.lse_offset;
    e->layer_step = s.layer_step ? 1 : 0;
    e->hidden_offset = s.hidden_offset;
    e->has_position = s.position >= 0 ? 1 : 0;
    e->position = s.position >= 0 ? s.position : 0;
    std::memcpy(e->sequence_id, s.sequence_id.data(), s.sequence_id.size());
  }
  tail_ += static_cast<uint32_t>(n);
  h->sq_tail.store(tail_, std::memory_order_seq_cst);
  if (h->server_waiting.load(std::memory_order_seq_cst) != 0) ring::FutexWake(&h->sq_tail);
  return absl::OkStatus();
}

absl::Status Ring::Wait(size_t min, std::vector<Completion>* out, absl::Duration timeout) {
  auto* h = reinterpret_cast<ring::Header*>(base_);
  const char* cq = base_ + ring::CqOffset(entries_);
  const absl::Time deadline = timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
  size_t got = 0;
  absl::Time active = absl::Now();
  while (got < min) {
    const uint32_t tail = h->cq_tail.load(std::memory_order_acquire);
    if (tail != head_) {
      for (; head_ != tail; ++head_, ++got) {
        const auto* c = reinterpret_cast<const ring::CqEntry*>(cq + static_cast<size_t>(head_ & (entries_ - 1)) *
                                                                         sizeof(ring::CqEntry));
        Completion& r = out->emplace_back();
        r.request_id = c->request_id;
        r.code = c->code;
        r.message.assign(c->message, std::min<uint32_t>(c->message_bytes, ring::kMaxMessage));
        r.has_timing = c->timing_us[0] != 0;
        if (r.has_timing) {
          v1::StepTiming& t = r.timing;
          t.set_received_us(c->timing_us[0]);
          t.set_parsed_us(c->timing_us[1]);
          t.set_submitted_us(c->timing_us[2]);
          t.set_batched_us(c->timing_us[3]);
          t.set_launched_us(c->timing_us[4]);
          t.set_finished_us(c->timing_us[5]);
          t.set_completed_us(c->timing_us[6]);
          t.set_response_us(c->timing_us[7]);
        }
      }
      h->cq_head.store(head_, std::memory_order_release);
      active = absl::Now();
      continue;
    }
    const absl::Time now = absl::Now();
    if (h->closed.load(std::memory_order_acquire) != 0) {
      // Steps the server took are still answered after it closed the ring; the rest never.
      const uint32_t taken = h->sq_head.load(std::memory_order_acquire);
      if (taken == head_ && h->cq_tail.load(std::memory_order_acquire) == head_) {
        return absl::UnavailableError(absl::StrCat("ring: the server closed it with ", tail_ - taken,
                                                   " steps not taken (its Decode stream ended or it is draining)"));
      }
    }
    if (now >= deadline) return absl::DeadlineExceededError(absl::StrCat("ring: ", got, " of ", min, " completions"));
    if (now - active < absl::Microseconds(spin_us_)) continue;
    h->client_waiting.store(1, std::memory_order_seq_cst);
    if (h->cq_tail.load(std::memory_order_seq_cst) == tail) {
      const int64_t left = deadline == absl::InfiniteFuture() ? 5000 : absl::ToInt64Microseconds(deadline - now);
      ring::FutexWait(&h->cq_tail, tail, std::clamp<int64_t>(left, 1, 5000));
    }
    h->client_waiting.store(0, std::memory_order_relaxed);
  }
  return absl::OkStatus();
}

}  // namespace latentd::client
