// A small C++ client for latentd.v1.DecodeService: connection setup (TLS, bearer
// token, message limits), the unary RPCs, chunked AppendKv, health, and Decode streams.
// Thread-safe: one Client may be shared by many threads; each DecodeStream by one writer
// and one reader thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/latentd.grpc.pb.h"

namespace latentd::client {

struct ClientOptions {
  std::string target = "127.0.0.1:50051";
  std::string auth_token;        // sent as 'authorization: Bearer <token>' when set
  bool tls = false;              // TLS with tls_root_certs_pem (or the system roots when empty)
  std::string tls_root_certs_pem;
  std::string tls_server_name;   // overrides the name checked against the certificate
  int64_t append_chunk_bytes = 4 << 20;  // AppendKv message size (rounded down to whole rows)
  int64_t max_send_bytes = 64 << 20;
  // Longest wait between reconnection attempts after a connection failed (0: gRPC's
  // default, up to 120 s); short lets a client find a restarted daemon soon.
  int max_reconnect_backoff_ms = 0;
  // A TCP connection of this client's own. gRPC otherwise shares one connection among
  // every channel of the process to the same target with the same arguments, so two
  // clients (a runner's layers, a bulk uploader beside a decoder) would queue behind
  // each other's messages in one HTTP/2 connection. false: share it.
  bool own_connection = true;
};

// Request metadata naming the sequence an RPC is about: a proxy in front of several
// daemons (deploy/nginx) hashes on it to pick the daemon. Set on every sequence RPC.
inline constexpr char kRouteHeader[] = "x-latentd-route";

// Per-call settings of the sequence RPCs.
struct CallOptions {
  // x-latentd-route value; empty: the sequence id the call names (ForkSequence: the
  // parent's, since the fork lives beside it).
  std::string route;
  // Deadline of the call; infinite: none.
  absl::Duration timeout = absl::InfiniteDuration();
};

// Sizes of one step's tensors for a server's shape.
struct Shape {
  int num_layers = 0, h_q = 0, h_kv = 0;
  int64_t q_row_bytes = 0, kv_row_bytes = 0, out_row_bytes = 0;
  explicit Shape(const v1::ServerInfo& info);
  Shape() = default;
  int64_t QBytes(int s_q) const { return s_q * q_row_bytes; }
  int64_t KvBytes(int64_t rows) const { return rows * kv_row_bytes; }
  int64_t OutBytes(int s_q) const { return s_q * out_row_bytes; }
  int64_t LseBytes(int s_q) const { return int64_t{s_q} * h_q * 4; }
};

grpc::Status FromAbsl(const absl::Status& s);
absl::Status ToAbsl(const grpc::Status& s);

class DecodeStream;

class Client {
 public:
  // Connects and fetches ServerInfo (fails if the server is unreachable within timeout).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options,
                                                         absl::Duration timeout = absl::Seconds(10));

  const v1::ServerInfo& info() const { return info_; }
  const Shape& shape() const { return shape_; }

  // A client of a server whose ServerInfo is already known (say from another daemon of
  // the same model), without waiting for the connection: RPCs fail UNAVAILABLE while
  // the server is unreachable. For ShardedClient's daemons that are down at start.
  static std::unique_ptr<Client> Open(const ClientOptions& options, const v1::ServerInfo& info);

