// Turns TransportOptions into gRPC channel arguments, the same ones on the server's
// builder and on a client's channel.
#include "tools/serving/transport.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace latentd::server {
namespace {

std::vector<std::pair<const char*, int>> Args(const TransportOptions& t) {
  std::vector<std::pair<const char*, int>> out;
  if (t.stream_window_bytes > 0)
    out.emplace_back(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                     static_cast<int>(std::min<int64_t>(t.stream_window_bytes, int64_t{1} << 30)));
  if (t.max_frame_bytes > 0)
    out.emplace_back(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, std::clamp(t.max_frame_bytes, 16384, 16777215));
  if (t.bdp_probe >= 0) out.emplace_back(GRPC_ARG_HTTP2_BDP_PROBE, t.bdp_probe != 0 ? 1 : 0);
  if (t.min_read_chunk_bytes > 0) out.emplace_back(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, t.min_read_chunk_bytes);
  if (t.max_read_chunk_bytes > 0) out.emplace_back(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, t.max_read_chunk_bytes);
  if (t.write_buffer_bytes > 0) out.emplace_back(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, t.write_buffer_bytes);
  return out;
}

}  // namespace

void ApplyTransport(const TransportOptions& t, grpc::ServerBuilder* builder) {
  for (const auto& [name, value] : Args(t)) builder->AddChannelArgument(name, value);
}

void ApplyTransport(const TransportOptions& t, grpc::ChannelArguments* args) {
  for (const auto& [name, value] : Args(t)) args->SetInt(name, value);
}

}  // namespace latentd::server
