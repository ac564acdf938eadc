// ShardedClient against in-process fake daemons (gRPC servers that keep a set of
// sequence ids and answer every step with their own name): placement by the ring,
// the route header, batches split per daemon and merged, forks beside their parent,
// health checks, and the failure paths: a daemon stopped, draining, down at start,
// serving another model, or hanging past the batch deadline. The real daemon, nginx
// and a killed process are tests/integration:cluster_test.
#include "clients/cpp/sharded_client.h"

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "proto/health.grpc.pb.h"
#include "proto/latentd.grpc.pb.h"

namespace latentd::client {
namespace {

v1::ServerInfo FakeInfo(int layers = 2) {
  v1::ServerInfo info;
  info.set_num_layers(layers);
  info.set_num_heads_q(16);
  info.set_num_heads_kv(1);
  info.set_head_dim_qk(576);
  info.set_head_dim_v(512);
  info.set_page_size(64);
  info.set_dtype(v1::BF16);
  info.set_softmax_scale(0.125f);
  info.set_max_message_bytes(64 << 20);
  info.set_backend("fake");
  return info;
}

std::string RouteOf(grpc::ServerContext* ctx) {
  auto it = ctx->client_metadata().find(kRouteHeader);
  return it == ctx->client_metadata().end() ? "" : std::string(it->second.data(), it->second.size());
}

// What one Decode stream brought.
struct StreamSeen {
  std::string route;
  int messages = 0;
  std::vector<std::string> sequences;
};

class FakeService final : public v1::DecodeService::Service {
 public:
  explicit FakeService(std::string name, v1::ServerInfo info) : name_(std::move(name)), info_(std::move(info)) {}

  std::atomic<bool> hang{false};              // Decode: read everything, answer nothing
  std::atomic<bool> refuse_own_route{false};  // CreateSequence fails UNAVAILABLE unless the route is salted

  grpc::Status GetInfo(grpc::ServerContext*, const v1::GetInfoRequest*, v1::ServerInfo* out) override {
    *out = info_;
    return grpc::Status::OK;
  }