  absl::StatusOr<v1::ServerInfo> GetInfo(absl::Duration timeout = absl::InfiniteDuration());
  absl::StatusOr<std::string> CreateSequence(absl::string_view sequence_id = "", const CallOptions& call = {});
  // With prefix reuse: `page_keys` from PageKeys (page_keys.h) over the prompt's token
  // ids. The response's prefix_tokens rows of every layer are already there; append
  // from that row on.
  absl::StatusOr<v1::CreateSequenceResponse> CreateSequenceWithPrefix(absl::string_view sequence_id,
                                                                      const std::vector<std::string>& page_keys,
                                                                      const CallOptions& call = {});
  // Uploads rows [n, h_kv, 576] to one layer in chunks over one AppendKv stream.
  absl::StatusOr<v1::AppendKvResponse> AppendKv(absl::string_view sequence_id, int layer, absl::string_view kv,
                                                const CallOptions& call = {});
  // The layer API: hidden states [n, hidden_size] whose latent rows the server computes
  // and appends to one layer, in chunks over one AppendKv stream.
  absl::StatusOr<v1::AppendKvResponse> AppendHidden(absl::string_view sequence_id, int layer,
                                                    absl::string_view hidden, const CallOptions& call = {});
  // Several layers' rows in one AppendKv stream (kv_per_layer[l] may be empty).
  absl::StatusOr<v1::AppendKvResponse> AppendKvLayers(absl::string_view sequence_id,
                                                      const std::vector<absl::string_view>& kv_per_layer,
                                                      const CallOptions& call = {});
  absl::StatusOr<std::string> ForkSequence(absl::string_view sequence_id, absl::string_view new_sequence_id = "",
                                           const CallOptions& call = {});
  absl::StatusOr<int64_t> ReleaseSequence(absl::string_view sequence_id, const CallOptions& call = {});
  // Lengths per layer and pages held: to resync after a stream broke part-way.
  absl::StatusOr<v1::SequenceInfo> GetSequence(absl::string_view sequence_id, const CallOptions& call = {});
  // Export and import (docs/export-import.md). ExportSequence streams the sequence's
  // chunks (header first, last = true at the end) into on_chunk, which may move from
  // them; an error from on_chunk cancels the stream and is returned. Answered by a
  // draining daemon too. max_chunk_bytes: 0 for the server's default (1 MiB).
  absl::Status ExportSequence(absl::string_view sequence_id,
                              const std::function<absl::Status(v1::SequenceChunk&)>& on_chunk,
                              int64_t max_chunk_bytes = 0, const CallOptions& call = {});
  // Creates a sequence from an export's chunks as they came (the first names the id to
  // create in its sequence_id, or the header's id is used). All or nothing on the
  // server. The route defaults to the header's sequence id.
  absl::StatusOr<v1::ImportSequenceResponse> ImportSequence(const std::vector<v1::SequenceChunk>& chunks,
                                                            const CallOptions& call = {});
  // Moves a sequence to `to` under the same id: export here, import there chunk by
  // chunk (nothing is held whole), then release here. If the export or the import
  // fails, the import is abandoned (nothing is left on `to`) and the sequence stays
  // here. A release that fails after the import leaves the sequence in both places:
  // the move still succeeds, with the release's error in Moved::released.
  struct Moved {
    v1::ImportSequenceResponse imported;
    absl::Status released;  // the release of the source
  };
  absl::StatusOr<Moved> MoveSequence(absl::string_view sequence_id, Client* to, const CallOptions& call = {},
                                     const CallOptions& to_call = {});

  // grpc.health.v1 status of the whole server: "SERVING", "NOT_SERVING", ...
  absl::StatusOr<std::string> Health(absl::Duration timeout = absl::Seconds(5));

  // route: the stream's x-latentd-route (through a proxy, every step of the stream
  // goes to the daemon this key hashes to, so a stream should carry one sequence's
  // steps, or those of sequences sharing the key; ShardedClient groups them).
  std::unique_ptr<DecodeStream> OpenDecodeStream(absl::string_view route = "");

  // Sends the steps on a fresh stream (in messages of up to steps_per_message), closes
  // the sending side and collects every result by request_id. The stream's final
  // status is returned when it is not OK. The stream's route is call.route, or the
  // first step's sequence id; call.timeout bounds the whole stream.
  absl::StatusOr<std::map<uint64_t, v1::StepResult>> DecodeAll(const std::vector<v1::DecodeStep>& steps,
                                                              int steps_per_message = 16,
                                                              const CallOptions& call = {});

  // Adds the bearer token (if any) to a context for calls made through stub().
  void Prepare(grpc::ClientContext* ctx) const;
  // Prepare plus the route header (when route is not empty) and the deadline.
  void Prepare(grpc::ClientContext* ctx, absl::string_view route, absl::Duration timeout) const;
  const ClientOptions& options() const { return options_; }
  v1::DecodeService::Stub* stub() { return stub_.get(); }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }

 private:
  Client() = default;
  void MakeChannel(const ClientOptions& options);
  absl::StatusOr<v1::AppendKvResponse> AppendKvParts(absl::string_view sequence_id,
                                                     const std::vector<std::pair<int, absl::string_view>>& parts,
                                                     const CallOptions& call, bool hidden = false);
  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::DecodeService::Stub> stub_;
  v1::ServerInfo info_;
  Shape shape_;
};

// A Decode stream's shared-memory region (same-host data plane), mapped read-write in
// this process: steps name offsets into it (DecodeStep.region) instead of carrying q/kv,
// and the server writes out/lse there. Unmapped on destruction; the server frees its
// side when the stream ends.
class SharedRegion {
 public:
  SharedRegion(char* data, uint64_t size) : data_(data), size_(size) {}
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;
  char* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  char* const data_;
  const uint64_t size_;
};

