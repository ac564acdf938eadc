// Scale-out client over several daemons or a hashing proxy; see sharded_client.h.
#include "clients/cpp/sharded_client.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace latentd::client {
namespace {

constexpr char kDecodeService[] = "latentd.v1.DecodeService";

// Room for the message's own framing beyond its steps' bytes.
constexpr int64_t kMessageSlack = 64 << 10;

bool SameModel(const v1::ServerInfo& a, const v1::ServerInfo& b) {
  return a.num_layers() == b.num_layers() && a.num_heads_q() == b.num_heads_q() &&
         a.num_heads_kv() == b.num_heads_kv() && a.head_dim_qk() == b.head_dim_qk() &&
         a.head_dim_v() == b.head_dim_v() && a.dtype() == b.dtype() && a.softmax_scale() == b.softmax_scale() &&
         // The layer API: the same weights' slice everywhere (data-parallel replicas of one
         // tensor-parallel rank), so a sequence's outputs do not depend on its daemon.
         a.layer_api() == b.layer_api() && a.hidden_size() == b.hidden_size() &&
         a.tensor_parallel() == b.tensor_parallel() && a.tensor_rank() == b.tensor_rank();
}

std::string ModelString(const v1::ServerInfo& i) {
  std::string s = absl::StrCat("layers ", i.num_layers(), " h_q ", i.num_heads_q(), " h_kv ", i.num_heads_kv(),
                               " dtype ", v1::DType_Name(i.dtype()), " scale ", i.softmax_scale());
  if (i.layer_api())
    absl::StrAppend(&s, " layer API hidden ", i.hidden_size(), " rank ", i.tensor_rank(), "/", i.tensor_parallel());
  return s;
}

v1::StepResult Failed(uint64_t request_id, int code, std::string message) {
  v1::StepResult r;
  r.set_request_id(request_id);
  r.set_code(code);
  r.set_message(std::move(message));
  return r;
}

std::string StatusString(const grpc::Status& s) {
  return absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code())), ": ",
                      s.error_message());
}

// One Decode stream carrying one group's messages: writes them in order (the last with
// the half-close), reads every response until the server ends the stream, and records
// the final status. Every operation is started before StartCall or from a reaction, so
// no hold is needed; the context's deadline bounds the whole call.
class BatchCall final : public grpc::ClientBidiReactor<v1::DecodeRequest, v1::DecodeResponse> {
 public:
  explicit BatchCall(std::vector<v1::DecodeRequest> messages) : messages_(std::move(messages)) {}

  grpc::ClientContext* context() { return &ctx_; }

  void Start(v1::DecodeService::Stub* stub) {
    stub->async()->Decode(&ctx_, this);
    StartRead(&response_);
    WriteNext();
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    // !ok: the stream is broken; the read fails too and OnDone has the status.
    if (ok && ++next_ < messages_.size()) WriteNext();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& r : *response_.mutable_results()) results_.push_back(std::move(r));
    }
    response_.Clear();
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = status;
    done_ = true;
    done_cv_.notify_all();
  }

  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return done_; });
  }

  // After Wait.
  std::vector<v1::StepResult>& results() { return results_; }
  std::vector<v1::DecodeRequest>& messages() { return messages_; }
  const grpc::Status& status() const { return status_; }

 private:
  void WriteNext() {
    if (next_ + 1 == messages_.size()) {
      StartWriteLast(&messages_[next_], grpc::WriteOptions());
    } else {
      StartWrite(&messages_[next_]);
    }
  }

  grpc::ClientContext ctx_;
  std::vector<v1::DecodeRequest> messages_;
  size_t next_ = 0;  // touched only by Start and OnWriteDone, which gRPC orders
  v1::DecodeResponse response_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  std::vector<v1::StepResult> results_;  // guarded by mu_
  grpc::Status status_;                  // guarded by mu_
  bool done_ = false;                    // guarded by mu_
};

}  // namespace

struct ShardedClient::Group {
  int target = 0;
  std::string route;
  std::vector<v1::DecodeStep> steps;
  std::unique_ptr<BatchCall> call;
};

