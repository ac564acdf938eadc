// SIGTERM on one of three daemons loses no sequence: a ShardedClient (client-side
// hashing) holds 200 sequences with uploaded prefixes over three CPU daemons and runs
// per-layer batches over all of them; one daemon is SIGTERMed between two rounds. The
// client moves that daemon's sequences to their next owners on the ring (export,
// import, release) and sends the refused steps again there: every result of every
// round, before and after, is OK and matches the CPU reference, each moved sequence
// now lives on its new owner with every row, and the drained daemon exits 0 once its
// sequences are gone.
#include <gtest/gtest.h>
#include <signal.h>

#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "clients/cpp/reference.h"
#include "clients/cpp/sharded_client.h"
#include "tests/integration/daemon.h"

namespace latentd::testing {
namespace {

constexpr int kDaemons = 3;
constexpr int kSequences = 200;
constexpr int kLayers = 2;
constexpr int kRounds = 6;
constexpr int kSignalAfterRound = 2;
constexpr int kVictim = 1;

TEST(DrainMoveTest, SigtermOnOneOfThreeDaemonsLosesNoSequence) {
  std::vector<std::unique_ptr<Daemon>> daemons;
  client::ShardedClientOptions o;
  for (int i = 0; i < kDaemons; ++i) {
    daemons.push_back(std::make_unique<Daemon>(std::vector<std::string>{
        absl::StrCat("--num_layers=", kLayers), "--num_heads_q=16", "--kv_pages=1024", "--drain_handoff_s=30",
        "--drain_timeout_s=60", "--sequence_ttl_s=0"}));
    ASSERT_TRUE(daemons.back()->Start()) << daemons.back()->Log();
    o.targets.push_back(daemons.back()->target());
  }
  // The test's own pace decides when the client looks again, not a timer.
  o.health_interval = absl::ZeroDuration();
  o.batch_timeout = HangGuard(absl::Seconds(60));
  o.rpc_timeout = HangGuard(absl::Seconds(30));
  auto sharded = client::ShardedClient::Connect(o);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  client::ShardedClient& c = **sharded;
  const kernels::DType dtype = client::DTypeOf(c.info());
  client::Reference ref(c.info(), 2);
  std::mt19937_64 rng(17);

  // 200 sequences, prefixes of 1 to 200 rows per layer (page boundaries crossed and not).
  std::vector<std::string> ids;
  std::map<int, int> per_daemon;
  for (int i = 0; i < kSequences; ++i) {
    const std::string id = absl::StrCat("seq-", i);
    ASSERT_TRUE(c.CreateSequence(id).ok()) << id;
    std::vector<std::string> rows(kLayers);
    std::vector<absl::string_view> views;
    for (int l = 0; l < kLayers; ++l) {
      const int n = 1 + static_cast<int>((i * 37 + l * 11) % 200);
      rows[l] = client::RandomHalves(rng, size_t(n) * c.shape().h_kv * 576, dtype);
      views.push_back(rows[l]);
      ref.Append(id, l, rows[l]);
    }
    auto up = c.AppendKvLayers(id, views);
    ASSERT_TRUE(up.ok()) << id << ": " << up.status();
    ids.push_back(id);
    ++per_daemon[c.Locate(id)];
  }
  ASSERT_EQ(per_daemon.size(), size_t{kDaemons}) << "the sequences do not cover every daemon";
  std::set<std::string> on_victim;
  for (const auto& id : ids) {
    if (c.Locate(id) == kVictim) on_victim.insert(id);
  }

  uint64_t request_id = 1;
  int checked = 0;
  for (int round = 0; round < kRounds; ++round) {
    if (round == kSignalAfterRound) daemons[kVictim]->Signal(SIGTERM);
    for (int layer = 0; layer < kLayers; ++layer) {
      std::vector<v1::DecodeStep> steps;
      std::map<uint64_t, std::pair<std::string, std::string>> sent;  // request id -> sequence, q
      for (const auto& id : ids) {
        v1::DecodeStep s;
        s.set_request_id(request_id++);
        s.set_sequence_id(id);
        s.set_layer(layer);
        s.set_q(client::RandomHalves(rng, size_t(c.shape().h_q) * 576, dtype));
        s.set_kv(client::RandomHalves(rng, size_t(c.shape().h_kv) * 576, dtype));
        ref.Append(id, layer, s.kv());
        sent[s.request_id()] = {id, s.q()};
        steps.push_back(std::move(s));
      }
      auto results = c.DecodeBatch(std::move(steps));
      ASSERT_TRUE(results.ok()) << results.status();
      ASSERT_EQ(results->size(), sent.size());
      for (const auto& [rid, r] : *results) {
        const auto& [id, q] = sent[rid];
        ASSERT_EQ(r.code(), 0) << "round " << round << " layer " << layer << " " << id << ": " << r.message();
        const absl::Status st = ref.Check(id, layer, ref.Length(id, layer), q, 1, false, r);
        ASSERT_TRUE(st.ok()) << "round " << round << " layer " << layer << " " << id << ": " << st;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, kRounds * kLayers * kSequences);

  // Every sequence of the drained daemon moved to its next live owner, whole.
  EXPECT_EQ(c.moved_sequences(), static_cast<int64_t>(on_victim.size()));
  for (const auto& id : on_victim) {
    const int now = c.Locate(id);
    EXPECT_NE(now, kVictim) << id;
    for (int t : c.ring().Preference(id)) {
      if (t == kVictim) continue;
      EXPECT_EQ(now, t) << id << " is not on its next owner";
      break;
    }
    auto info = c.client(now)->GetSequence(id);
    ASSERT_TRUE(info.ok()) << id << ": " << info.status();
    for (int l = 0; l < kLayers; ++l) EXPECT_EQ(info->lengths(l), ref.Length(id, l)) << id << " layer " << l;
  }
  // With its sequences gone, the drained daemon ends its handoff and exits cleanly.
  EXPECT_EQ(daemons[kVictim]->Wait(absl::Seconds(60)), 0) << daemons[kVictim]->Log();
  const std::string log = daemons[kVictim]->Log();
  EXPECT_NE(log.find("handoff: 0 sequences left"), std::string::npos) << log;
  EXPECT_NE(log.find(absl::StrCat("; ", on_victim.size(), " exported since the signal")), std::string::npos) << log;
  for (int i = 0; i < kDaemons; ++i) {
    if (i != kVictim) EXPECT_TRUE(daemons[i]->Running()) << daemons[i]->Log();
  }
}

}  // namespace
}  // namespace latentd::testing
