// The AppendKv stream's reactor: a client stream of row chunks for one sequence, each
// applied on the service's upload thread as it arrives. Private to //server:service.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/wire.h"
#include "server/service.h"

namespace latentd::server {

// Its lifetime is simpler than Decode's: gRPC deletes it through OnDone, which follows
// Finish, and no thread touches it after its own Finish or StartRead call; between a
// read completing and the upload thread applying it, no operation is outstanding.
class AppendKvReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  AppendKvReactor(DecodeServiceImpl* service, grpc::ByteBuffer* response, grpc::Status initial);

  void OnReadDone(bool ok) override;

  void OnDone() override;

  // The upload thread: applies the message just read, then reads the next or finishes.
  void ApplyQueued();

 private:
  grpc::Status Apply();
  // A message with AppendKvRequest.hidden (the layer API): the engine computes its rows.
  grpc::Status ApplyHidden(const wire::AppendFields& f, const std::string& where);

  static constexpr size_t kKeepBufferBytes = 4 << 20;

  DecodeServiceImpl::ReactorHold hold_;  // first: destroyed last
  DecodeServiceImpl* const service_;
  grpc::ByteBuffer* const response_;
  grpc::ByteBuffer request_;
  std::string id_buf_, kv_buf_, hidden_buf_;
  std::string sequence_id_;
  std::vector<int64_t> lengths_;
  int64_t rows_ = 0;
  int64_t charged_ = 0;  // bytes of the message waiting for the upload thread
  int messages_ = 0;
};

}  // namespace latentd::server