  grpc::Status CreateSequence(grpc::ServerContext* ctx, const v1::CreateSequenceRequest* req,
                              v1::CreateSequenceResponse* resp) override {
    const std::string route = RouteOf(ctx);
    std::lock_guard<std::mutex> lock(mu_);
    routes_.push_back(route);
    if (refuse_own_route && route == req->sequence_id()) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "upstream down (fake)");
    }
    if (!sequences_.insert(req->sequence_id()).second) {
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "taken");
    }
    resp->set_sequence_id(req->sequence_id());
    return grpc::Status::OK;
  }

  grpc::Status AppendKv(grpc::ServerContext* ctx, grpc::ServerReader<v1::AppendKvRequest>* reader,
                        v1::AppendKvResponse* resp) override {
    v1::AppendKvRequest req;
    std::string id;
    int64_t rows = 0;
    while (reader->Read(&req)) {
      if (id.empty()) id = req.sequence_id();
      rows += static_cast<int64_t>(req.kv().size()) / (576 * 2) +
              (info_.hidden_size() > 0 ? static_cast<int64_t>(req.hidden().size()) / (info_.hidden_size() * 2) : 0);
    }
    std::lock_guard<std::mutex> lock(mu_);
    routes_.push_back(RouteOf(ctx));
    if (!sequences_.count(id)) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown " + id);
    resp->set_sequence_id(id);
    resp->set_tokens_appended(rows);
    return grpc::Status::OK;
  }

  grpc::Status ForkSequence(grpc::ServerContext* ctx, const v1::ForkSequenceRequest* req,
                            v1::ForkSequenceResponse* resp) override {
    std::lock_guard<std::mutex> lock(mu_);
    routes_.push_back(RouteOf(ctx));
    if (!sequences_.count(req->sequence_id())) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown");
    sequences_.insert(req->new_sequence_id());
    resp->set_sequence_id(req->new_sequence_id());
    return grpc::Status::OK;
  }

  grpc::Status ReleaseSequence(grpc::ServerContext* ctx, const v1::ReleaseSequenceRequest* req,
                               v1::ReleaseSequenceResponse* resp) override {
    std::lock_guard<std::mutex> lock(mu_);
    routes_.push_back(RouteOf(ctx));
    if (!sequences_.erase(req->sequence_id())) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown");
    resp->set_pages_freed(1);
    return grpc::Status::OK;
  }

  grpc::Status GetSequence(grpc::ServerContext* ctx, const v1::GetSequenceRequest* req,
                           v1::SequenceInfo* resp) override {
    std::lock_guard<std::mutex> lock(mu_);
    routes_.push_back(RouteOf(ctx));
    if (!sequences_.count(req->sequence_id())) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown");
    resp->set_sequence_id(req->sequence_id());
    return grpc::Status::OK;
  }

  grpc::Status Decode(grpc::ServerContext* ctx,
                      grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream) override {
    StreamSeen seen;
    seen.route = RouteOf(ctx);
    v1::DecodeRequest req;
    std::vector<v1::StepResult> results;
    while (stream->Read(&req)) {
      ++seen.messages;
      for (const auto& s : req.steps()) {
        seen.sequences.push_back(s.sequence_id());
        v1::StepResult r;
        r.set_request_id(s.request_id());
        r.set_message(name_);
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (!sequences_.count(s.sequence_id())) r.set_code(grpc::StatusCode::NOT_FOUND);
        }
        results.push_back(std::move(r));
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      streams_.push_back(seen);
    }
    if (hang) {
      while (!ctx->IsCancelled()) absl::SleepFor(absl::Milliseconds(5));
      return grpc::Status::CANCELLED;
    }
    v1::DecodeResponse resp;
    for (auto& r : results) {
      *resp.add_results() = std::move(r);
      // Two results per response, so that merging sees several responses.
      if (resp.results_size() == 2) {
        stream->Write(resp);
        resp.Clear();
      }
    }
    if (resp.results_size() > 0) stream->Write(resp);
    return grpc::Status::OK;
  }

  std::set<std::string> sequences() {
    std::lock_guard<std::mutex> lock(mu_);
    return sequences_;
  }
  std::vector<StreamSeen> streams() {
    std::lock_guard<std::mutex> lock(mu_);
    return streams_;
  }
  std::vector<std::string> routes() {
    std::lock_guard<std::mutex> lock(mu_);
    return routes_;
  }
  void ClearSeen() {
    std::lock_guard<std::mutex> lock(mu_);
    streams_.clear();
    routes_.clear();
  }

 private:
  const std::string name_;
  const v1::ServerInfo info_;
  std::mutex mu_;
  std::set<std::string> sequences_;
  std::vector<StreamSeen> streams_;
  std::vector<std::string> routes_;
};

class FakeHealth final : public grpc::health::v1::Health::Service {
 public:
  std::atomic<int> status{grpc::health::v1::HealthCheckResponse::SERVING};
  grpc::Status Check(grpc::ServerContext*, const grpc::health::v1::HealthCheckRequest*,
                     grpc::health::v1::HealthCheckResponse* resp) override {
    resp->set_status(static_cast<grpc::health::v1::HealthCheckResponse::ServingStatus>(status.load()));
    return grpc::Status::OK;
  }
};

// A fake daemon on a loopback port (0: a free one), stoppable and restartable there.
class FakeDaemon {
 public:
  explicit FakeDaemon(std::string name, int port = 0, v1::ServerInfo info = FakeInfo())
      : service(name, info), name_(std::move(name)) {
    grpc::ServerBuilder b;
    b.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(&service);
    b.RegisterService(&health);
    server_ = b.BuildAndStart();
  }
  ~FakeDaemon() { Stop(); }
  void Stop() {
    if (server_) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
      server_->Wait();
      server_.reset();
    }
  }
  bool ok() const { return server_ != nullptr && port_ > 0; }
  int port() const { return port_; }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }

  FakeService service;
  FakeHealth health;

 private:
  std::string name_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

