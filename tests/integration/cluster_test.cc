// Scale-out on loopback: scripts/cluster.sh starts 3 CPU daemons and nginx in front
// (deploy/nginx). Two ShardedClients drive them at once, one hashing client-side over
// the daemons, one through nginx; each creates 30 sequences, uploads prefixes and runs
// per-layer batches over all of them, every result checked against the CPU
// implementation. The sequences must land on all three daemons on both paths. One
// daemon is SIGKILLed while the batches run: from then on the other two daemons'
// sequences still get complete, correct results, the dead one's fail UNAVAILABLE, no
// batch outlives its deadline, and the lost sequences can be re-created elsewhere.
// Finally SIGTERM stops the script and everything it started.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "clients/cpp/client.h"
#include "clients/cpp/reference.h"
#include "clients/cpp/sharded_client.h"
#include "tests/integration/daemon.h"

namespace latentd::testing {
namespace {

constexpr int kDaemons = 3;
constexpr int kSequences = 30;
constexpr int kLayers = 2;
constexpr int kVictim = 1;
const absl::Duration kBatchTimeout = absl::Seconds(30);

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// /proc/<pid> gone or a zombie: the process runs no more.
bool Gone(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat;
  if (!std::getline(f, stat)) return true;
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'Z';
}

// scripts/cluster.sh as a child process.
class Cluster {
 public:
  Cluster() : dir_(TempDir("cluster")) {}
  ~Cluster() {
    if (pid_ > 0 && !exited_) Stop(absl::Seconds(60));
    // Whatever is still there (the script failed to stop it) goes now.
    for (pid_t p : all_pids()) {
      if (!Gone(p)) kill(p, SIGKILL);
    }
    // Under --config=asan/tsan the daemons are instrumented too: a report one printed
    // (LeakSanitizer's at exit included) fails the test, as tests/integration/daemon.cc does.
    for (int i = 0; i < kDaemons; ++i) {
      const std::string log = ReadFile(absl::StrCat(dir_, "/latentd-", i, ".log"));
      for (const char* marker : {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "WARNING: ThreadSanitizer",
                                 "runtime error:"}) {
        if (log.find(marker) != std::string::npos) {
          ADD_FAILURE() << "daemon " << i << " reported \"" << marker << "\":\n" << log;
          break;
        }
      }
    }
  }

  bool Start(const std::vector<std::string>& daemon_flags, absl::Duration timeout) {
    std::vector<std::string> args = {RunfilePath("scripts/cluster.sh"),
                                     absl::StrCat("--cpu=", kDaemons),
                                     "--base_port=0",
                                     "--proxy_port=0",
                                     "--run_dir=" + dir_,
                                     "--daemon=" + RunfilePath("server/latentd")};
    // As root in a test sandbox's user namespace nginx cannot switch to nobody.
    if (getuid() == 0) args.push_back("--nginx_global=user root;");
    args.push_back("--");
    args.insert(args.end(), daemon_flags.begin(), daemon_flags.end());
    pid_ = Spawn("/bin/bash", args, dir_ + "/cluster.log");
    if (pid_ <= 0) return false;
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (access((dir_ + "/ready").c_str(), F_OK) == 0) break;
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return false;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    if (access((dir_ + "/ready").c_str(), F_OK) != 0) return false;
    for (absl::string_view t : absl::StrSplit(ReadFile(dir_ + "/targets"), '\n', absl::SkipEmpty())) {
      targets.emplace_back(t);
    }
    proxy = std::string(absl::StripAsciiWhitespace(ReadFile(dir_ + "/proxy")));
    for (absl::string_view line : absl::StrSplit(ReadFile(dir_ + "/pids"), '\n', absl::SkipEmpty())) {
      std::vector<std::string> w = absl::StrSplit(line, ' ');
      if (w.size() >= 3 && w[0] == "daemon") daemon_pids.push_back(std::stoi(w[2]));
      if (w.size() >= 2 && w[0] == "nginx") nginx_pid = std::stoi(w[1]);
    }
    return targets.size() == kDaemons && !proxy.empty() && daemon_pids.size() == kDaemons && nginx_pid > 0;
  }