int MissingResultCode(const grpc::Status& status) {
  switch (status.error_code()) {
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::UNIMPLEMENTED:
      return status.error_code();
    default:
      // UNAVAILABLE, and what a stream cut off in the middle reads as (INTERNAL for a
      // proxy's reset, UNKNOWN, CANCELLED), or an OK end that left a step unanswered.
      return grpc::StatusCode::UNAVAILABLE;
  }
}

absl::StatusOr<std::string> RandomSequenceId() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t r = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("sequence_id: cannot read OS randomness: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(r);
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

ShardedClient::ShardedClient(const ShardedClientOptions& options)
    : options_(options), ring_(options.via_proxy ? std::vector<std::string>{} : options.targets,
                               options.virtual_nodes) {}

absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClient::Connect(const ShardedClientOptions& options) {
  if (options.targets.empty()) return absl::InvalidArgumentError("targets: empty");
  if (options.via_proxy && options.targets.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("targets: via_proxy takes one target (the proxy), got ", options.targets.size()));
  }
  {
    std::set<std::string> seen;
    for (const std::string& t : options.targets) {
      if (t.empty()) return absl::InvalidArgumentError("targets: an empty address");
      if (!seen.insert(t).second) return absl::InvalidArgumentError(absl::StrCat("targets: ", t, " listed twice"));
    }
  }
  std::unique_ptr<ShardedClient> c(new ShardedClient(options));
  ClientOptions base = options.client;
  if (base.max_reconnect_backoff_ms <= 0) base.max_reconnect_backoff_ms = 1000;
  const int n = static_cast<int>(options.targets.size());

  if (options.via_proxy) {
    // RPCs without a route key (GetInfo) go round-robin behind the proxy, so one that
    // reaches a daemon that is down is tried again.
    ClientOptions o = base;
    o.target = options.targets[0];
    absl::Status last;
    std::unique_ptr<Client> client;
    for (int attempt = 0; attempt < std::max(1, options.proxy_create_attempts); ++attempt) {
      auto r = Client::Connect(o, options.connect_timeout);
      if (r.ok()) {
        client = std::move(*r);
        break;
      }
      last = r.status();
      if (last.code() != absl::StatusCode::kUnavailable) break;
    }
    if (client == nullptr) return last;
    auto t = std::make_unique<Target>();
    t->address = o.target;
    t->healthy = t->verified = true;
    c->info_ = client->info();
    t->client = std::move(client);
    c->targets_.push_back(std::move(t));
    c->shape_ = Shape(c->info_);
    return c;
  }

  // Every daemon at once, so that those that are down cost one timeout, not one each.
  std::vector<absl::StatusOr<std::unique_ptr<Client>>> connected(n);
  {
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i) {
      threads.emplace_back([&, i] {
        ClientOptions o = base;
        o.target = options.targets[i];
        connected[i] = Client::Connect(o, options.connect_timeout);
      });
    }
    for (auto& t : threads) t.join();
  }
  int first = -1;
  for (int i = 0; i < n; ++i) {
    if (connected[i].ok()) {
      first = i;
      break;
    }
  }
  if (first < 0) {
    std::string why;
    for (int i = 0; i < n; ++i) {
      absl::StrAppend(&why, i ? "; " : "", options.targets[i], ": ", connected[i].status().message());
    }
    return absl::UnavailableError(absl::StrCat("no target reachable: ", why));
  }
  c->info_ = (*connected[first])->info();
  c->shape_ = Shape(c->info_);
  for (int i = 0; i < n; ++i) {
    auto t = std::make_unique<Target>();
    t->address = options.targets[i];
    if (connected[i].ok()) {
      if (!SameModel((*connected[i])->info(), c->info_)) {
        return absl::InvalidArgumentError(absl::StrCat("targets disagree on the model: ", options.targets[first],
                                                       " serves ", ModelString(c->info_), ", ", t->address,
                                                       " serves ", ModelString((*connected[i])->info())));
      }
      t->client = std::move(*connected[i]);
      t->healthy = t->verified = true;
    } else {
      ClientOptions o = base;
      o.target = t->address;
      t->client = Client::Open(o, c->info_);
      t->last_error = std::string(connected[i].status().message());
    }
    t->health = grpc::health::v1::Health::NewStub(t->client->channel());
    c->targets_.push_back(std::move(t));
  }
  if (options.health_interval > absl::ZeroDuration()) {
    c->health_thread_ = std::thread([p = c.get()] { p->HealthLoop(); });
  }
  return c;
}