// The doorbell ring at the start of a stream's shared region (server/ring.h): steps are
// published into its submission queue and results read from its completion queue
// through shared memory, with no gRPC message per step. Tensors lie after bytes(). One
// thread at a time; the region and its stream must outlive it.
class Ring {
 public:
  struct Step {
    uint64_t request_id = 0;
    absl::string_view sequence_id;
    int32_t layer = 0;
    uint32_t s_q = 1;
    bool causal = false;
    bool trace = false;  // the completion carries the server's timestamps
    uint64_t q_offset = 0, kv_offset = 0, out_offset = 0, lse_offset = 0;  // as in RegionTensors
    // A layer step (the layer API): hidden states at hidden_offset, the layer's output
    // at out_offset; position < 0 leaves it to the server (the layer's length).
    bool layer_step = false;
    uint64_t hidden_offset = 0;
    int64_t position = -1;
  };
  struct Completion {
    uint64_t request_id = 0;
    int32_t code = 0;  // google.rpc code; 0: out and lse are in the region
    std::string message;
    bool has_timing = false;
    v1::StepTiming timing;  // for a traced step
  };
  // spin_us: how long Wait spins before it sleeps on the completion queue's futex.
  Ring(SharedRegion* region, uint32_t entries, int spin_us = 1000);
  uint32_t entries() const { return entries_; }
  uint64_t bytes() const;
  // Steps submitted whose completions have not been read yet.
  uint32_t outstanding() const { return tail_ - head_; }
  // Publishes the steps as one batch (the server submits what it takes at once together,
  // as one DecodeRequest). RESOURCE_EXHAUSTED when that would make more than entries()
  // outstanding; UNAVAILABLE once the server has closed the ring (its stream ended).
  absl::Status Submit(const Step* steps, size_t n);
  // Appends completions to *out until `min` have been appended. DEADLINE_EXCEEDED after
  // timeout; UNAVAILABLE when the server has closed the ring and nothing more will come.
  absl::Status Wait(size_t min, std::vector<Completion>* out, absl::Duration timeout = absl::InfiniteDuration());

 private:
  char* const base_;
  const uint32_t entries_;
  const int spin_us_;
  uint32_t tail_ = 0;  // steps published
  uint32_t head_ = 0;  // completions read
};

// One Decode stream (synchronous gRPC API): Write from one thread, Read from another.
class DecodeStream {
 public:
  explicit DecodeStream(Client* client, absl::string_view route = "",
                        absl::Duration timeout = absl::InfiniteDuration());
  ~DecodeStream();
  // Asks the server for a shared region of `bytes` bytes and maps it. Call before any
  // other Write and before reading: it writes one message and reads the answer. Works
  // only on the server's host, as the daemon's user.
  // ring_entries > 0 also asks for a doorbell ring of that many entries at the region's
  // start (DecodeRequest.region_ring_entries): drive it with client::Ring, and keep this
  // stream open for as long as the ring is used.
  absl::StatusOr<std::unique_ptr<SharedRegion>> OpenRegion(uint64_t bytes, uint32_t ring_entries = 0);
  // Offers `bytes` bytes of this process's device allocation, from `offset` on, as the
  // stream's region (DecodeRequest.open_cuda_region): ipc_handle is the allocation's
  // cudaIpcMemHandle_t (64 bytes, from cudaIpcGetMemHandle). Steps then name offsets
  // relative to that start, and the server's GPU reads q/kv and writes out/lse there.
  // Same rules as OpenRegion; the daemon must serve on the CUDA backend.
  absl::Status OpenCudaRegion(absl::string_view ipc_handle, uint64_t offset, uint64_t bytes);
  // The same with a doorbell ring of ring_entries entries (DecodeRequest.region_ring_entries):
  // the server keeps the ring in host memory of its own, mapped here as the returned
  // region (ring::RingBytes(ring_entries) bytes) for client::Ring; every offset of the
  // ring's steps names the device region.
  absl::StatusOr<std::unique_ptr<SharedRegion>> OpenCudaRegionWithRing(absl::string_view ipc_handle, uint64_t offset,
                                                                       uint64_t bytes, uint32_t ring_entries);
  bool Write(const v1::DecodeRequest& request);
  bool Read(v1::DecodeResponse* response);
  bool WritesDone();
  // After Read returned false.
  grpc::Status Finish();
  // Abandons the stream (the server drops its unstarted steps).
  void Cancel() { ctx_.TryCancel(); }

 private:
  // Writes a message that opens a region and reads the server's answer to it.
  absl::StatusOr<v1::SharedRegion> AskForRegion(const v1::DecodeRequest& req, uint64_t bytes);
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> rw_;
};

}  // namespace latentd::client