  // SIGTERM; the script's exit status, or -1 if it outlived the timeout.
  int Stop(absl::Duration timeout) {
    if (pid_ <= 0 || exited_) return exit_code_;
    kill(pid_, SIGTERM);
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        return exit_code_;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return -1;
  }

  std::vector<pid_t> all_pids() const {
    std::vector<pid_t> p = daemon_pids;
    if (nginx_pid > 0) p.push_back(nginx_pid);
    return p;
  }

  std::string Log() const {
    std::string log = "--- cluster.sh\n" + ReadFile(dir_ + "/cluster.log");
    for (int i = 0; i < kDaemons; ++i) {
      absl::StrAppend(&log, "--- daemon ", i, "\n", ReadFile(absl::StrCat(dir_, "/latentd-", i, ".log")));
    }
    absl::StrAppend(&log, "--- nginx\n", ReadFile(dir_ + "/nginx/error.log"));
    return log;
  }

  std::vector<std::string> targets;
  std::string proxy;
  std::vector<pid_t> daemon_pids;
  pid_t nginx_pid = -1;

 private:
  std::string dir_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int exit_code_ = -1;
};

int64_t NowNs() { return absl::ToUnixNanos(absl::Now()); }

// One way to the daemons (client-side hashing or nginx) and its sequences.
struct Path {
  explicit Path(std::string n) : name(std::move(n)) {}
  std::string name;
  std::unique_ptr<client::ShardedClient> client;
  std::vector<std::string> ids;
  std::map<std::string, int> home;  // the daemon that holds it, found by asking each
  // Filled by the batch thread.
  int rounds = 0, rounds_after_kill = 0;
  int ok = 0, unavailable_after_kill = 0, ambiguous = 0;
  std::vector<std::string> failures;
};

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(cluster_.Start({absl::StrCat("--num_layers=", kLayers), "--kv_bytes=67108864",
                                "--drain_timeout_s=5"},
                               absl::Seconds(180)))
        << cluster_.Log();
    for (const std::string& t : cluster_.targets) {
      client::ClientOptions o;
      o.target = t;
      auto c = client::Client::Connect(o, absl::Seconds(30));
      ASSERT_TRUE(c.ok()) << c.status() << cluster_.Log();
      daemons_.push_back(std::move(*c));
    }
  }

  client::ShardedClientOptions Options(bool via_proxy) {
    client::ShardedClientOptions o;
    o.targets = via_proxy ? std::vector<std::string>{cluster_.proxy} : cluster_.targets;
    o.via_proxy = via_proxy;
    o.connect_timeout = absl::Seconds(30);
    o.health_interval = absl::Milliseconds(250);
    // Generous for sanitizer builds, where a busy daemon answers slowly.
    o.health_timeout = absl::Seconds(5);
    o.unhealthy_after = 3;
    o.rpc_timeout = absl::Seconds(30);
    o.batch_timeout = kBatchTimeout;
    return o;
  }

  // The daemon holding the sequence, by asking every daemon directly (-1: none, -2: several).
  int Holder(const std::string& id) {
    int found = -1;
    for (int i = 0; i < kDaemons; ++i) {
      client::CallOptions call;
      call.timeout = absl::Seconds(30);
      if (daemons_[i]->GetSequence(id, call).ok()) found = found == -1 ? i : -2;
    }
    return found;
  }