ShardedClient::~ShardedClient() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (health_thread_.joinable()) health_thread_.join();
}

void ShardedClient::HealthLoop() {
  std::unique_lock<std::mutex> lock(stop_mu_);
  while (!stop_) {
    if (stop_cv_.wait_for(lock, absl::ToChronoNanoseconds(options_.health_interval), [this] { return stop_; })) {
      break;
    }
    lock.unlock();
    CheckHealth();
    lock.lock();
  }
}

void ShardedClient::CheckHealth() {
  if (options_.via_proxy) return;
  std::lock_guard<std::mutex> serial(health_mu_);
  struct Probe {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    grpc::Status status;
  };
  const int n = num_targets();
  std::vector<Probe> probes(n);
  // One blocking check per daemon, all at once on threads of their own (a daemon that
  // does not answer costs health_timeout, not n of them). Threads rather than gRPC's
  // callback API: their start and join order the probes' memory for ThreadSanitizer,
  // which cannot see gRPC's uninstrumented completion queue.
  std::vector<std::thread> checks;
  checks.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    Probe& p = probes[i];
    p.ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.health_timeout));
    p.request.set_service(kDecodeService);
    checks.emplace_back([&p, stub = targets_[i]->health.get()] { p.status = stub->Check(&p.ctx, p.request, &p.response); });
  }
  for (std::thread& t : checks) t.join();
  std::vector<int> draining_now;
  for (int i = 0; i < n; ++i) {
    Target& t = *targets_[i];
    const Probe& p = probes[i];
    const bool serving =
        p.status.ok() && p.response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    if (serving) {
      bool verified;
      {
        std::lock_guard<std::mutex> lock(mu_);
        verified = t.verified;
      }
      std::string why;
      if (!verified) {
        // A daemon seen for the first time (down at Connect): it must serve our model.
        auto info = t.client->GetInfo(options_.health_timeout);
        if (!info.ok()) {
          why = absl::StrCat("GetInfo: ", info.status().message());
        } else if (!SameModel(*info, info_)) {
          why = absl::StrCat("serves ", ModelString(*info), ", the others ", ModelString(info_));
        }
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (why.empty()) {
        t.verified = true;
        t.healthy = true;
        t.failures = 0;
        t.last_error.clear();
      } else {
        t.healthy = false;
        t.last_error = why;
      }
      continue;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (p.status.ok()) {
      // NOT_SERVING: draining, new work is refused (its sequences move below).
      draining_now.push_back(i);
      t.healthy = false;
      t.last_error = absl::StrCat("health ",
                                  grpc::health::v1::HealthCheckResponse::ServingStatus_Name(p.response.status()));
    } else {
      t.last_error = absl::StrCat("health check: ", StatusString(p.status));
      if (p.status.error_code() == grpc::StatusCode::UNAVAILABLE || ++t.failures >= options_.unhealthy_after) {
        t.healthy = false;
      }
    }
  }
  if (options_.move_on_drain) {
    for (int i : draining_now) MoveOffDraining(i);
  }
}

bool ShardedClient::Healthy(int target) const {
  std::lock_guard<std::mutex> lock(mu_);
  return UsableLocked(target);
}

std::vector<TargetStatus> ShardedClient::Status() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TargetStatus> out;
  for (const auto& t : targets_) out.push_back({t->address, t->healthy, t->healthy ? "" : t->last_error});
  return out;
}

bool ShardedClient::UsableLocked(int target) const {
  return options_.via_proxy || (target >= 0 && target < num_targets() && targets_[target]->healthy);
}

ShardedClient::Placement ShardedClient::PlacementLocked(absl::string_view sequence_id) const {
  auto it = placements_.find(sequence_id);
  if (it != placements_.end()) return it->second;
  return {options_.via_proxy ? 0 : ring_.Owner(sequence_id), std::string(sequence_id)};
}

