// The ImportSequence stream's reactor (import_reactor.h).
#include "server/import_reactor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/rpc_status.h"
#include "server/transfer_worker.h"

namespace latentd::server {
namespace {

constexpr char kWhere[] = "ImportSequence: ";

}  // namespace

ImportReactor::ImportReactor(DecodeServiceImpl* service, grpc::CallbackServerContext* ctx,
                             v1::ImportSequenceResponse* response, grpc::Status initial)
    : hold_(service), service_(service), ctx_(ctx), response_(response), last_chunk_us_(absl::ToUnixMicros(absl::Now())) {
  service_->RegisterImport(this);
  if (!initial.ok()) {
    Finish(std::move(initial));
    return;
  }
  StartRead(&chunk_);
}

void ImportReactor::OnReadDone(bool ok) {
  if (!ok) {
    // The client half-closed (or went away) before the last chunk: nothing is imported;
    // the importer gives its pages back with the reactor.
    importer_.reset();
    Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(kWhere, "the stream ended after ", chunks_,
                                     " chunks without its last one (last = true); nothing was imported")));
    return;
  }
  service_->transfers().Post([this] { Apply(); });
}

bool ImportReactor::CancelIfStalled(absl::Time cutoff) {
  if (absl::FromUnixMicros(last_chunk_us_.load(std::memory_order_relaxed)) >= cutoff) return false;
  if (cancelled_.exchange(true)) return false;
  ctx_->TryCancel();  // the outstanding read fails, and the stream ends with nothing imported
  return true;
}

void ImportReactor::Apply() {
  bool committed = false;
  grpc::Status st = ApplyChunk(&committed);
  last_chunk_us_.store(absl::ToUnixMicros(absl::Now()), std::memory_order_relaxed);
  chunk_.Clear();
  if (!st.ok()) {
    importer_.reset();  // all or nothing: the reserved pages go back now
    Finish(st);
    return;
  }
  if (committed) {
    Finish(grpc::Status::OK);
    return;
  }
  StartRead(&chunk_);
}

grpc::Status ImportReactor::ApplyChunk(bool* committed) {
  const int index = chunks_++;
  const std::string where = absl::StrCat(kWhere, "chunk[", index, "].");
  if (service_->draining()) return Unavailable();
  const ServiceOptions& o = service_->options();
  if (index == 0) {
    if (!chunk_.has_header()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat(where, "header: missing; the first chunk carries the export's header"));
    }
    const v1::SequenceHeader& p = chunk_.header();
    engine::SequenceExportHeader h;
    h.format_version = static_cast<int>(p.format_version());
    h.num_layers = p.num_layers();
    h.num_heads_kv = p.num_heads_kv();
    h.page_size = p.page_size();
    if (p.dtype() == v1::BF16) {
      h.dtype = kernels::DType::kBF16;
    } else if (p.dtype() == v1::FP16) {
      h.dtype = kernels::DType::kFP16;
    } else {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat(where, "header.dtype: expected BF16 or FP16, got ", p.dtype()));
    }
    h.kv_dtype = p.kv_dtype();
    h.row_bytes = p.row_bytes();
    h.sequence_id = p.sequence_id();
    h.lengths.assign(p.lengths().begin(), p.lengths().end());
    h.page_keys.assign(p.page_keys().begin(), p.page_keys().end());
    auto im = service_->engine()->ImportSequence(h, chunk_.sequence_id());
    if (!im.ok()) return Prefixed(im.status(), where);
    importer_ = *std::move(im);
    row_bytes_ = p.row_bytes();
  } else if (chunk_.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(where, "header: only the first chunk carries one"));
  } else if (!chunk_.sequence_id().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(where, "sequence_id: only the first chunk names the id to create"));
  }
  const int64_t rows_bytes = static_cast<int64_t>(chunk_.rows().size());
  if (rows_bytes > o.max_transfer_chunk_bytes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(where, "rows: ", rows_bytes, " bytes; expected at most --max_transfer_chunk_bytes=",
                                     o.max_transfer_chunk_bytes, " per chunk"));
  }
  if (rows_bytes > 0) {
    if (absl::Status st = importer_->Write(chunk_.layer(), chunk_.first_row(), chunk_.rows()); !st.ok()) {
      return Prefixed(st, where);
    }
  }
  if (!chunk_.last()) return grpc::Status::OK;
  auto lengths = importer_->Commit(chunk_.total_rows(), chunk_.crc32());
  if (!lengths.ok()) return Prefixed(lengths.status(), where);
  int64_t rows = 0;
  response_->set_sequence_id(lengths->sequence_id);
  for (int64_t len : lengths->lengths) {
    response_->add_lengths(len);
    rows += len;
  }
  response_->set_rows(rows);
  response_->set_bytes(rows * row_bytes_);
  *committed = true;
  return grpc::Status::OK;
}

void ImportReactor::OnDone() {
  service_->UnregisterImport(this);
  service_->CloseTransfer(/*import=*/true);
  delete this;
}

}  // namespace latentd::server
