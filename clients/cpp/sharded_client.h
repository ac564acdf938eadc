// Scale-out client: one latentd daemon per GPU, sequences spread over them.
//
// Two ways to reach a set of daemons, one class:
//
// - Client-side hashing (targets = every daemon): each sequence is placed by consistent
//   hashing of its id (hash_ring.h, the same ring as the Python client's), each daemon
//   is health-checked (grpc.health.v1), and every RPC goes straight to the sequence's
//   daemon. While a daemon is down its sequences fail UNAVAILABLE at once, without an
//   RPC; CreateSequence places a new (or re-created) sequence on the next live daemon of
//   its ring walk.
// - Through a proxy (via_proxy, one target: deploy/nginx, which hashes on the
//   x-latentd-route header): the client sets the header and groups each batch's steps
//   into one Decode stream per route key, since the proxy pins a whole stream to the
//   daemon of the key it was opened with. Re-creating a sequence whose daemon is down
//   moves it under a salted route key (SaltedRoute).
//
// DecodeBatch is the model runner's per-layer call: the steps of many sequences are
// split by daemon (by route key through a proxy), each group goes out as one message
// (more only beyond max_steps_per_message or the message size limit) on its own Decode
// stream, all groups at once, and the results are merged by request_id. Every step gets
// a result: a step whose daemon is down, or whose stream broke before its result came,
// gets code UNAVAILABLE (14); the batch deadline bounds the wait, so nothing hangs.
// UNAVAILABLE means the sequence's daemon was lost or cannot be reached: re-create the
// sequence (CreateSequence with the same id) and upload its KV again. A step cut off by
// a broken stream may or may not have been applied: after a recovery, GetSequence tells.
//
// Draining daemons (client-side hashing, move_on_drain): when a daemon reports that it
// drains (health NOT_SERVING, or steps refused UNAVAILABLE while its GetInfo says
// draining), the client moves every sequence it knows on that daemon to the sequence's
// next live daemon on the ring (ExportSequence there, ImportSequence on the new owner,
// ReleaseSequence on the old; docs/export-import.md) and sends the batch's refused
// steps again there, so a SIGTERM loses none of its sequences. Moves wait for this
// client's batches and uploads under way, so no row of its own is in flight meanwhile.
// A sequence this client knows is one it created, forked, moved or used.
//
// A fork lives on its parent's daemon: the client records it (and re-created sequences)
// and routes them there. Those records are this process's; another process finds a
// sequence by the hash of its id, which agrees whenever the sequence was created while
// its owner was up and is not a fork.
//
// Thread-safe: any number of threads may call any method.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/health.grpc.pb.h"
#include "proto/latentd.grpc.pb.h"
#include "clients/cpp/client.h"
#include "clients/cpp/hash_ring.h"

namespace latentd::client {

struct ShardedClientOptions {
  // host:port of every daemon (client-side hashing), or of the one proxy (via_proxy).
  // Every client of one set of daemons must list the same strings (any order).
  std::vector<std::string> targets;
  bool via_proxy = false;
  // Token, TLS and chunking for every target (its target field is ignored).
  ClientOptions client;
  int virtual_nodes = HashRing::kDefaultVirtualNodes;

  absl::Duration connect_timeout = absl::Seconds(5);
  // Health checks of every daemon (client-side hashing only); zero: only CheckHealth().
  absl::Duration health_interval = absl::Seconds(1);
  absl::Duration health_timeout = absl::Seconds(2);
  // A daemon is down after this many failed checks in a row; at once when it cannot be
  // reached (UNAVAILABLE) or reports NOT_SERVING (draining).
  int unhealthy_after = 2;