int ShardedClient::Locate(absl::string_view sequence_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return PlacementLocked(sequence_id).target;
}

std::string ShardedClient::RouteKey(absl::string_view sequence_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return PlacementLocked(sequence_id).route;
}

absl::Status ShardedClient::DownError(int target, absl::string_view sequence_id) const {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    why = targets_[target]->last_error;
  }
  return absl::UnavailableError(absl::StrCat("sequence ", sequence_id, ": its daemon ", targets_[target]->address,
                                             " is down (", why,
                                             "); re-create it (CreateSequence places it on a live daemon)"));
}

void ShardedClient::MarkDown(int target, absl::string_view why) {
  if (options_.via_proxy) return;
  std::lock_guard<std::mutex> lock(mu_);
  Target& t = *targets_[target];
  t.healthy = false;
  t.failures = std::max(t.failures, options_.unhealthy_after);
  t.last_error = std::string(why);
}

void ShardedClient::Observe(int target, const absl::Status& status) {
  if (status.code() == absl::StatusCode::kUnavailable) MarkDown(target, status.message());
}

template <typename Fn>
auto ShardedClient::OnSequence(absl::string_view sequence_id, absl::Duration timeout, Fn fn)
    -> decltype(fn(nullptr, CallOptions())) {
  Placement p;
  bool usable;
  {
    std::lock_guard<std::mutex> lock(mu_);
    p = PlacementLocked(sequence_id);
    usable = UsableLocked(p.target);
  }
  if (!usable) return DownError(p.target, sequence_id);
  CallOptions call;
  call.route = p.route;
  call.timeout = timeout;
  auto result = fn(targets_[p.target]->client.get(), call);
  Observe(p.target, result.status());
  return result;
}

absl::StatusOr<std::string> ShardedClient::CreateSequence(absl::string_view sequence_id) {
  std::string id(sequence_id);
  if (id.empty()) {
    auto r = RandomSequenceId();
    if (!r.ok()) return r.status();
    id = *r;
  }
  CallOptions call;
  call.timeout = options_.rpc_timeout;

  if (options_.via_proxy) {
    // The key's daemon first (or the key an earlier creation used), then salted keys,
    // which hash to other daemons, while the one tried is unreachable. The salt is a
    // well-mixed hash: nginx hashes with CRC32, under which keys that differ only in a
    // short counter land near each other on its ring (often on one daemon).
    std::vector<std::string> routes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = placements_.find(id);
      if (it != placements_.end()) routes.push_back(it->second.route);
    }
    for (int k = 0; static_cast<int>(routes.size()) < std::max(1, options_.proxy_create_attempts); ++k) {
      std::string r = SaltedRoute(id, k);
      if (std::find(routes.begin(), routes.end(), r) == routes.end()) routes.push_back(std::move(r));
    }
    std::string tried;
    for (const std::string& route : routes) {
      call.route = route;
      auto r = targets_[0]->client->CreateSequence(id, call);
      if (r.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        placements_[id] = {0, route};
        Know(id);
        return r;
      }
      if (r.status().code() != absl::StatusCode::kUnavailable) return r.status();
      absl::StrAppend(&tried, tried.empty() ? "" : "; ", route, ": ", r.status().message());
    }
    return absl::UnavailableError(absl::StrCat("CreateSequence ", id, " through ", targets_[0]->address, ": ",
                                               routes.size(), " route keys tried, each unavailable (", tried, ")"));
  }

  // A sequence this client placed stays where it is while that daemon is up (creating
  // it there again answers ALREADY_EXISTS); otherwise the ring walk's live daemons.
  std::vector<int> candidates;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = placements_.find(id);
    if (it != placements_.end() && UsableLocked(it->second.target)) {
      candidates.push_back(it->second.target);
    } else {
      for (int t : ring_.Preference(id)) {
        if (UsableLocked(t)) candidates.push_back(t);
      }
    }
  }
  if (candidates.empty()) {
    return absl::UnavailableError(
        absl::StrCat("CreateSequence ", id, ": every daemon is down (", num_targets(), " targets)"));
  }
  call.route = id;
  absl::Status last;
  for (int t : candidates) {
    auto r = targets_[t]->client->CreateSequence(id, call);
    if (r.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      placements_[id] = {t, id};
      Know(id);
      return r;
    }
    last = r.status();
    if (last.code() != absl::StatusCode::kUnavailable) return last;
    MarkDown(t, last.message());
  }
  return last;
}

