// Moving a sequence between engines (Engine::ExportSequence / ImportSequence): a round
// trip gives byte-identical stored rows (bf16 and fp8 pools) and exact decode results on
// the importer, and every bad import (another shape or format, rows out of order or
// missing, a wrong checksum, a full pool, a taken id) fails naming the field and leaves
// nothing behind. Pools are poisoned (NaN in every row nobody wrote).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "engine/engine.h"
#include "engine/testing/backend_under_test.h"
#include "engine/testing/engine_harness.h"
#include "zlib.h"

namespace latentd::engine {
namespace {

using testing::Harness;

constexpr bool kExact = testing::kExactUnderTest;

struct Exported {
  SequenceExportHeader header;
  std::vector<SequenceExportChunk> chunks;
  int64_t total_rows = 0;
  uint32_t crc32 = 0;
  std::string Bytes() const {
    std::string all;
    for (const auto& c : chunks) all += c.bytes;
    return all;
  }
};

class ExportImportTest : public ::testing::Test {
 public:
  void SetUp() override { setenv("LATENTD_KV_POISON", "1", 1); }

  static std::unique_ptr<Engine> Make(int layers, int h_kv = 1, kernels::KvDType kv_dtype = kernels::KvDType::kModel,
                                      int64_t pages = 128, kernels::DType dtype = kernels::DType::kBF16) {
    EngineOptions o;
    o.backend = testing::kBackendUnderTest;
    o.model.num_layers = layers;
    o.model.num_heads_q = 16 * h_kv;
    o.model.num_heads_kv = h_kv;
    o.model.dtype = dtype;
    o.kv_dtype = kv_dtype;
    o.kv_pages = pages;
    o.cpu_threads = 2;
    auto e = Engine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }

  static absl::StatusOr<Exported> Export(Engine* e, const std::string& id, size_t max_bytes) {
    auto ex = e->ExportSequence(id);
    if (!ex.ok()) return ex.status();
    Exported out;
    out.header = (*ex)->header();
    for (;;) {
      SequenceExportChunk c;
      auto more = (*ex)->Next(max_bytes, &c);
      if (!more.ok()) return more.status();
      if (!*more) break;
      out.chunks.push_back(std::move(c));
    }
    out.total_rows = (*ex)->total_rows();
    out.crc32 = (*ex)->crc32();
    return out;
  }

  static absl::StatusOr<SequenceLengths> Import(Engine* e, const Exported& x, const std::string& id = "") {
    auto im = e->ImportSequence(x.header, id);
    if (!im.ok()) return im.status();
    for (const auto& c : x.chunks) {
      if (absl::Status st = (*im)->Write(c.layer, c.first_row, c.bytes); !st.ok()) return st;
    }
    return (*im)->Commit(x.total_rows, x.crc32);
  }

  // Nothing of a failed import is left: no sequence, every page free.
  static void ExpectNothingLeft(Engine* e, const std::string& id) {
    EXPECT_TRUE(absl::IsNotFound(e->GetSequence(id).status()));
    const EngineInfo info = e->Info();
    EXPECT_EQ(info.free_pages, info.total_pages);
    EXPECT_EQ(e->Metrics().sequences, 0);
  }
};

// Lengths that differ per layer and cross page boundaries, exported in chunks of a few
// rows (not a divisor of 64), imported on a second engine.
void RoundTrip(kernels::KvDType kv_dtype) {
  auto a = ExportImportTest::Make(3, 1, kv_dtype);
  auto b = ExportImportTest::Make(3, 1, kv_dtype);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  Harness ha(a.get(), 3), hb(b.get(), 4);
  const std::string id = ha.NewSequence(130, "moved");
  // Layer 0 gets 5 decode rows more, layer 2 one: 135, 130, 131 rows.
  std::vector<Harness::Pending*> steps;
  for (int i = 0; i < 5; ++i) steps.push_back(ha.MakeStep(id, 0, 1, false));
  steps.push_back(ha.MakeStep(id, 2, 1, false));
  for (auto* p : steps) ASSERT_TRUE(ha.Submit(p).ok());
  ASSERT_TRUE(ha.WaitAll(absl::Seconds(60)));

  const int64_t row_bytes = kv_dtype == kernels::KvDType::kFp8E4M3 ? 656 : 1152;
  auto x = ExportImportTest::Export(a.get(), id, 7 * row_bytes + 5);
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(x->header.row_bytes, row_bytes);
  EXPECT_EQ(x->header.kv_dtype, kv_dtype == kernels::KvDType::kFp8E4M3 ? "fp8_e4m3" : "bf16");
  EXPECT_EQ(x->header.lengths, (std::vector<int64_t>{135, 130, 131}));
  EXPECT_EQ(x->total_rows, 135 + 130 + 131);
  for (const auto& c : x->chunks) EXPECT_LE(c.rows, 7);
  const std::string bytes = x->Bytes();
  EXPECT_EQ(static_cast<int64_t>(bytes.size()), x->total_rows * row_bytes);
  EXPECT_EQ(x->crc32, ::crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size()));

