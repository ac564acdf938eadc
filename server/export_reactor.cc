// The ExportSequence stream's reactor (export_reactor.h).
#include "server/export_reactor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/params.h"
#include "server/rpc_status.h"
#include "server/transfer_worker.h"

namespace latentd::server {
namespace {

constexpr char kWhere[] = "ExportSequence: ";

v1::DType ToProtoDType(kernels::DType d) { return d == kernels::DType::kFP16 ? v1::FP16 : v1::BF16; }

void FillHeader(const engine::SequenceExportHeader& h, v1::SequenceHeader* out) {
  out->set_format_version(static_cast<uint32_t>(h.format_version));
  out->set_num_layers(h.num_layers);
  out->set_num_heads_kv(h.num_heads_kv);
  out->set_page_size(h.page_size);
  out->set_dtype(ToProtoDType(h.dtype));
  out->set_kv_dtype(h.kv_dtype);
  out->set_row_bytes(h.row_bytes);
  out->set_sequence_id(h.sequence_id);
  for (int64_t len : h.lengths) out->add_lengths(len);
  for (const std::string& k : h.page_keys) out->add_page_keys(k);
}

}  // namespace

ExportReactor::ExportReactor(DecodeServiceImpl* service, const v1::ExportSequenceRequest& request,
                             grpc::Status initial)
    : hold_(service), service_(service), sequence_id_(request.sequence_id()) {
  if (!initial.ok()) {
    Finish(std::move(initial));
    return;
  }
  const ServiceOptions& o = service_->options();
  const int64_t asked = request.max_chunk_bytes() > 0 ? request.max_chunk_bytes() : o.transfer_chunk_bytes;
  chunk_bytes_ = static_cast<size_t>(std::min(asked, o.max_transfer_chunk_bytes));
  service_->transfers().Post([this] { Produce(); });
}

void ExportReactor::Produce() {
  chunk_.Clear();
  if (exporter_ == nullptr) {
    auto ex = service_->engine()->ExportSequence(sequence_id_);
    if (!ex.ok()) {
      Finish(Prefixed(ex.status(), kWhere));
      return;
    }
    exporter_ = *std::move(ex);
    FillHeader(exporter_->header(), chunk_.mutable_header());
    for (int64_t len : exporter_->header().lengths) rows_left_ += len;
  }
  if (rows_left_ > 0) {
    auto more = exporter_->Next(chunk_bytes_, &rows_);
    if (more.ok() && !*more) more = absl::InternalError("the export ended before the header's rows");
    if (!more.ok()) {
      Finish(Prefixed(more.status(), absl::StrCat(kWhere, "after ", chunks_, " chunks: ")));
      return;
    }
    chunk_.set_layer(rows_.layer);
    chunk_.set_first_row(rows_.first_row);
    chunk_.set_rows(std::move(rows_.bytes));
    rows_.bytes.clear();
    rows_left_ -= rows_.rows;
  }
  if (rows_left_ == 0) {
    // The exporter counts the export as complete when it reports its end.
    engine::SequenceExportChunk none;
    (void)exporter_->Next(chunk_bytes_, &none);
    chunk_.set_last(true);
    chunk_.set_total_rows(exporter_->total_rows());
    chunk_.set_crc32(exporter_->crc32());
    last_written_ = true;
  }
  ++chunks_;
  StartWrite(&chunk_);
}

void ExportReactor::OnWriteDone(bool ok) {
  if (!ok) {
    Finish(grpc::Status(grpc::StatusCode::CANCELLED,
                        absl::StrCat(kWhere, "the client stopped reading after ", chunks_, " chunks")));
    return;
  }
  if (last_written_) {
    Finish(grpc::Status::OK);
    return;
  }
  service_->transfers().Post([this] { Produce(); });
}

void ExportReactor::OnDone() {
  service_->CloseTransfer(/*import=*/false);
  delete this;
}

}  // namespace latentd::server