  void CreateSequences(Path& p, const std::string& prefix, std::mt19937_64& rng) {
    const kernels::DType dtype = client::DTypeOf(p.client->info());
    const int64_t row = p.client->shape().kv_row_bytes;
    for (int i = 0; i < kSequences; ++i) {
      const std::string id = absl::StrCat(prefix, i);
      auto created = p.client->CreateSequence(id);
      ASSERT_TRUE(created.ok()) << created.status();
      std::vector<std::string> rows(kLayers);
      std::vector<absl::string_view> views;
      for (int l = 0; l < kLayers; ++l) {
        rows[l] = client::RandomHalves(rng, (rng() % 100) * row / 2, dtype);
        views.push_back(rows[l]);
      }
      auto appended = p.client->AppendKvLayers(id, views);
      ASSERT_TRUE(appended.ok()) << appended.status();
      for (int l = 0; l < kLayers; ++l) {
        ref_->Append(id, l, rows[l]);
        ASSERT_EQ(appended->lengths(l), ref_->Length(id, l));
      }
      p.ids.push_back(id);
    }
    std::vector<int> per(kDaemons, 0);
    for (const std::string& id : p.ids) {
      const int h = Holder(id);
      ASSERT_GE(h, 0) << p.name << ": " << id << " held by " << (h == -1 ? "no daemon" : "several daemons");
      if (!p.client->via_proxy()) {
        EXPECT_EQ(h, p.client->Locate(id)) << id;
      }
      p.home[id] = h;
      ++per[h];
    }
    for (int i = 0; i < kDaemons; ++i) {
      EXPECT_GT(per[i], 0) << p.name << ": no sequence on daemon " << i << " (" << absl::StrJoin(per, "/") << ")";
    }
    std::cerr << p.name << ": sequences per daemon " << absl::StrJoin(per, "/") << "\n";
  }

  // One per-layer batch over every sequence of the path, checked.
  void RunBatch(Path& p, int layer, std::mt19937_64& rng, uint64_t* next_id) {
    const kernels::DType dtype = client::DTypeOf(p.client->info());
    const client::Shape& shape = p.client->shape();
    struct Sent {
      std::string id, q, kv;
      int s_q;
      bool causal;
    };
    std::map<uint64_t, Sent> sent;
    std::vector<v1::DecodeStep> steps;
    for (const std::string& id : p.ids) {
      Sent s;
      s.id = id;
      s.s_q = 1 + static_cast<int>(rng() % 2);
      s.causal = s.s_q == 2;
      s.q = client::RandomHalves(rng, shape.QBytes(s.s_q) / 2, dtype);
      s.kv = client::RandomHalves(rng, shape.KvBytes(s.s_q) / 2, dtype);
      v1::DecodeStep step;
      step.set_request_id((*next_id)++);
      step.set_sequence_id(id);
      step.set_layer(layer);
      step.set_q(s.q);
      step.set_kv(s.kv);
      step.set_causal(s.causal);
      sent[step.request_id()] = s;
      steps.push_back(std::move(step));
    }
    const int64_t start = NowNs();
    auto results = p.client->DecodeBatch(std::move(steps));
    const int64_t end = NowNs();
    if (!results.ok()) {
      p.failures.push_back(absl::StrCat("DecodeBatch: ", results.status().ToString()));
      return;
    }
    if (absl::Nanoseconds(end - start) > kBatchTimeout + absl::Seconds(5)) {
      p.failures.push_back(absl::StrCat("a batch took ", absl::FormatDuration(absl::Nanoseconds(end - start))));
    }
    const int64_t kill_start = kill_start_ns_.load();
    const int64_t kill_done = kill_done_ns_.load();
    // Before the kill: all OK. Started after the victim was gone: its sequences fail
    // UNAVAILABLE. Across the kill: the victim's steps may go either way.
    const bool before = kill_start == 0 || end < kill_start;
    const bool after = kill_done != 0 && start > kill_done;
    for (const auto& [rid, s] : sent) {
      auto it = results->find(rid);
      if (it == results->end()) {
        p.failures.push_back(absl::StrCat(s.id, ": no result"));
        continue;
      }
      const v1::StepResult& r = it->second;
      const bool victim = p.home[s.id] == kVictim;
      if (victim && Lost(s.id)) {
        if (r.code() != grpc::StatusCode::UNAVAILABLE) {
          p.failures.push_back(absl::StrCat(s.id, " (lost): code ", r.code(), ": ", r.message()));
        } else if (after) {
          ++p.unavailable_after_kill;
        }
        continue;
      }
      if (victim && !before) {
        if (r.code() == grpc::StatusCode::UNAVAILABLE) {
          std::lock_guard<std::mutex> lock(lost_mu_);
          lost_.insert(s.id);
          if (after) ++p.unavailable_after_kill;
          continue;
        }
        if (after) {
          p.failures.push_back(absl::StrCat(s.id, " on the dead daemon: code ", r.code(), ": ", r.message()));
          continue;
        }
        ++p.ambiguous;  // answered just before the victim died: checked below
      }
      if (r.code() != 0) {
        p.failures.push_back(absl::StrCat(s.id, " on daemon ", p.home[s.id], " layer ", layer, ": code ", r.code(),
                                          ": ", r.message()));
        continue;
      }
      ref_->Append(s.id, layer, s.kv);
      absl::Status st = ref_->Check(s.id, layer, ref_->Length(s.id, layer), s.q, s.s_q, s.causal, r);
      if (!st.ok()) {
        p.failures.push_back(absl::StrCat(s.id, " layer ", layer, ": ", st.ToString()));
        continue;
      }
      ++p.ok;
    }
  }

