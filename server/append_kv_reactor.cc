// The AppendKv stream's reactor (append_kv_reactor.h): reads row chunks, checks them
// against the sequence, and hands them to the service's upload thread.
#include "server/append_kv_reactor.h"

#include <malloc.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/slice.h"
#include "kernels/params.h"
#include "proto/ring.h"
#include "proto/wire.h"
#include "server/decode/step_validation.h"
#include "server/rpc_status.h"
#include "spdlog/spdlog.h"

namespace latentd::server {

using decode::CheckIdField;
using decode::CheckLayer;

AppendKvReactor::AppendKvReactor(DecodeServiceImpl* service, grpc::ByteBuffer* response, grpc::Status initial)
    : hold_(service), service_(service), response_(response) {
  if (!initial.ok()) {
    Finish(std::move(initial));
    return;
  }
  StartRead(&request_);
}

void AppendKvReactor::OnReadDone(bool ok) {
  if (!ok) {
    if (messages_ == 0) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "AppendKv: the stream had no messages; expected at least one naming sequence_id"));
      return;
    }
    if (lengths_.empty()) {
      // No message carried rows: the lengths (and the sequence's existence) come from
      // the engine, so the response says what the API promises (a short KV-lock read).
      auto info = service_->engine()->GetSequence(sequence_id_);
      if (!info.ok()) {
        Finish(Prefixed(info.status(), "AppendKv: "));
        return;
      }
      lengths_ = std::move(info->lengths);
    }
    v1::AppendKvResponse r;
    r.set_sequence_id(sequence_id_);
    r.set_tokens_appended(rows_);
    for (int64_t len : lengths_) r.add_lengths(len);
    bool own = false;
    grpc::Status st = grpc::SerializationTraits<v1::AppendKvResponse>::Serialize(r, response_, &own);
    Finish(st);
    return;
  }
  charged_ = static_cast<int64_t>(request_.Length());
  if (!service_->EnqueueUpload(this, charged_)) {
    Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("AppendKv message ", messages_, ": the server already holds ",
                                     service_->options().max_upload_bytes,
                                     " bytes of uploads not yet applied (--max_upload_bytes); ", rows_,
                                     " rows of this stream were appended; retry the rest later")));
  }
  // Otherwise ApplyQueued runs on the upload thread; no read is outstanding meanwhile.
}

void AppendKvReactor::OnDone() {
  service_->CloseCall();
  delete this;
}

void AppendKvReactor::ApplyQueued() {
  grpc::Status st = Apply();
  request_.Clear();
  service_->upload_bytes_.fetch_sub(charged_, std::memory_order_relaxed);
  charged_ = 0;
  if (!st.ok()) {
    Finish(st);
    return;
  }
  StartRead(&request_);
}

grpc::Status AppendKvReactor::Apply() {
  const DecodeServiceImpl::Shape& sh = service_->shape();
  const std::string where = absl::StrCat("AppendKv message ", messages_, ": ");
  ++messages_;
  if (service_->draining()) return Unavailable();
  wire::AppendFields f;
  f.sequence_id = &id_buf_;
  f.kv = &kv_buf_;
  f.hidden = &hidden_buf_;
  {
    grpc::ProtoBufferReader reader(&request_);
    absl::Status st = wire::ReadAppendKvRequest(&reader, 128, &f);
    if (!st.ok()) return Prefixed(st, where);
  }
  // Every message's id is checked; a client's bytes are never echoed back.
  absl::Status st;
  if (f.sequence_id_bytes > 128) {
    st = absl::InvalidArgumentError(absl::StrCat("sequence_id: malformed id (", f.sequence_id_bytes,
                                                 " bytes); expected 1 to 128 characters from [A-Za-z0-9._:-]"));
  } else {
    st = CheckIdField("sequence_id", id_buf_, /*allow_empty=*/messages_ > 1);
  }
  if (!st.ok()) return Prefixed(st, where);
  if (messages_ == 1) {
    sequence_id_ = id_buf_;
  } else if (!id_buf_.empty() && id_buf_ != sequence_id_) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(where, "sequence_id: differs from the stream's first message; expected "
                                            "one sequence per AppendKv stream (empty or the same id)"));
  }
  st = CheckLayer("layer", f.layer, sh.num_layers);
  if (!st.ok()) return Prefixed(st, where);
  if (f.hidden_bytes > 0) return ApplyHidden(f, where);
  const int64_t kb = static_cast<int64_t>(kv_buf_.size());
  if (kb % sh.kv_row_bytes != 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(where, "kv: ", kb, " bytes; expected a multiple of h_kv * 576 * 2 = ",
                                     sh.kv_row_bytes, " bytes ([n, ", sh.h_kv, ", 576] in the server dtype)"));
  }
  if (kb == 0) return grpc::Status::OK;  // nothing to append (e.g. a message naming the id only)
  // The engine copies the rows into its pool in bounded chunks under its KV lock.
  auto lengths = service_->engine()->AppendKv(sequence_id_, f.layer, kv_buf_);
  if (kv_buf_.capacity() > kKeepBufferBytes) std::string().swap(kv_buf_);
  if (!lengths.ok()) {
    return Prefixed(lengths.status(), absl::StrCat(where, "(", rows_, " rows appended before it) "));
  }
  rows_ += kb / sh.kv_row_bytes;
  lengths_ = std::move(lengths->lengths);
  return grpc::Status::OK;
}

grpc::Status AppendKvReactor::ApplyHidden(const wire::AppendFields& f, const std::string& where) {
  const DecodeServiceImpl::Shape& sh = service_->shape();
  if (!kv_buf_.empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(where, "kv, hidden: expected one of them per message, got both"));
  }
  if (sh.hidden_row_bytes == 0) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat(where, "hidden: this daemon serves the kernel-level API only (ServerInfo.layer_api "
                                            "is false; start it with --model_dir holding the checkpoint's weights)"));
  }
  const int64_t hb = static_cast<int64_t>(hidden_buf_.size());
  if (hb % sh.hidden_row_bytes != 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(where, "hidden: ", hb, " bytes; expected a multiple of hidden_size * 2 = ",
                                     sh.hidden_row_bytes, " bytes ([n, ", sh.hidden_row_bytes / 2,
                                     "] in the server dtype)"));
  }
  // The engine computes the rows (GEMMs without its locks) and appends them like kv.
  auto lengths = service_->engine()->AppendHidden(sequence_id_, f.layer, hidden_buf_);
  if (hidden_buf_.capacity() > kKeepBufferBytes) std::string().swap(hidden_buf_);
  if (!lengths.ok()) {
    return Prefixed(lengths.status(), absl::StrCat(where, "(", rows_, " rows appended before it) "));
  }
  rows_ += hb / sh.hidden_row_bytes;
  lengths_ = std::move(lengths->lengths);
  return grpc::Status::OK;
}
}  // namespace latentd::server