  auto imported = ExportImportTest::Import(b.get(), *x);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->sequence_id, "moved");
  EXPECT_EQ(imported->lengths, x->header.lengths);
  auto info = b->GetSequence("moved");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->pages, 3);

  // The importer stores the very bytes: exported again, they are identical (fp8 rows
  // were not quantized a second time).
  auto again = ExportImportTest::Export(b.get(), "moved", size_t{1} << 20);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->Bytes() == bytes) << "the imported rows differ from the exported ones";
  EXPECT_EQ(again->crc32, x->crc32);

  // Decoding goes on on both engines, each exact against the rows it holds.
  hb.Adopt(ha, id, "moved");
  std::vector<Harness::Pending*> on_a, on_b;
  for (int layer = 0; layer < 3; ++layer) {
    on_a.push_back(ha.MakeStep(id, layer, 2, true));
    on_b.push_back(hb.MakeStep("moved", layer, 2, true));
  }
  for (auto* p : on_a) ASSERT_TRUE(ha.Submit(p).ok());
  for (auto* p : on_b) ASSERT_TRUE(hb.Submit(p).ok());
  ASSERT_TRUE(ha.WaitAll(absl::Seconds(60)));
  ASSERT_TRUE(hb.WaitAll(absl::Seconds(60)));
  for (auto* p : on_a) EXPECT_TRUE(ha.Check(*p, kExact));
  for (auto* p : on_b) EXPECT_TRUE(hb.Check(*p, kExact));

  const EngineMetrics ma = a->Metrics(), mb = b->Metrics();
  EXPECT_EQ(ma.sequences_exported, 1u);
  EXPECT_EQ(ma.export_bytes, bytes.size());
  EXPECT_EQ(mb.sequences_imported, 1u);
  EXPECT_EQ(mb.import_bytes, bytes.size());
  EXPECT_EQ(mb.import_failures, 0u);
}

TEST_F(ExportImportTest, RoundTripBf16IsByteIdenticalAndDecodesExactly) { RoundTrip(kernels::KvDType::kModel); }
TEST_F(ExportImportTest, RoundTripFp8IsByteIdenticalAndDecodesExactly) { RoundTrip(kernels::KvDType::kFp8E4M3); }

TEST_F(ExportImportTest, EmptySequenceAndEmptyLayersMove) {
  auto a = Make(2), b = Make(2);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(a->CreateSequence("empty").ok());
  auto x = Export(a.get(), "empty", 4096);
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_TRUE(x->chunks.empty());
  auto imported = Import(b.get(), *x, "empty-copy");
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->lengths, (std::vector<int64_t>{0, 0}));
  // Only layer 1 holds rows: layer 0 carries none.
  Harness ha(a.get(), 5);
  const std::string id = ha.NewSequence(0, "one-layer");
  ASSERT_TRUE(a->AppendKv(id, 1, std::string(3 * 1152, '\x11')).ok());
  auto y = Export(a.get(), id, 1 << 20);
  ASSERT_TRUE(y.ok()) << y.status();
  ASSERT_EQ(y->chunks.size(), 1u);
  EXPECT_EQ(y->chunks[0].layer, 1);
  ASSERT_TRUE(Import(b.get(), *y).ok());
  EXPECT_EQ(b->GetSequence(id)->lengths, (std::vector<int64_t>{0, 3}));
}

