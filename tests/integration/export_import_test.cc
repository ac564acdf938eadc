// ExportSequence and ImportSequence end to end against real daemons: a sequence moved
// between two daemons decodes correctly on the new one; every bad import (another shape
// or storage format, a truncated, out-of-order or corrupted stream, a full pool, a
// taken id, a draining importer) fails with a status naming the field and leaves
// nothing behind on the importer; a draining daemon still answers ExportSequence.
#include <gtest/gtest.h>
#include <signal.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/integration/daemon.h"
#include "tests/integration/tracker.h"

namespace latentd::testing {
namespace {

using absl::StatusCode;

#define EXPECT_ERROR(expr, want_code, want_text)                                                   \
  do {                                                                                             \
    const absl::Status st_ = (expr);                                                               \
    EXPECT_EQ(st_.code(), want_code) << #expr << ": " << st_;                                     \
    EXPECT_TRUE(absl::StrContains(st_.message(), want_text))                                       \
        << #expr << ": '" << st_.message() << "' does not mention '" << want_text << "'";          \
  } while (0)

struct Node {
  explicit Node(std::vector<std::string> flags) : daemon(std::move(flags)) {
    EXPECT_TRUE(daemon.Start()) << daemon.Log();
    auto c = daemon.Connect();
    EXPECT_TRUE(c.ok()) << c.status() << daemon.Log();
    if (c.ok()) client = std::move(*c);
  }
  // Nothing of a failed import is left: the sequence is unknown and every page free.
  void ExpectNothingLeft(const std::string& id) {
    EXPECT_EQ(client->GetSequence(id).status().code(), StatusCode::kNotFound) << id;
    auto info = client->GetInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->free_pages(), info->total_pages());
    EXPECT_EQ(info->sequences(), 0);
  }
  Daemon daemon;
  std::unique_ptr<client::Client> client;
};

std::vector<v1::SequenceChunk> ExportAll(client::Client* c, const std::string& id, int64_t chunk_bytes) {
  std::vector<v1::SequenceChunk> chunks;
  absl::Status st = c->ExportSequence(
      id,
      [&](v1::SequenceChunk& chunk) {
        chunks.push_back(std::move(chunk));
        return absl::OkStatus();
      },
      chunk_bytes);
  EXPECT_TRUE(st.ok()) << st;
  return chunks;
}

TEST(ExportImportTest, MovedSequenceDecodesCorrectlyOnItsNewDaemon) {
  for (const char* kv_dtype : {"auto", "fp8_e4m3"}) {
    SCOPED_TRACE(kv_dtype);
    const std::string flag = absl::StrCat("--kv_dtype=", kv_dtype);
    Node a({"--num_layers=2", "--kv_pages=64", flag}), b({"--num_layers=2", "--kv_pages=64", flag});
    ASSERT_NE(a.client, nullptr);
    ASSERT_NE(b.client, nullptr);
    Tracker tracker(a.client.get(), 3);
    auto seq = tracker.NewSequence({150, 70}, "moving");
    ASSERT_TRUE(seq.ok()) << seq.status();
    auto before = a.client->DecodeAll({tracker.Step(*seq, 0), tracker.Step(*seq, 1, 2, true)});
    ASSERT_TRUE(before.ok()) << before.status();
    for (const auto& [id, r] : *before) EXPECT_TRUE(tracker.Check(r).ok()) << tracker.Check(r);

    auto moved = a.client->MoveSequence(*seq, b.client.get());
    ASSERT_TRUE(moved.ok()) << moved.status();
    EXPECT_TRUE(moved->released.ok()) << moved->released;
    EXPECT_EQ(moved->imported.sequence_id(), "moving");
    EXPECT_EQ(moved->imported.rows(), 151 + 72);
    EXPECT_EQ(a.client->GetSequence(*seq).status().code(), StatusCode::kNotFound);
    auto info = b.client->GetSequence(*seq);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->lengths(0), 151);
    EXPECT_EQ(info->lengths(1), 72);

    // The tracker's reference holds the rows the steps need; the steps go to b.
    auto after = b.client->DecodeAll({tracker.Step(*seq, 0, 3, true), tracker.Step(*seq, 1)});
    ASSERT_TRUE(after.ok()) << after.status();
    ASSERT_EQ(after->size(), 2u);
    for (const auto& [id, r] : *after) EXPECT_TRUE(tracker.Check(r).ok()) << tracker.Check(r);
  }
}

