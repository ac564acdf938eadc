// The ExportSequence stream's reactor: a sequence's header, then its stored rows in
// chunks read on the service's transfer thread, then a last chunk with the totals.
// Private to //server:service.
#pragma once

#include <cstdint>
#include <memory>

#include "engine/engine.h"
#include "grpcpp/grpcpp.h"
#include "server/service.h"

namespace latentd::server {

// One write is outstanding at a time, and between a write completing and the transfer
// thread reading the next chunk none is: Finish is called once, by whichever of the two
// holds the stream, and gRPC deletes the reactor through OnDone after it.
class ExportReactor final : public grpc::ServerWriteReactor<v1::SequenceChunk> {
 public:
  ExportReactor(DecodeServiceImpl* service, const v1::ExportSequenceRequest& request, grpc::Status initial);

  void OnWriteDone(bool ok) override;
  void OnDone() override;

 private:
  // The transfer thread: reads the next chunk and starts its write, or finishes.
  void Produce();

  DecodeServiceImpl::ReactorHold hold_;  // first: destroyed last
  DecodeServiceImpl* const service_;
  const std::string sequence_id_;
  size_t chunk_bytes_ = 0;
  std::unique_ptr<engine::SequenceExporter> exporter_;
  v1::SequenceChunk chunk_;
  engine::SequenceExportChunk rows_;
  int64_t rows_left_ = 0;  // rows of the header's lengths not yet sent
  int chunks_ = 0;
  bool last_written_ = false;
};

}  // namespace latentd::server