TEST_F(ExportImportTest, AnotherShapeOrFormatIsRefusedNamingTheField) {
  auto a = Make(2);
  ASSERT_NE(a, nullptr);
  Harness ha(a.get(), 6);
  const std::string id = ha.NewSequence(10, "s");
  auto x = Export(a.get(), id, 1 << 20);
  ASSERT_TRUE(x.ok()) << x.status();

  struct Case {
    std::unique_ptr<Engine> engine;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({Make(2, 2), "header.num_heads_kv: expected 2, got 1"});
  cases.push_back({Make(3), "header.num_layers: expected 3, got 2"});
  cases.push_back({Make(2, 1, kernels::KvDType::kModel, 128, kernels::DType::kFP16), "header.dtype: expected fp16, got bf16"});
  cases.push_back({Make(2, 1, kernels::KvDType::kFp8E4M3), "header.kv_dtype: expected fp8_e4m3, got 'bf16'"});
  for (auto& c : cases) {
    ASSERT_NE(c.engine, nullptr);
    auto st = Import(c.engine.get(), *x).status();
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), c.message)) << st;
    ExpectNothingLeft(c.engine.get(), id);
    EXPECT_EQ(c.engine->Metrics().import_failures, 1u);
  }

  auto b = Make(2);
  ASSERT_NE(b, nullptr);
  auto bad = [&](auto edit, absl::string_view message) {
    Exported y = *x;
    edit(y.header);
    auto st = Import(b.get(), y).status();
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), message)) << st;
    ExpectNothingLeft(b.get(), id);
  };
  bad([](SequenceExportHeader& h) { h.format_version = 2; }, "header.format_version: expected 1, got 2");
  bad([](SequenceExportHeader& h) { h.row_bytes = 1150; }, "header.row_bytes: expected 1152, got 1150");
  bad([](SequenceExportHeader& h) { h.page_size = 32; }, "header.page_size: expected 64, got 32");
  bad([](SequenceExportHeader& h) { h.lengths.push_back(1); }, "header.lengths: expected 2 layers, got 3");
  bad([](SequenceExportHeader& h) { h.lengths[1] = -1; }, "header.lengths[1]");
  bad([](SequenceExportHeader& h) { h.page_keys = {std::string(16, 'k')}; }, "header.page_keys: expected at most 0 keys");
  bad([](SequenceExportHeader& h) { h.sequence_id = "bad id"; }, "header.sequence_id: must be 1 to 128");
}

