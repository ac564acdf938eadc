// HTTP/2 transport settings for both ends of a gRPC connection: flow-control window,
// frame size and TCP read size. Used by //tools/serving:grpc_floor to measure their effect; the
// daemon keeps gRPC's defaults, which measured as fast (docs/benchmarks.md, 2026-12-03).
#pragma once

#include <cstdint>

#include "grpcpp/grpcpp.h"

namespace latentd::server {

// Zero or negative fields leave gRPC's own default in place.
struct TransportOptions {
  // Per-stream receive window announced to the peer (HTTP/2 SETTINGS_INITIAL_WINDOW_SIZE
  // through gRPC's lookahead): how many bytes of one message may be in flight before the
  // receiver must answer with a WINDOW_UPDATE.
  int64_t stream_window_bytes = 0;
  // Largest HTTP/2 DATA frame this end accepts (16 KiB .. 16 MiB - 1).
  int max_frame_bytes = 0;
  // 1: gRPC sizes the window from its bandwidth-delay estimate; 0: the window above is fixed.
  int bdp_probe = -1;
  // Bounds of one TCP read.
  int min_read_chunk_bytes = 0;
  int max_read_chunk_bytes = 0;
  // Bytes gRPC buffers for a stream's writes before it holds the writer back.
  int write_buffer_bytes = 0;
};

void ApplyTransport(const TransportOptions& t, grpc::ServerBuilder* builder);
void ApplyTransport(const TransportOptions& t, grpc::ChannelArguments* args);

}  // namespace latentd::server