TEST(ExportImportTest, BadImportsNameTheFieldAndLeaveNothing) {
  Node a({"--num_layers=2", "--kv_pages=64"});
  Node heads({"--num_layers=2", "--num_heads_q=32", "--num_heads_kv=2", "--kv_pages=64"});
  Node fp8({"--num_layers=2", "--kv_pages=64", "--kv_dtype=fp8_e4m3"});
  Node b({"--num_layers=2", "--kv_pages=64"});
  Node small({"--num_layers=2", "--kv_pages=5"});
  for (Node* n : {&a, &heads, &fp8, &b, &small}) ASSERT_NE(n->client, nullptr) << n->daemon.Log();
  Tracker tracker(a.client.get(), 4);
  auto seq = tracker.NewSequence({200, 130}, "source");
  ASSERT_TRUE(seq.ok()) << seq.status();
  const std::vector<v1::SequenceChunk> chunks = ExportAll(a.client.get(), *seq, 64 * 1152);
  // Header (with the first rows), 200 rows of layer 0 and 130 of layer 1 in 64-row pieces.
  ASSERT_EQ(chunks.size(), 7u);
  ASSERT_TRUE(chunks[0].has_header());
  EXPECT_EQ(chunks[0].header().kv_dtype(), "bf16");
  EXPECT_EQ(chunks[0].header().row_bytes(), 1152);
  EXPECT_TRUE(chunks.back().last());
  EXPECT_EQ(chunks.back().total_rows(), 330);

  EXPECT_ERROR(heads.client->ImportSequence(chunks).status(), StatusCode::kInvalidArgument,
               "chunk[0].header.num_heads_kv: expected 2, got 1");
  heads.ExpectNothingLeft(*seq);
  EXPECT_ERROR(fp8.client->ImportSequence(chunks).status(), StatusCode::kInvalidArgument,
               "chunk[0].header.kv_dtype: expected fp8_e4m3, got 'bf16'");
  fp8.ExpectNothingLeft(*seq);

  auto edited = [&](auto edit) {
    std::vector<v1::SequenceChunk> c = chunks;
    edit(c);
    return b.client->ImportSequence(c).status();
  };
  // Truncated: the stream ends before its last chunk.
  EXPECT_ERROR(edited([](auto& c) { c.resize(4); }), StatusCode::kInvalidArgument,
               "the stream ended after 4 chunks without its last one");
  b.ExpectNothingLeft(*seq);
  // Out of order.
  EXPECT_ERROR(edited([](auto& c) { std::swap(c[1], c[2]); }), StatusCode::kInvalidArgument,
               "chunk[1].first_row: expected 64 (layer 0), got 128");
  b.ExpectNothingLeft(*seq);
  EXPECT_ERROR(edited([](auto& c) { c.erase(c.begin() + 3); }), StatusCode::kInvalidArgument,
               "chunk[3].layer: expected 0 (row 192 of 200 next), got 1");
  b.ExpectNothingLeft(*seq);
  // Corrupted on the way: one byte of the rows, or the totals.
  EXPECT_ERROR(edited([](auto& c) { (*c[2].mutable_rows())[100] ^= 1; }), StatusCode::kInvalidArgument,
               "chunk[6].crc32: expected");
  b.ExpectNothingLeft(*seq);
  EXPECT_ERROR(edited([](auto& c) { c.back().set_total_rows(329); }), StatusCode::kInvalidArgument,
               "chunk[6].total_rows: expected 330");
  b.ExpectNothingLeft(*seq);
  // No header first; a header later.
  EXPECT_ERROR(edited([](auto& c) { c[0].clear_header(); }), StatusCode::kInvalidArgument, "chunk[0].header: missing");
  b.ExpectNothingLeft(*seq);
  EXPECT_ERROR(edited([](auto& c) { *c[1].mutable_header() = c[0].header(); }), StatusCode::kInvalidArgument,
               "chunk[1].header: only the first chunk carries one");
  b.ExpectNothingLeft(*seq);
  EXPECT_ERROR(edited([](auto& c) { c[0].mutable_header()->set_row_bytes(1024); }), StatusCode::kInvalidArgument,
               "chunk[0].header.row_bytes: expected 1152, got 1024");
  b.ExpectNothingLeft(*seq);
  // The pool cannot hold it now: 4 pages, 3 free beside a resident sequence.
  ASSERT_TRUE(small.client->CreateSequence("resident").ok());
  ASSERT_TRUE(small.client->AppendKv("resident", 0, tracker.RandomRows(100)).ok());
  EXPECT_ERROR(small.client->ImportSequence(chunks).status(), StatusCode::kResourceExhausted,
               "chunk[0].header.lengths: the sequence needs 4 pages, the kv cache has 3 free");
  ASSERT_TRUE(small.client->ReleaseSequence("resident").ok());
  small.ExpectNothingLeft(*seq);

  // A good stream imports; the same id again is taken; another id goes beside it.
  auto ok = b.client->ImportSequence(chunks);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->rows(), 330);
  EXPECT_EQ(ok->bytes(), 330 * 1152);
  EXPECT_ERROR(b.client->ImportSequence(chunks).status(), StatusCode::kAlreadyExists,
               "sequence_id: sequence 'source' already exists");
  std::vector<v1::SequenceChunk> renamed = chunks;
  renamed[0].set_sequence_id("copy");
  auto copy = b.client->ImportSequence(renamed);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(copy->sequence_id(), "copy");
  // Steps on the copy see the source's rows.
  auto r = b.client->DecodeAll({tracker.Step(*seq, 0)});  // appends to "source" on b
  ASSERT_TRUE(r.ok()) << r.status();
  for (const auto& [id, res] : *r) EXPECT_TRUE(tracker.Check(res).ok()) << tracker.Check(res);

  // An unknown sequence has nothing to export.
  EXPECT_ERROR(a.client->ExportSequence("nope", [](v1::SequenceChunk&) { return absl::OkStatus(); }),
               StatusCode::kNotFound, "sequence_id");
}