absl::StatusOr<v1::AppendKvResponse> ShardedClient::AppendKv(absl::string_view sequence_id, int layer,
                                                             absl::string_view kv) {
  Working work(&work_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Know(sequence_id);
  }
  return OnSequence(sequence_id, options_.upload_timeout, [&](Client* c, const CallOptions& call) {
    return c->AppendKv(sequence_id, layer, kv, call);
  });
}

absl::StatusOr<v1::AppendKvResponse> ShardedClient::AppendHidden(absl::string_view sequence_id, int layer,
                                                                 absl::string_view hidden) {
  Working work(&work_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Know(sequence_id);
  }
  return OnSequence(sequence_id, options_.upload_timeout, [&](Client* c, const CallOptions& call) {
    return c->AppendHidden(sequence_id, layer, hidden, call);
  });
}

absl::StatusOr<v1::AppendKvResponse> ShardedClient::AppendKvLayers(
    absl::string_view sequence_id, const std::vector<absl::string_view>& kv_per_layer) {
  Working work(&work_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Know(sequence_id);
  }
  return OnSequence(sequence_id, options_.upload_timeout, [&](Client* c, const CallOptions& call) {
    return c->AppendKvLayers(sequence_id, kv_per_layer, call);
  });
}

absl::StatusOr<std::string> ShardedClient::ForkSequence(absl::string_view sequence_id,
                                                        absl::string_view new_sequence_id) {
  std::string fork_id(new_sequence_id);
  if (fork_id.empty()) {
    auto r = RandomSequenceId();
    if (!r.ok()) return r.status();
    fork_id = *r;
  }
  Working work(&work_);
  Placement parent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    parent = PlacementLocked(sequence_id);
  }
  auto r = OnSequence(sequence_id, options_.rpc_timeout, [&](Client* c, const CallOptions& call) {
    return c->ForkSequence(sequence_id, fork_id, call);
  });
  if (r.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    placements_[*r] = parent;
    Know(*r);
  }
  return r;
}

absl::StatusOr<int64_t> ShardedClient::ReleaseSequence(absl::string_view sequence_id) {
  auto r = OnSequence(sequence_id, options_.rpc_timeout, [&](Client* c, const CallOptions& call) {
    return c->ReleaseSequence(sequence_id, call);
  });
  // Forgotten unless the daemon may still hold it (a timeout on a live daemon).
  const absl::StatusCode code = r.status().code();
  if (r.ok() || code == absl::StatusCode::kNotFound || code == absl::StatusCode::kUnavailable) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = placements_.find(sequence_id);
    if (it != placements_.end()) placements_.erase(it);
    auto k = known_.find(sequence_id);
    if (k != known_.end()) known_.erase(k);
  }
  return r;
}

absl::StatusOr<v1::SequenceInfo> ShardedClient::GetSequence(absl::string_view sequence_id) {
  return OnSequence(sequence_id, options_.rpc_timeout, [&](Client* c, const CallOptions& call) {
    return c->GetSequence(sequence_id, call);
  });
}