  absl::Duration rpc_timeout = absl::Seconds(30);     // unary RPCs
  absl::Duration upload_timeout = absl::Minutes(10);  // one AppendKv stream
  absl::Duration batch_timeout = absl::Seconds(30);   // one DecodeBatch
  int max_steps_per_message = 256;
  // Through a proxy, CreateSequence of a sequence whose daemon is down retries with
  // salted route keys (SaltedRoute in hash_ring.h, which hash elsewhere) this many times in all: each
  // lands on a dead daemon with the dead ones' share of the ring (1/3 for one of 3).
  int proxy_create_attempts = 16;
  // Move a draining daemon's sequences to their next owner (client-side hashing only).
  bool move_on_drain = true;
  absl::Duration move_timeout = absl::Minutes(2);  // one sequence's export and import
};

struct TargetStatus {
  std::string target;
  bool healthy = false;
  std::string last_error;  // why it is down (empty while healthy)
};

class ShardedClient {
 public:
  // Connects to every target at once. Targets that do not answer are marked down and
  // found later by the health checks; at least one must answer, and all that answer
  // must serve the same model shape.
  static absl::StatusOr<std::unique_ptr<ShardedClient>> Connect(const ShardedClientOptions& options);
  ~ShardedClient();

  ShardedClient(const ShardedClient&) = delete;
  ShardedClient& operator=(const ShardedClient&) = delete;

  const v1::ServerInfo& info() const { return info_; }
  const Shape& shape() const { return shape_; }
  int num_targets() const { return static_cast<int>(targets_.size()); }
  const std::string& target(int i) const { return targets_[i]->address; }
  bool via_proxy() const { return options_.via_proxy; }
  const HashRing& ring() const { return ring_; }

  // The daemon a key hashes to (index into targets), whatever their health: the same
  // answer in every C++ and Python client given the same targets.
  int Owner(absl::string_view key) const { return ring_.Owner(key); }
  // Where this client sends the sequence's RPCs: where it created, re-created or
  // forked it, else its owner. Always 0 through a proxy.
  int Locate(absl::string_view sequence_id) const;
  // The x-latentd-route value of the sequence's RPCs: its id, a fork's parent's key,
  // or, through a proxy, the salted key a re-creation used.
  std::string RouteKey(absl::string_view sequence_id) const;

  bool Healthy(int target) const;
  std::vector<TargetStatus> Status() const;
  // Checks every daemon now (also done every health_interval).
  void CheckHealth();

  // Empty id: a random one (128 bits from the OS, as 32 hex digits), chosen here so that
  // it can be hashed. Placed on the first live daemon of the id's ring walk (through a
  // proxy: the key's daemon, then salted keys while that one is down).
  absl::StatusOr<std::string> CreateSequence(absl::string_view sequence_id = "");
  absl::StatusOr<v1::AppendKvResponse> AppendKv(absl::string_view sequence_id, int layer, absl::string_view kv);
  absl::StatusOr<v1::AppendKvResponse> AppendKvLayers(absl::string_view sequence_id,
                                                      const std::vector<absl::string_view>& kv_per_layer);
  // The layer API (every daemon's ServerInfo.layer_api, checked at Connect with the
  // rest of the model): hidden states in, the rows computed by the sequence's daemon.
  // Layer steps (DecodeStep.hidden) go through DecodeBatch like any other.
  absl::StatusOr<v1::AppendKvResponse> AppendHidden(absl::string_view sequence_id, int layer,
                                                    absl::string_view hidden);
  // The fork is created beside its parent and routed there.
  absl::StatusOr<std::string> ForkSequence(absl::string_view sequence_id, absl::string_view new_sequence_id = "");
  absl::StatusOr<int64_t> ReleaseSequence(absl::string_view sequence_id);
  absl::StatusOr<v1::SequenceInfo> GetSequence(absl::string_view sequence_id);

  // One batch of steps of any sequences (request_ids unique within the call, else
  // INVALID_ARGUMENT): returns a result for every step, keyed by request_id. Steps a
  // draining daemon refused run again on their sequence's new daemon once it moved.
  absl::StatusOr<std::map<uint64_t, v1::StepResult>> DecodeBatch(std::vector<v1::DecodeStep> steps);

