// The ImportSequence stream's reactor: an export's chunks, each applied on the service's
// transfer thread as it arrives; the sequence is created when the last one checks out,
// and a stream that fails or ends early leaves nothing behind. Private to //server:service.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "engine/engine.h"
#include "grpcpp/grpcpp.h"
#include "server/service.h"

namespace latentd::server {

// As AppendKvReactor: one read outstanding at a time, none between a read completing and
// the transfer thread applying it; the stream holds one chunk at a time. The importer
// (and the pages it reserved) goes with the reactor unless the import was committed.
class ImportReactor final : public grpc::ServerReadReactor<v1::SequenceChunk> {
 public:
  ImportReactor(DecodeServiceImpl* service, grpc::CallbackServerContext* ctx, v1::ImportSequenceResponse* response,
                grpc::Status initial);

  void OnReadDone(bool ok) override;
  void OnDone() override;
  // Cancels the call when no chunk has arrived since `cutoff` (the service's stall
  // check, under its registry lock); true when it did.
  bool CancelIfStalled(absl::Time cutoff);

 private:
  // The transfer thread: applies the chunk just read, then reads the next or finishes.
  void Apply();
  grpc::Status ApplyChunk(bool* committed);

  DecodeServiceImpl::ReactorHold hold_;  // first: destroyed last
  DecodeServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;
  v1::ImportSequenceResponse* const response_;
  std::atomic<int64_t> last_chunk_us_;  // when the stream began or its last chunk was applied
  std::atomic<bool> cancelled_{false};
  v1::SequenceChunk chunk_;
  std::unique_ptr<engine::SequenceImporter> importer_;
  int64_t row_bytes_ = 0;
  int chunks_ = 0;
};

}  // namespace latentd::server