// An import whose client stops sending is cancelled after --import_stall_timeout_s, and
// the pages it reserved go back.
TEST(ExportImportTest, StalledImportIsCancelledAndGivesItsPagesBack) {
  Node a({"--num_layers=1", "--kv_pages=64"}), b({"--num_layers=1", "--kv_pages=64", "--import_stall_timeout_s=1"});
  ASSERT_NE(a.client, nullptr);
  ASSERT_NE(b.client, nullptr);
  Tracker tracker(a.client.get(), 6);
  auto seq = tracker.NewSequence({300}, "stalled");
  ASSERT_TRUE(seq.ok()) << seq.status();
  const std::vector<v1::SequenceChunk> chunks = ExportAll(a.client.get(), *seq, 64 * 1152);
  ASSERT_GT(chunks.size(), 2u);
  grpc::ClientContext ctx;
  b.client->Prepare(&ctx);
  v1::ImportSequenceResponse resp;
  auto writer = b.client->stub()->ImportSequence(&ctx, &resp);
  ASSERT_TRUE(writer->Write(chunks[0]));
  auto free_pages = [&] {
    auto info = b.client->GetInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->free_pages() : -1;
  };
  const absl::Time deadline = absl::Now() + HangGuard(absl::Seconds(30));
  int64_t seen = 64;
  while ((seen = free_pages()) == 64 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(seen, 64 - 5) << "the import's pages were never reserved";
  while ((seen = free_pages()) != 64 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(seen, 64) << b.daemon.Log();
  writer->WritesDone();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  b.ExpectNothingLeft(*seq);
  EXPECT_TRUE(absl::StrContains(b.daemon.Log(), "cancelled 1 ImportSequence streams")) << b.daemon.Log();
}

// A draining daemon refuses imports and still answers exports until its sequences are
// gone (then it exits).
TEST(ExportImportTest, DrainingDaemonExportsAndRefusesImports) {
  Node a({"--num_layers=1", "--kv_pages=64", "--drain_handoff_s=60"});
  ASSERT_NE(a.client, nullptr);
  Tracker tracker(a.client.get(), 5);
  auto seq = tracker.NewSequence({100}, "kept");
  ASSERT_TRUE(seq.ok()) << seq.status();
  const std::vector<v1::SequenceChunk> chunks = ExportAll(a.client.get(), *seq, 0);
  a.daemon.Signal(SIGTERM);
  const absl::Time deadline = absl::Now() + HangGuard(absl::Seconds(20));
  while (absl::Now() < deadline) {
    auto info = a.client->GetInfo(absl::Seconds(5));
    if (info.ok() && info->draining()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::vector<v1::SequenceChunk> renamed = chunks;
  renamed[0].set_sequence_id("other");
  EXPECT_ERROR(a.client->ImportSequence(renamed).status(), StatusCode::kUnavailable, "shutting down");
  // Exported again while draining: the same rows.
  const std::vector<v1::SequenceChunk> again = ExportAll(a.client.get(), *seq, 0);
  ASSERT_EQ(again.size(), chunks.size());
  EXPECT_EQ(again.back().crc32(), chunks.back().crc32());
  EXPECT_TRUE(a.daemon.Running()) << "the daemon left before its sequence was moved:\n" << a.daemon.Log();
  ASSERT_TRUE(a.client->ReleaseSequence(*seq).ok());
  EXPECT_EQ(a.daemon.Wait(absl::Seconds(30)), 0) << a.daemon.Log();
  EXPECT_TRUE(absl::StrContains(a.daemon.Log(), "handoff: 0 sequences left")) << a.daemon.Log();
}

// The host tier over gRPC: a pool of 8 pages holds 6 sequences of 3 pages each (18
// pages) by moving the least recently used ones out; every result stays correct, and
// --offload_idle_s moves idle ones out on its own (GetSequence says so).
TEST(HostTierTest, APoolServesMoreSequencesThanItHoldsAndIdleOnesMoveOut) {
  Node a({"--num_layers=2", "--kv_pages=8", absl::StrCat("--host_kv_bytes=", 64 * 64 * 1152),
          "--offload_idle_s=1"});
  ASSERT_NE(a.client, nullptr);
  Tracker tracker(a.client.get(), 5);
  std::vector<std::string> ids;
  for (int i = 0; i < 6; ++i) {
    auto seq = tracker.NewSequence({150, 150}, absl::StrCat("tier", i));
    ASSERT_TRUE(seq.ok()) << seq.status();
    ids.push_back(*seq);
  }
  for (int round = 0; round < 2; ++round) {
    for (const std::string& id : ids) {
      auto r = a.client->DecodeAll({tracker.Step(id, 0), tracker.Step(id, 1, 2, true)});
      ASSERT_TRUE(r.ok()) << id << ": " << r.status();
      for (const auto& [step, result] : *r) EXPECT_TRUE(tracker.Check(result).ok()) << id << ": " << tracker.Check(result);
    }
  }
  // Idle for over a second: the housekeeping thread moves every sequence out.
  const absl::Time until = absl::Now() + HangGuard(absl::Seconds(30));
  bool all_out = false;
  while (!all_out && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(200));
    all_out = true;
    for (const std::string& id : ids) {
      auto info = a.client->GetSequence(id);
      ASSERT_TRUE(info.ok()) << info.status();
      all_out = all_out && info->offloaded() && info->pages() == 0;
    }
  }
  EXPECT_TRUE(all_out);
  auto info = a.client->GetInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->free_pages(), info->total_pages());
  // A step brings one back with its rows intact.
  auto r = a.client->DecodeAll({tracker.Step(ids[0], 0), tracker.Step(ids[0], 1)});
  ASSERT_TRUE(r.ok()) << r.status();
  for (const auto& [step, result] : *r) EXPECT_TRUE(tracker.Check(result).ok()) << tracker.Check(result);
  EXPECT_FALSE(a.client->GetSequence(ids[0])->offloaded());

  // An offloaded sequence moves to another daemon straight from the tier (a drain needs
  // no pages for it) and decodes correctly there.
  ASSERT_TRUE(a.client->GetSequence(ids[1])->offloaded());
  Node b({"--num_layers=2", "--kv_pages=64"});
  ASSERT_NE(b.client, nullptr);
  auto moved = a.client->MoveSequence(ids[1], b.client.get());
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_TRUE(moved->released.ok()) << moved->released;
  EXPECT_EQ(a.client->GetSequence(ids[1]).status().code(), StatusCode::kNotFound);
  auto there = b.client->DecodeAll({tracker.Step(ids[1], 0), tracker.Step(ids[1], 1, 3, true)});
  ASSERT_TRUE(there.ok()) << there.status();
  for (const auto& [step, result] : *there) EXPECT_TRUE(tracker.Check(result).ok()) << tracker.Check(result);
}

// Host tier flags out of range stop the start (exit 2) naming the flag.
TEST(HostTierTest, BadFlagsRefuseToStart) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--host_kv_bytes=-1"}, "--host_kv_bytes: expected >= 0"},
      {{"--offload_idle_s=-1"}, "--offload_idle_s: expected >= 0"},
      {{"--offload_idle_s=5"}, "--offload_idle_s: needs --host_kv_bytes"},
  };
  for (const auto& [flags, expect] : cases) {
    Daemon daemon(flags);
    EXPECT_FALSE(daemon.Start(absl::Seconds(30))) << expect;
    EXPECT_EQ(daemon.Wait(absl::Seconds(30)), 2) << expect << "\n" << daemon.Log();
    EXPECT_TRUE(absl::StrContains(daemon.Log(), expect)) << expect << "\n" << daemon.Log();
  }
}

}  // namespace
}  // namespace latentd::testing