TEST_F(ExportImportTest, OutOfOrderTruncatedOrCorruptStreamsLeaveNothing) {
  auto a = Make(2), b = Make(2);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  Harness ha(a.get(), 7);
  const std::string id = ha.NewSequence(100, "s");
  auto x = Export(a.get(), id, 30 * 1152);
  ASSERT_TRUE(x.ok()) << x.status();
  ASSERT_EQ(x->chunks.size(), 8u);  // 30 + 30 + 30 + 10 rows per layer

  // Writes the chunks in `order` (indices into the export), then commits.
  auto run = [&](std::vector<int> order, int64_t total_rows, uint32_t crc) -> absl::Status {
    auto im = b->ImportSequence(x->header, "");
    if (!im.ok()) return im.status();
    // Invisible while it is under way.
    EXPECT_TRUE(absl::IsNotFound(b->GetSequence(id).status()));
    EXPECT_EQ(b->Info().free_pages, b->Info().total_pages - 2);  // both pages reserved up front
    for (int i : order) {
      const auto& c = x->chunks[i];
      if (absl::Status st = (*im)->Write(c.layer, c.first_row, c.bytes); !st.ok()) return st;
    }
    return (*im)->Commit(total_rows, crc).status();
  };
  auto expect = [&](absl::Status st, absl::StatusCode code, absl::string_view message) {
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), message)) << st;
    ExpectNothingLeft(b.get(), id);
  };
  const int64_t n = x->total_rows;
  const uint32_t crc = x->crc32;
  expect(run({1}, n, crc), absl::StatusCode::kInvalidArgument, "first_row: expected 0 (layer 0), got 30");
  expect(run({0, 4}, n, crc), absl::StatusCode::kInvalidArgument, "layer: expected 0 (row 30 of 100 next), got 1");
  expect(run({0, 1, 2, 3, 3}, n, crc), absl::StatusCode::kInvalidArgument, "layer: expected 1 (row 0 of 100 next), got 0");
  expect(run({0, 1, 2, 3, 5}, n, crc), absl::StatusCode::kInvalidArgument, "first_row: expected 0 (layer 1), got 30");
  expect(run({0, 1, 2, 3, 4, 5, 6, 7, 7}, n, crc), absl::StatusCode::kInvalidArgument,
         "layer: every row of the header's lengths has come");
  // Truncated: the stream ends before its last rows.
  expect(run({0, 1, 2, 3, 4, 5, 6}, n, crc), absl::StatusCode::kFailedPrecondition,
         "rows: layer 1 has 90 of its 100 rows");
  expect(run({0, 1, 2, 3, 4, 5, 6, 7}, n - 1, crc), absl::StatusCode::kInvalidArgument, "total_rows: expected 200");
  expect(run({0, 1, 2, 3, 4, 5, 6, 7}, n, crc ^ 1), absl::StatusCode::kInvalidArgument, "crc32: expected");

  // A partial row, and rows past the layer's length.
  {
    auto im = b->ImportSequence(x->header, "");
    ASSERT_TRUE(im.ok()) << im.status();
    absl::Status st = (*im)->Write(0, 0, absl::string_view(x->chunks[0].bytes).substr(0, 1000));
    expect(st, absl::StatusCode::kInvalidArgument, "rows: expected a positive multiple of 1152 bytes");
    // The importer gave everything back at the failure and refuses more.
    EXPECT_FALSE((*im)->Write(0, 0, x->chunks[0].bytes).ok());
  }
  {
    auto im = b->ImportSequence(x->header, "");
    ASSERT_TRUE(im.ok()) << im.status();
    const std::string too_many = x->chunks[0].bytes + x->chunks[1].bytes + x->chunks[2].bytes + x->chunks[3].bytes +
                                 x->chunks[4].bytes.substr(0, 1152);
    expect((*im)->Write(0, 0, too_many), absl::StatusCode::kInvalidArgument,
           "rows: 101 rows from row 0 pass layer 0's length 100");
  }
  // Abandoned part-way (the client went away): destroying the importer gives all back.
  {
    auto im = b->ImportSequence(x->header, "");
    ASSERT_TRUE(im.ok()) << im.status();
    ASSERT_TRUE((*im)->Write(0, 0, x->chunks[0].bytes).ok());
  }
  ExpectNothingLeft(b.get(), id);
  EXPECT_EQ(b->Metrics().import_failures, 11u);
  EXPECT_EQ(b->Metrics().sequences_imported, 0u);
  // And a good stream still imports.
  ASSERT_TRUE(Import(b.get(), *x).ok());
}