v1::DecodeStep Step(uint64_t id, const std::string& seq, int layer = 0) {
  v1::DecodeStep s;
  s.set_request_id(id);
  s.set_sequence_id(seq);
  s.set_layer(layer);
  s.set_q(std::string(16 * 576 * 2, '\0'));
  s.set_kv(std::string(576 * 2, '\0'));
  return s;
}

class ShardedClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 3; ++i) {
      fakes_.push_back(std::make_unique<FakeDaemon>(absl::StrCat("fake-", i)));
      ASSERT_TRUE(fakes_.back()->ok());
    }
  }

  ShardedClientOptions Options() {
    ShardedClientOptions o;
    for (auto& f : fakes_) o.targets.push_back(f->target());
    o.health_interval = absl::ZeroDuration();  // the tests call CheckHealth themselves
    o.connect_timeout = absl::Seconds(10);
    o.health_timeout = absl::Seconds(5);
    o.batch_timeout = absl::Seconds(20);
    return o;
  }

  std::unique_ptr<ShardedClient> Connect(const ShardedClientOptions& o) {
    auto c = ShardedClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // Index of the fake that owns each of the sequences, by the fakes' own contents.
  int Holder(const std::string& seq) {
    for (int i = 0; i < static_cast<int>(fakes_.size()); ++i) {
      if (fakes_[i]->service.sequences().count(seq)) return i;
    }
    return -1;
  }

  std::vector<std::unique_ptr<FakeDaemon>> fakes_;
};

TEST_F(ShardedClientTest, RejectsBadTargetLists) {
  ShardedClientOptions o;
  EXPECT_EQ(ShardedClient::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.targets = {fakes_[0]->target(), fakes_[0]->target()};
  EXPECT_EQ(ShardedClient::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.targets = {fakes_[0]->target(), fakes_[1]->target()};
  o.via_proxy = true;
  EXPECT_EQ(ShardedClient::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ShardedClientTest, PlacesByTheRingAndSetsTheRouteHeader) {
  auto c = Connect(Options());
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->info().num_layers(), 2);
  std::vector<int> per(3, 0);
  for (int i = 0; i < 60; ++i) {
    const std::string id = absl::StrCat("seq-", i);
    ASSERT_TRUE(c->CreateSequence(id).ok());
    const int owner = c->Owner(id);
    EXPECT_EQ(owner, HashRing(Options().targets).Owner(id));
    EXPECT_EQ(c->Locate(id), owner);
    EXPECT_EQ(Holder(id), owner) << id;
    ++per[owner];
    ASSERT_TRUE(c->AppendKv(id, 0, std::string(3 * 576 * 2, '\0')).ok());
    ASSERT_TRUE(c->GetSequence(id).ok());
  }
  for (int n : per) EXPECT_GT(n, 5);
  // Every sequence RPC carried its sequence id as the route.
  for (auto& f : fakes_) {
    for (const std::string& r : f->service.routes()) EXPECT_EQ(r.rfind("seq-", 0), 0u) << r;
  }
  // A server-chosen id is made here, 32 hex digits, and placed by its hash.
  auto id = c->CreateSequence();
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(id->size(), 32u);
  EXPECT_EQ(Holder(*id), c->Owner(*id));
}

TEST_F(ShardedClientTest, BatchIsOneStreamAndMessagePerDaemonAndMergesByRequestId) {
  auto c = Connect(Options());
  ASSERT_NE(c, nullptr);
  std::vector<v1::DecodeStep> steps;
  for (int i = 0; i < 30; ++i) {
    const std::string id = absl::StrCat("b-", i);
    ASSERT_TRUE(c->CreateSequence(id).ok());
    steps.push_back(Step(1000 + i, id, i % 2));
  }
  for (auto& f : fakes_) f->service.ClearSeen();
  auto results = c->DecodeBatch(steps);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 30u);
  for (int i = 0; i < 30; ++i) {
    const v1::StepResult& r = results->at(1000 + i);
    EXPECT_EQ(r.code(), 0) << r.message();
    // Answered by the daemon that holds the sequence.
    EXPECT_EQ(r.message(), absl::StrCat("fake-", c->Locate(absl::StrCat("b-", i))));
  }
  for (auto& f : fakes_) {
    auto streams = f->service.streams();
    ASSERT_EQ(streams.size(), 1u);
    EXPECT_EQ(streams[0].messages, 1);
  }

  // Beyond max_steps_per_message a group goes out as several messages on its stream.
  ShardedClientOptions o = Options();
  o.max_steps_per_message = 4;
  auto small = Connect(o);
  ASSERT_NE(small, nullptr);
  for (auto& f : fakes_) f->service.ClearSeen();
  results = small->DecodeBatch(steps);
  ASSERT_TRUE(results.ok());
  for (const auto& [id, r] : *results) EXPECT_EQ(r.code(), 0) << r.message();
  for (int t = 0; t < 3; ++t) {
    auto streams = fakes_[t]->service.streams();
    ASSERT_EQ(streams.size(), 1u);
    const int n = static_cast<int>(streams[0].sequences.size());
    EXPECT_EQ(streams[0].messages, (n + 3) / 4);
  }

  // Request ids must be unique within a batch.
  steps.push_back(Step(1000, "b-1"));
  EXPECT_EQ(c->DecodeBatch(steps).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(c->DecodeBatch({})->empty());
}

TEST_F(ShardedClientTest, ForksLiveBesideTheirParent) {
  auto c = Connect(Options());
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->CreateSequence("parent").ok());
  const int home = c->Locate("parent");
  // Ids whose own hash points elsewhere.
  int forked = 0;
  for (int i = 0; i < 20; ++i) {
    const std::string fork = absl::StrCat("parent-fork-", i);
    auto f = c->ForkSequence("parent", fork);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(Holder(fork), home);
    EXPECT_EQ(c->Locate(fork), home);
    EXPECT_EQ(c->RouteKey(fork), "parent");
    if (c->Owner(fork) != home) ++forked;
  }
  EXPECT_GT(forked, 0);
  auto r = c->DecodeBatch({Step(1, "parent-fork-0"), Step(2, "parent-fork-1")});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->at(1).code(), 0);
  EXPECT_EQ(r->at(2).code(), 0);
  ASSERT_TRUE(c->ReleaseSequence("parent-fork-0").ok());
  EXPECT_EQ(c->Locate("parent-fork-0"), c->Owner("parent-fork-0"));  // forgotten
}