absl::StatusOr<std::map<uint64_t, v1::StepResult>> ShardedClient::DecodeBatch(std::vector<v1::DecodeStep> steps) {
  {
    std::set<uint64_t> ids;
    for (const auto& s : steps) {
      if (!ids.insert(s.request_id()).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("DecodeBatch: request_id ", s.request_id(), " appears twice in one batch"));
      }
    }
  }
  std::map<uint64_t, v1::StepResult> results;
  std::vector<v1::DecodeStep> unavailable;
  std::vector<int> from;  // the daemon that refused each
  {
    Working work(&work_);
    DecodeRound(std::move(steps), &results, &unavailable, &from);
  }
  if (unavailable.empty() || !options_.move_on_drain || options_.via_proxy) return results;
  // Refused by a daemon that may be draining: if it is, its sequences move, and the
  // refused steps (which it never ran) go again to their new daemons, once.
  // Another thread (or the health checks) may have moved them already: what counts is
  // that the daemon that refused a step drains and its sequence now lives elsewhere.
  for (int t : std::set<int>(from.begin(), from.end())) MoveOffDraining(t);
  std::vector<v1::DecodeStep> again;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < unavailable.size(); ++i) {
      const int t = PlacementLocked(unavailable[i].sequence_id()).target;
      if (targets_[from[i]]->draining && t != from[i] && UsableLocked(t)) again.push_back(std::move(unavailable[i]));
    }
  }
  if (again.empty()) return results;
  std::vector<v1::DecodeStep> still;
  std::vector<int> still_from;
  Working work(&work_);
  DecodeRound(std::move(again), &results, &still, &still_from);
  return results;
}

void ShardedClient::DecodeRound(std::vector<v1::DecodeStep> steps, std::map<uint64_t, v1::StepResult>* out,
                                std::vector<v1::DecodeStep>* unavailable, std::vector<int>* from) {
  std::map<uint64_t, v1::StepResult>& results = *out;
  // By daemon; through a proxy by route key, since a stream goes where its key does.
  std::map<std::string, Group> groups;
  struct Refused {
    uint64_t request_id;
    int target;
    std::string sequence_id;
  };
  std::vector<Refused> refused;  // steps of daemons that are down
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : steps) {
      Know(s.sequence_id());
      Placement p = PlacementLocked(s.sequence_id());
      if (!UsableLocked(p.target)) {
        refused.push_back({s.request_id(), p.target, s.sequence_id()});
        unavailable->push_back(std::move(s));
        from->push_back(p.target);
        continue;
      }
      const std::string key = options_.via_proxy ? p.route : std::to_string(p.target);
      Group& g = groups[key];
      if (g.steps.empty()) {
        g.target = p.target;
        g.route = std::move(p.route);
      }
      g.steps.push_back(std::move(s));
    }
  }
  for (const Refused& r : refused) {
    results[r.request_id] =
        Failed(r.request_id, grpc::StatusCode::UNAVAILABLE, std::string(DownError(r.target, r.sequence_id).message()));
  }

  // Messages below both the step count and the size limit of the daemons.
  int64_t byte_limit = options_.client.max_send_bytes;
  if (info_.max_message_bytes() > 0) byte_limit = std::min<int64_t>(byte_limit, info_.max_message_bytes());
  byte_limit = std::max<int64_t>(byte_limit - kMessageSlack, 1);
  const int per_message = std::max(1, options_.max_steps_per_message);
  const absl::Time deadline = absl::Now() + options_.batch_timeout;
  for (auto& [key, g] : groups) {
    std::vector<v1::DecodeRequest> messages(1);
    int64_t bytes = 0;
    for (auto& s : g.steps) {
      const int64_t size = static_cast<int64_t>(s.ByteSizeLong()) + 16;
      if (messages.back().steps_size() > 0 &&
          (messages.back().steps_size() >= per_message || bytes + size > byte_limit)) {
        messages.emplace_back();
        bytes = 0;
      }
      // The tensors move into the message; the rest stays for a failure result.
      v1::DecodeStep* out = messages.back().add_steps();
      out->set_request_id(s.request_id());
      out->set_sequence_id(s.sequence_id());
      out->set_layer(s.layer());
      out->set_causal(s.causal());
      out->set_timeout_ms(s.timeout_ms());
      out->set_q(std::move(*s.mutable_q()));
      out->set_kv(std::move(*s.mutable_kv()));
      bytes += size;
    }
    g.call = std::make_unique<BatchCall>(std::move(messages));
    Client* c = targets_[g.target]->client.get();
    c->Prepare(g.call->context(), g.route, absl::InfiniteDuration());
    g.call->context()->set_deadline(absl::ToChronoTime(deadline));
  }
  for (auto& [key, g] : groups) g.call->Start(targets_[g.target]->client->stub());
  for (auto& [key, g] : groups) g.call->Wait();

  for (auto& [key, g] : groups) {
    std::set<uint64_t> mine;
    for (const auto& s : g.steps) mine.insert(s.request_id());
    for (auto& r : g.call->results()) {
      if (mine.count(r.request_id())) results[r.request_id()] = std::move(r);
    }
    const grpc::Status& st = g.call->status();
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE) MarkDown(g.target, st.error_message());
    const int code = MissingResultCode(st);
    for (const auto& s : g.steps) {
      if (results.count(s.request_id())) continue;
      std::string where = targets_[g.target]->address;
      if (options_.via_proxy) absl::StrAppend(&where, " (route ", g.route, ")");
      results[s.request_id()] = Failed(
          s.request_id(), code,
          absl::StrCat("no result: the Decode stream to ", where, " ended with ", StatusString(st)));
    }
    // The refused steps, tensors back from their messages, for a caller that may send
    // them again elsewhere.
    for (auto& m : g.call->messages()) {
      for (auto& step : *m.mutable_steps()) {
        if (results[step.request_id()].code() != grpc::StatusCode::UNAVAILABLE) continue;
        unavailable->push_back(std::move(step));
        from->push_back(g.target);
      }
    }
  }
}