TEST_F(ExportImportTest, FullPoolAndTakenIdRefuseTheImport) {
  auto a = Make(1), b = Make(1, 1, kernels::KvDType::kModel, 4);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  Harness ha(a.get(), 8), hb(b.get(), 9);
  const std::string id = ha.NewSequence(150, "big");  // 3 pages
  auto x = Export(a.get(), id, 1 << 20);
  ASSERT_TRUE(x.ok()) << x.status();
  hb.NewSequence(100, "resident");  // 2 of b's 4 pages
  auto st = Import(b.get(), *x).status();
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "header.lengths: the sequence needs 3 pages, the kv cache has 2 free"))
      << st;
  EXPECT_EQ(b->Info().free_pages, 2);
  EXPECT_TRUE(absl::IsNotFound(b->GetSequence("big").status()));
  ASSERT_TRUE(b->ReleaseSequence("resident").ok());
  ASSERT_TRUE(Import(b.get(), *x).ok());
  // Taken: at the start, and at the commit when another sequence took the id meanwhile.
  auto c = Make(1);
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->CreateSequence("big").ok());
  st = Import(c.get(), *x).status();
  EXPECT_TRUE(absl::IsAlreadyExists(st)) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "sequence_id: sequence 'big' already exists")) << st;
  ASSERT_TRUE(c->ReleaseSequence("big").ok());
  auto im = c->ImportSequence(x->header, "");
  ASSERT_TRUE(im.ok()) << im.status();
  for (const auto& ch : x->chunks) ASSERT_TRUE((*im)->Write(ch.layer, ch.first_row, ch.bytes).ok());
  ASSERT_TRUE(c->CreateSequence("big").ok());
  st = (*im)->Commit(x->total_rows, x->crc32).status();
  EXPECT_TRUE(absl::IsAlreadyExists(st)) << st;
  EXPECT_EQ(c->Info().free_pages, c->Info().total_pages);
  // Under another id it goes in beside.
  auto other = Import(c.get(), *x, "big-2");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->sequence_id, "big-2");
}

TEST_F(ExportImportTest, ExportEndsNotFoundWhenTheSequenceIsReleasedAndIgnoresLaterRows) {
  auto a = Make(1);
  ASSERT_NE(a, nullptr);
  Harness ha(a.get(), 10);
  const std::string id = ha.NewSequence(200, "s");
  auto ex = a->ExportSequence(id);
  ASSERT_TRUE(ex.ok()) << ex.status();
  EXPECT_EQ((*ex)->header().lengths, std::vector<int64_t>{200});
  SequenceExportChunk c;
  ASSERT_TRUE(*(*ex)->Next(64 * 1152, &c));
  // Rows appended after the export began are not part of it.
  auto* p = ha.MakeStep(id, 0, 1, false);
  ASSERT_TRUE(ha.Submit(p).ok());
  ASSERT_TRUE(ha.WaitAll(absl::Seconds(60)));
  int64_t rows = c.rows;
  while (true) {
    auto more = (*ex)->Next(64 * 1152, &c);
    ASSERT_TRUE(more.ok()) << more.status();
    if (!*more) break;
    rows += c.rows;
  }
  EXPECT_EQ(rows, 200);

  auto ex2 = a->ExportSequence(id);
  ASSERT_TRUE(ex2.ok());
  ASSERT_TRUE(*(*ex2)->Next(1152, &c));
  ASSERT_TRUE(a->ReleaseSequence(id).ok());
  ASSERT_TRUE(a->CreateSequence(id).ok());  // the same id again is another sequence
  auto more = (*ex2)->Next(1152, &c);
  EXPECT_TRUE(absl::IsNotFound(more.status())) << more.status();
  EXPECT_TRUE(absl::IsNotFound(a->ExportSequence("nope").status()));
}

TEST_F(ExportImportTest, PublishedPageKeysTravelAndAreCachedOnTheImporter) {
  auto a = Make(1), b = Make(1);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  std::vector<std::string> keys = {std::string(16, 'a'), std::string(16, 'b')};
  ASSERT_TRUE(a->CreateSequenceWithPrefix("p", keys).ok());
  const std::string rows(130 * 1152, '\x22');
  ASSERT_TRUE(a->AppendKv("p", 0, rows).ok());
  auto x = Export(a.get(), "p", 1 << 20);
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(x->header.page_keys, keys);
  ASSERT_TRUE(Import(b.get(), *x).ok());
  auto created = b->CreateSequenceWithPrefix("q", keys);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->prefix_tokens, 128);
}

}  // namespace
}  // namespace latentd::engine