TEST_F(ShardedClientTest, DownDaemonsSequencesFailUnavailableAndReCreateElsewhere) {
  auto c = Connect(Options());
  ASSERT_NE(c, nullptr);
  std::vector<std::string> ids;
  for (int i = 0; i < 30; ++i) {
    ids.push_back(absl::StrCat("d-", i));
    ASSERT_TRUE(c->CreateSequence(ids.back()).ok());
  }
  const int dead = c->Locate(ids[0]);
  fakes_[dead]->Stop();
  c->CheckHealth();
  EXPECT_FALSE(c->Healthy(dead));
  EXPECT_FALSE(c->Status()[dead].last_error.empty());
  for (int t = 0; t < 3; ++t) {
    if (t != dead) {
      EXPECT_TRUE(c->Healthy(t));
    }
  }

  std::vector<v1::DecodeStep> steps;
  for (int i = 0; i < 30; ++i) steps.push_back(Step(i, ids[i]));
  const absl::Time start = absl::Now();
  auto results = c->DecodeBatch(steps);
  ASSERT_TRUE(results.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  int failed = 0;
  for (int i = 0; i < 30; ++i) {
    const v1::StepResult& r = results->at(i);
    if (c->Locate(ids[i]) == dead) {
      EXPECT_EQ(r.code(), grpc::StatusCode::UNAVAILABLE) << r.message();
      EXPECT_NE(r.message().find("re-create"), std::string::npos) << r.message();
      ++failed;
    } else {
      EXPECT_EQ(r.code(), 0) << r.message();
    }
  }
  EXPECT_GT(failed, 0);
  EXPECT_EQ(c->GetSequence(ids[0]).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(c->AppendKv(ids[0], 0, "").status().code(), absl::StatusCode::kUnavailable);

  // Re-created under the same id, it lands on the next live daemon of its ring walk,
  // and its steps work there.
  auto again = c->CreateSequence(ids[0]);
  ASSERT_TRUE(again.ok()) << again.status();
  const int moved = c->Locate(ids[0]);
  EXPECT_NE(moved, dead);
  EXPECT_EQ(moved, c->ring().Preference(ids[0])[1]);
  EXPECT_TRUE(fakes_[moved]->service.sequences().count(ids[0]));
  results = c->DecodeBatch({Step(7, ids[0])});
  ASSERT_TRUE(results.ok());
  EXPECT_EQ(results->at(7).code(), 0) << results->at(7).message();
  // Creating it again while that daemon is up finds it there.
  EXPECT_EQ(c->CreateSequence(ids[0]).status().code(), absl::StatusCode::kAlreadyExists);

  // Every daemon down: nowhere to create.
  for (auto& f : fakes_) f->Stop();
  c->CheckHealth();
  EXPECT_EQ(c->CreateSequence("nowhere").status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(ShardedClientTest, BrokenStreamWithoutAHealthCheckFailsUnavailableAndMarksDown) {
  auto c = Connect(Options());
  ASSERT_NE(c, nullptr);
  std::vector<v1::DecodeStep> steps;
  for (int i = 0; i < 30; ++i) {
    const std::string id = absl::StrCat("x-", i);
    ASSERT_TRUE(c->CreateSequence(id).ok());
    steps.push_back(Step(i, id));
  }
  const int dead = c->Locate("x-0");
  fakes_[dead]->Stop();
  // No CheckHealth: the client still thinks the daemon is up and opens a stream.
  EXPECT_TRUE(c->Healthy(dead));
  auto results = c->DecodeBatch(steps);
  ASSERT_TRUE(results.ok());
  for (int i = 0; i < 30; ++i) {
    const v1::StepResult& r = results->at(i);
    EXPECT_EQ(r.code(), c->Locate(steps[i].sequence_id()) == dead ? grpc::StatusCode::UNAVAILABLE : 0)
        << r.message();
  }
  EXPECT_FALSE(c->Healthy(dead));

  // Restarted on the same port (empty, as a restarted daemon is): the health check
  // brings it back, and its old sequences are NOT_FOUND there.
  const int port = fakes_[dead]->port();
  fakes_[dead] = std::make_unique<FakeDaemon>("fake-restarted", port);
  ASSERT_TRUE(fakes_[dead]->ok());
  bool up = false;
  for (int i = 0; i < 100 && !up; ++i) {
    c->CheckHealth();
    up = c->Healthy(dead);
    if (!up) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(up) << c->Status()[dead].last_error;
  results = c->DecodeBatch({Step(1, "x-0")});
  ASSERT_TRUE(results.ok());
  EXPECT_EQ(results->at(1).code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ShardedClientTest, HangingDaemonCostsTheBatchDeadlineOnly) {
  ShardedClientOptions o = Options();
  o.batch_timeout = absl::Seconds(1);
  auto c = Connect(o);
  ASSERT_NE(c, nullptr);
  std::vector<v1::DecodeStep> steps;
  for (int i = 0; i < 30; ++i) {
    const std::string id = absl::StrCat("h-", i);
    ASSERT_TRUE(c->CreateSequence(id).ok());
    steps.push_back(Step(i, id));
  }
  const int stuck = c->Locate("h-0");
  fakes_[stuck]->service.hang = true;
  const absl::Time start = absl::Now();
  auto results = c->DecodeBatch(steps);
  const absl::Duration took = absl::Now() - start;
  ASSERT_TRUE(results.ok());
  EXPECT_GE(took, absl::Milliseconds(900));
  EXPECT_LT(took, absl::Seconds(10));
  for (int i = 0; i < 30; ++i) {
    const v1::StepResult& r = results->at(i);
    EXPECT_EQ(r.code(), c->Locate(steps[i].sequence_id()) == stuck ? grpc::StatusCode::DEADLINE_EXCEEDED : 0)
        << r.message();
  }
  fakes_[stuck]->service.hang = false;
}

TEST_F(ShardedClientTest, HealthChecks) {
  ShardedClientOptions o = Options();
  o.unhealthy_after = 2;
  auto c = Connect(o);
  ASSERT_NE(c, nullptr);
  // Draining (NOT_SERVING) is down at once, and back when serving again.
  fakes_[1]->health.status = grpc::health::v1::HealthCheckResponse::NOT_SERVING;
  c->CheckHealth();
  EXPECT_FALSE(c->Healthy(1));
  EXPECT_NE(c->Status()[1].last_error.find("NOT_SERVING"), std::string::npos);
  fakes_[1]->health.status = grpc::health::v1::HealthCheckResponse::SERVING;
  c->CheckHealth();
  EXPECT_TRUE(c->Healthy(1));

  // The periodic checks find a stopped daemon by themselves.
  o.health_interval = absl::Milliseconds(50);
  auto periodic = Connect(o);
  ASSERT_NE(periodic, nullptr);
  fakes_[2]->Stop();
  bool down = false;
  for (int i = 0; i < 200 && !down; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    down = !periodic->Healthy(2);
  }
  EXPECT_TRUE(down);
}

TEST_F(ShardedClientTest, DaemonDownAtStartIsFoundLaterAndMustServeTheSameModel) {
  ShardedClientOptions o = Options();
  const int port = fakes_[2]->port();
  fakes_[2]->Stop();
  o.connect_timeout = absl::Seconds(1);
  auto c = Connect(o);
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(c->Healthy(0));
  EXPECT_FALSE(c->Healthy(2));
  EXPECT_FALSE(c->Status()[2].last_error.empty());

  // Back, but with another model: stays down.
  fakes_[2] = std::make_unique<FakeDaemon>("fake-other", port, FakeInfo(/*layers=*/5));
  ASSERT_TRUE(fakes_[2]->ok());
  std::string why;
  for (int i = 0; i < 100; ++i) {
    c->CheckHealth();
    why = c->Status()[2].last_error;
    if (why.find("serves") != std::string::npos) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_FALSE(c->Healthy(2));
  EXPECT_NE(why.find("layers 5"), std::string::npos) << why;

  // The right model: up.
  fakes_[2].reset();
  fakes_[2] = std::make_unique<FakeDaemon>("fake-2", port);
  ASSERT_TRUE(fakes_[2]->ok());
  bool up = false;
  for (int i = 0; i < 100 && !up; ++i) {
    c->CheckHealth();
    up = c->Healthy(2);
    if (!up) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(up) << c->Status()[2].last_error;

  // Disagreeing daemons at Connect are refused.
  FakeDaemon other("other", 0, FakeInfo(/*layers=*/7));
  o.targets = {fakes_[0]->target(), other.target()};
  EXPECT_EQ(ShardedClient::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  // So are layer-API daemons of different tensor-parallel ranks (or one without it).
  v1::ServerInfo rank0 = FakeInfo(), rank1 = FakeInfo();
  for (auto* i : {&rank0, &rank1}) {
    i->set_layer_api(true);
    i->set_hidden_size(64);
    i->set_tensor_parallel(2);
  }
  rank1.set_tensor_rank(1);
  FakeDaemon r0("r0", 0, rank0), r0b("r0b", 0, rank0), r1("r1", 0, rank1);
  o.targets = {r0.target(), r1.target()};
  auto refused = ShardedClient::Connect(o);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("rank 1/2"), std::string::npos) << refused.status();
  o.targets = {fakes_[0]->target(), r0.target()};
  EXPECT_EQ(ShardedClient::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  // Two replicas of rank 0: hidden states go to the sequence's daemon.
  o.targets = {r0.target(), r0b.target()};
  auto layer = ShardedClient::Connect(o);
  ASSERT_TRUE(layer.ok()) << layer.status();
  ASSERT_TRUE((*layer)->CreateSequence("h").ok());
  auto appended = (*layer)->AppendHidden("h", 1, std::string(3 * 64 * 2, '\0'));
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(appended->tokens_appended(), 3);
  // No daemon at all.
  o.targets = {absl::StrCat("127.0.0.1:", port + 0)};
  fakes_[2]->Stop();
  EXPECT_EQ(ShardedClient::Connect(o).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(ShardedClientTest, ThroughAProxyOneStreamPerRouteKey) {
  // The "proxy" here is one fake: what matters is what it is sent.
  ShardedClientOptions o = Options();
  o.targets = {fakes_[0]->target()};
  o.via_proxy = true;
  auto c = Connect(o);
  ASSERT_NE(c, nullptr);
  std::vector<v1::DecodeStep> steps;
  for (int i = 0; i < 6; ++i) {
    const std::string id = absl::StrCat("p-", i);
    ASSERT_TRUE(c->CreateSequence(id).ok());
    EXPECT_EQ(c->Locate(id), 0);
    steps.push_back(Step(2 * i, id, 0));
    steps.push_back(Step(2 * i + 1, id, 1));
  }
  ASSERT_TRUE(c->ForkSequence("p-0", "p-0-fork").ok());
  steps.push_back(Step(100, "p-0-fork"));
  fakes_[0]->service.ClearSeen();
  auto results = c->DecodeBatch(steps);
  ASSERT_TRUE(results.ok());
  for (const auto& [id, r] : *results) EXPECT_EQ(r.code(), 0) << id << ": " << r.message();
  // One stream per route key, carrying that key's steps only; the fork goes with its
  // parent's key.
  auto streams = fakes_[0]->service.streams();
  ASSERT_EQ(streams.size(), 6u);
  for (const StreamSeen& s : streams) {
    for (const std::string& seq : s.sequences) EXPECT_EQ(c->RouteKey(seq), s.route) << seq;
    EXPECT_EQ(s.sequences.size(), s.route == "p-0" ? 3u : 2u) << s.route;
  }
  EXPECT_TRUE(c->ReleaseSequence("p-0-fork").ok());
  EXPECT_EQ(fakes_[0]->service.routes().back(), "p-0");

  // The key's daemon is unreachable behind the proxy: creation moves to a salted key,
  // which the later RPCs then carry.
  fakes_[0]->service.refuse_own_route = true;
  auto id = c->CreateSequence("moved");
  ASSERT_TRUE(id.ok()) << id.status();
  const std::string salted = SaltedRoute("moved", 1);
  EXPECT_EQ(salted, absl::StrCat("moved#", absl::Hex(RouteHash("moved#1"), absl::kZeroPad16)));
  EXPECT_EQ(c->RouteKey("moved"), salted);
  ASSERT_TRUE(c->GetSequence("moved").ok());
  EXPECT_EQ(fakes_[0]->service.routes().back(), salted);
  fakes_[0]->service.ClearSeen();
  results = c->DecodeBatch({Step(1, "moved")});
  ASSERT_TRUE(results.ok());
  EXPECT_EQ(results->at(1).code(), 0);
  ASSERT_EQ(fakes_[0]->service.streams().size(), 1u);
  EXPECT_EQ(fakes_[0]->service.streams()[0].route, salted);

  // The proxy itself gone: the steps fail UNAVAILABLE.
  fakes_[0]->Stop();
  results = c->DecodeBatch({Step(1, "p-1"), Step(2, "p-2")});
  ASSERT_TRUE(results.ok());
  EXPECT_EQ(results->at(1).code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(results->at(2).code(), grpc::StatusCode::UNAVAILABLE);
}

TEST(MissingResultCodeTest, BrokenStreamsReadAsUnavailable) {
  EXPECT_EQ(MissingResultCode(grpc::Status(grpc::StatusCode::UNAVAILABLE, "")), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(MissingResultCode(grpc::Status(grpc::StatusCode::INTERNAL, "RST_STREAM")), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(MissingResultCode(grpc::Status(grpc::StatusCode::UNKNOWN, "")), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(MissingResultCode(grpc::Status::OK), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(MissingResultCode(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "")),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(MissingResultCode(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "")),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(MissingResultCode(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "")),
            grpc::StatusCode::UNAUTHENTICATED);
}

}  // namespace
}  // namespace latentd::client