void ShardedClient::Know(absl::string_view sequence_id) {
  if (known_.find(sequence_id) == known_.end()) known_.emplace(sequence_id);
}

int64_t ShardedClient::moved_sequences() const {
  std::lock_guard<std::mutex> lock(mu_);
  return moved_;
}

int ShardedClient::MoveOffDraining(int target) {
  if (options_.via_proxy || target < 0 || target >= num_targets()) return 0;
  std::lock_guard<std::mutex> one_mover(move_mu_);
  std::vector<std::string> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& id : known_) {
      if (PlacementLocked(id).target == target) ids.push_back(id);
    }
    Target& t = *targets_[target];
    if (ids.empty()) return 0;
    // A daemon that is gone (not draining) is asked again only after a while.
    if (!t.draining && absl::Now() - t.last_drain_probe < options_.health_interval) return 0;
    t.last_drain_probe = absl::Now();
  }
  Target& t = *targets_[target];
  auto info = t.client->GetInfo(options_.health_timeout);
  if (!info.ok() || !info->draining()) return 0;
  MarkDown(target, "draining");
  {
    std::lock_guard<std::mutex> lock(mu_);
    t.draining = true;
  }
  // No batch or upload of this client is under way meanwhile: every row it sent is in.
  work_.Lock();
  int moved = 0;
  for (const std::string& id : ids) {
    int to = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (PlacementLocked(id).target != target || !known_.count(id)) continue;  // released or moved meanwhile
      for (int c : ring_.Preference(id)) {
        if (c != target && UsableLocked(c)) {
          to = c;
          break;
        }
      }
    }
    if (to < 0) break;  // nowhere to go
    CallOptions from_call, to_call;
    from_call.route = to_call.route = id;
    from_call.timeout = to_call.timeout = options_.move_timeout;
    auto r = t.client->MoveSequence(id, targets_[to]->client.get(), from_call, to_call);
    std::lock_guard<std::mutex> lock(mu_);
    if (r.ok()) {
      placements_[id] = {to, id};
      ++moved;
      ++moved_;
    } else if (r.status().code() == absl::StatusCode::kNotFound) {
      known_.erase(id);  // released there (its idle TTL), or moved by another client
    }
  }
  work_.Unlock();
  return moved;
}

void ShardedClient::WorkGate::Enter() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !mover_; });
  ++active_;
}

void ShardedClient::WorkGate::Leave() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--active_ == 0) cv_.notify_all();
}

void ShardedClient::WorkGate::Lock() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !mover_; });
  mover_ = true;
  cv_.wait(lock, [this] { return active_ == 0; });
}

void ShardedClient::WorkGate::Unlock() {
  std::lock_guard<std::mutex> lock(mu_);
  mover_ = false;
  cv_.notify_all();
}

}  // namespace latentd::client