  Cluster cluster_;
  std::vector<std::unique_ptr<client::Client>> daemons_;
  std::unique_ptr<client::Reference> ref_;
  std::atomic<int64_t> kill_start_ns_{0}, kill_done_ns_{0};
  bool Lost(const std::string& id) {
    std::lock_guard<std::mutex> lock(lost_mu_);
    return lost_.count(id) > 0;
  }
  std::mutex lost_mu_;
  std::set<std::string> lost_;  // the victim's sequences seen failing; guarded by lost_mu_
};

TEST_F(ClusterTest, SequencesSpreadAndADeadDaemonFailsOnlyItsOwn) {
  Path direct("client-side hashing"), proxied("nginx");
  {
    auto c = client::ShardedClient::Connect(Options(false));
    ASSERT_TRUE(c.ok()) << c.status() << cluster_.Log();
    direct.client = std::move(*c);
    c = client::ShardedClient::Connect(Options(true));
    ASSERT_TRUE(c.ok()) << c.status() << cluster_.Log();
    proxied.client = std::move(*c);
  }
  ref_ = std::make_unique<client::Reference>(direct.client->info(), 1);
  std::mt19937_64 rng(7);
  CreateSequences(direct, "direct-", rng);
  CreateSequences(proxied, "proxy-", rng);
  if (HasFatalFailure()) return;

  // Both paths run batches at once; the victim is killed after two rounds each.
  std::atomic<int> started_rounds{0};
  auto run = [&](Path* p, uint64_t seed, uint64_t first_id) {
    std::mt19937_64 r(seed);
    uint64_t next_id = first_id;
    for (int round = 0; round < 40 && p->rounds_after_kill < 3; ++round) {
      const int64_t round_start = NowNs();
      for (int layer = 0; layer < kLayers; ++layer) RunBatch(*p, layer, r, &next_id);
      ++p->rounds;
      const int64_t done = kill_done_ns_.load();
      if (done != 0 && round_start > done) ++p->rounds_after_kill;
      if (p->rounds == 2) ++started_rounds;
    }
  };
  std::thread t1(run, &direct, 11, uint64_t{1} << 40);
  std::thread t2(run, &proxied, 12, uint64_t{2} << 40);
  const absl::Time wait_until = absl::Now() + absl::Seconds(120);
  while (started_rounds.load() < 2 && absl::Now() < wait_until) absl::SleepFor(absl::Milliseconds(1));
  // Mid-run: both threads are in their third round's batches.
  const pid_t victim = cluster_.daemon_pids[kVictim];
  kill_start_ns_ = NowNs();
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  while (!Gone(victim)) absl::SleepFor(absl::Milliseconds(1));
  kill_done_ns_ = NowNs();
  t1.join();
  t2.join();

  for (Path* p : {&direct, &proxied}) {
    SCOPED_TRACE(p->name);
    EXPECT_TRUE(p->failures.empty()) << p->failures.size() << " failures, first: " << p->failures.front();
    EXPECT_GE(p->rounds_after_kill, 3) << p->rounds << " rounds";
    EXPECT_GT(p->unavailable_after_kill, 0);
    // Complete: every live sequence has every row the client sent, once.
    for (const std::string& id : p->ids) {
      if (p->home[id] == kVictim) continue;
      auto info = p->client->GetSequence(id);
      ASSERT_TRUE(info.ok()) << id << ": " << info.status();
      for (int l = 0; l < kLayers; ++l) EXPECT_EQ(info->lengths(l), ref_->Length(id, l)) << id << " layer " << l;
    }
    // The victim's sequences: UNAVAILABLE at once for the other RPCs too.
    for (const std::string& id : p->ids) {
      if (p->home[id] != kVictim) continue;
      const absl::Time start = absl::Now();
      EXPECT_EQ(p->client->GetSequence(id).status().code(), absl::StatusCode::kUnavailable) << id;
      EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    }
    std::cerr << p->name << ": " << p->rounds << " rounds (" << p->rounds_after_kill << " after the kill), "
              << p->ok << " steps checked, " << p->unavailable_after_kill << " UNAVAILABLE after the kill, "
              << p->ambiguous << " answered as the victim died\n";
  }
  // The health checks (or the failed streams) have marked the victim down.
  for (int i = 0; i < 100 && direct.client->Healthy(kVictim); ++i) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(direct.client->Healthy(kVictim));
  EXPECT_TRUE(direct.client->Healthy(0));
  EXPECT_TRUE(direct.client->Healthy(2));

  // Re-created under the same ids, all the victim's sequences live elsewhere and work.
  uint64_t next_id = uint64_t{3} << 40;
  for (Path* p : {&direct, &proxied}) {
    SCOPED_TRACE(p->name);
    std::vector<std::string> again;
    for (const std::string& id : p->ids) {
      if (p->home[id] == kVictim) again.push_back(id);
    }
    ASSERT_FALSE(again.empty());
    const kernels::DType dtype = client::DTypeOf(p->client->info());
    for (const std::string& id : again) {
      auto created = p->client->CreateSequence(id);
      ASSERT_TRUE(created.ok()) << id << ": " << created.status() << "\n" << cluster_.Log();
      const int h = Holder(id);
      EXPECT_TRUE(h == 0 || h == 2) << id << " re-created on " << h;
      if (p->client->via_proxy()) {
        EXPECT_NE(p->client->RouteKey(id), id);
      } else {
        EXPECT_EQ(p->client->Locate(id), h);
      }
      ref_->Erase(id);
      const std::string rows = client::RandomHalves(rng, 70 * p->client->shape().kv_row_bytes / 2, dtype);
      ASSERT_TRUE(p->client->AppendKv(id, 0, rows).ok());
      ref_->Append(id, 0, rows);
      p->home[id] = h;
      {
        std::lock_guard<std::mutex> lock(lost_mu_);
        lost_.erase(id);
      }
    }
    p->ids = again;
    p->failures.clear();
    p->ok = 0;
    RunBatch(*p, 0, rng, &next_id);
    EXPECT_TRUE(p->failures.empty()) << p->failures.front();
    EXPECT_EQ(p->ok, static_cast<int>(again.size()));
  }

  direct.client.reset();
  proxied.client.reset();
  daemons_.clear();
  // SIGTERM stops the script, the daemons and nginx.
  EXPECT_EQ(cluster_.Stop(absl::Seconds(60)), 0) << cluster_.Log();
  for (pid_t p : cluster_.all_pids()) EXPECT_TRUE(Gone(p)) << "pid " << p << " still runs";
  EXPECT_NE(cluster_.Log().find(absl::StrCat("daemon ", kVictim, " (")), std::string::npos) << cluster_.Log();
}

}  // namespace
}  // namespace latentd::testing