  // Moves every sequence this client knows on `target` to its next live daemon on the
  // ring, if the target says it is draining (GetInfo); returns how many moved. Also
  // done by DecodeBatch and the health checks when they see a daemon draining.
  int MoveOffDraining(int target);
  // Sequences moved off draining daemons so far.
  int64_t moved_sequences() const;

  // The per-daemon client (through a proxy, target 0 is the proxy).
  Client* client(int target) { return targets_[target]->client.get(); }

 private:
  struct Target {
    std::string address;
    std::unique_ptr<Client> client;
    std::unique_ptr<grpc::health::v1::Health::Stub> health;
    // Guarded by ShardedClient::mu_.
    bool healthy = false;
    bool verified = false;  // its ServerInfo was read and matches the model
    int failures = 0;
    std::string last_error;
    bool draining = false;       // its GetInfo said so
    absl::Time last_drain_probe;  // when MoveOffDraining last asked it
  };
  struct Placement {
    int target = 0;
    std::string route;
  };
  struct Group;

  explicit ShardedClient(const ShardedClientOptions& options);
  Placement PlacementLocked(absl::string_view sequence_id) const;
  bool UsableLocked(int target) const;
  absl::Status DownError(int target, absl::string_view sequence_id) const;
  void MarkDown(int target, absl::string_view why);
  // Marks the target down when a call to it failed UNAVAILABLE.
  void Observe(int target, const absl::Status& status);
  // Runs an RPC of one existing sequence on its daemon.
  template <typename Fn>
  auto OnSequence(absl::string_view sequence_id, absl::Duration timeout, Fn fn) -> decltype(fn(nullptr, CallOptions()));
  void HealthLoop();
  // A batch's steps in one round: results into *results, the steps that came back
  // UNAVAILABLE (with their tensors) into *unavailable and their daemons into *from.
  void DecodeRound(std::vector<v1::DecodeStep> steps, std::map<uint64_t, v1::StepResult>* results,
                   std::vector<v1::DecodeStep>* unavailable, std::vector<int>* from);
  void Know(absl::string_view sequence_id);  // under mu_

  const ShardedClientOptions options_;
  const HashRing ring_;
  std::vector<std::unique_ptr<Target>> targets_;
  v1::ServerInfo info_;
  Shape shape_;

  mutable std::mutex mu_;
  std::map<std::string, Placement, std::less<>> placements_;  // guarded by mu_
  std::set<std::string, std::less<>> known_;                  // guarded by mu_
  int64_t moved_ = 0;                                         // guarded by mu_
  // Batches and uploads enter it together; a move waits for them to leave and holds
  // new ones back meanwhile (a mover is never starved by a steady flow of batches).
  class WorkGate {
   public:
    void Enter();
    void Leave();
    void Lock();
    void Unlock();

   private:
    std::mutex mu_;
    std::condition_variable cv_;
    int active_ = 0;     // guarded by mu_
    bool mover_ = false;  // guarded by mu_
  };
  struct Working {
    explicit Working(WorkGate* g) : gate(g) { gate->Enter(); }
    ~Working() { gate->Leave(); }
    WorkGate* gate;
  };
  WorkGate work_;
  std::mutex move_mu_;  // one mover at a time

  std::mutex health_mu_;  // serializes CheckHealth
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;  // guarded by stop_mu_
  std::thread health_thread_;
};

// The code a step gets when its stream ended with status before its result came:
// UNAVAILABLE for a broken or refused stream, the stream's own code for the errors
// that are not about reaching the daemon (deadline, limits, auth, bad requests).
int MissingResultCode(const grpc::Status& status);

// 32 hex digits from 128 bits of OS randomness (as the daemon makes its ids).
absl::StatusOr<std::string> RandomSequenceId();

}  // namespace latentd::client
