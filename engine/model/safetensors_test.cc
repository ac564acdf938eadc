// The safetensors reader: round trips of every kind of entry, each malformed header or
// file rejected with a message naming the file and the tensor, and folder indexing with
// and without model.safetensors.index.json.
#include "engine/model/safetensors.h"

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/model/testing/checkpoint_writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace latentd::engine::model {
namespace {

using testing::RawTensor;
using testing::SafetensorsBytes;
using testing::SafetensorsBytesFromHeader;
using testing::TempDir;
using testing::WriteFile;
using ::testing::HasSubstr;

std::string Bytes(size_t n, uint8_t seed) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s.push_back(static_cast<char>(seed + 37 * i + 1));
  return s;
}

absl::StatusOr<SafetensorsHeader> Parse(const std::string& bytes, const std::string& file = "x.safetensors") {
  return ParseSafetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), file);
}

// Message of a failed parse (empty, and a test failure, when it succeeds).
std::string ParseError(const std::string& bytes) {
  absl::StatusOr<SafetensorsHeader> h = Parse(bytes);
  EXPECT_FALSE(h.ok());
  return h.ok() ? "" : std::string(h.status().message());
}

TEST(SafetensorsTest, RoundTrip) {
  const std::vector<RawTensor> tensors = {
      {"a.bf16", "BF16", {3, 5}, Bytes(30, 1)},
      {"b.f16", "F16", {7}, Bytes(14, 2)},
      {"c.f32", "F32", {2, 2, 2}, Bytes(32, 3)},
      {"d.e4m3", "F8_E4M3", {4, 3}, Bytes(12, 4)},
      {"e.i64", "I64", {2}, Bytes(16, 5)},
      {"f.scalar", "F64", {}, Bytes(8, 6)},
      {"g.empty", "BF16", {0, 4}, ""},
      {"h.fp4", "F4", {2, 3}, Bytes(3, 7)},  // packed, 4 bits a value
      {"i.bool", "BOOL", {5}, Bytes(5, 8)},
  };
  const std::string dir = TempDir("roundtrip");
  const std::string path = dir + "/m.safetensors";
  WriteFile(path, SafetensorsBytes(tensors));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->path(), path);
  EXPECT_EQ((*f)->tensors().size(), tensors.size());
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  for (const RawTensor& t : tensors) {
    const TensorInfo* info = (*f)->Find(t.name);
    ASSERT_NE(info, nullptr) << t.name;
    EXPECT_STREQ(TensorDTypeName(info->dtype), t.dtype.c_str());
    EXPECT_EQ(info->shape, t.shape) << t.name;
    absl::Span<const uint8_t> data = (*f)->Data(*info);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(data.data()), data.size()), t.bytes) << t.name;
  }
  EXPECT_EQ((*f)->Find("g.empty")->num_elements(), 0);
  EXPECT_EQ((*f)->Find("f.scalar")->num_elements(), 1);
  EXPECT_EQ((*f)->Find("nothing"), nullptr);
}

TEST(SafetensorsTest, DTypeNames) {
  for (const char* name : {"BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32",
                           "U32", "F32", "I64", "U64", "F64", "F4", "F6_E2M3", "F6_E3M2"}) {
    std::optional<TensorDType> d = ParseTensorDType(name);
    ASSERT_TRUE(d.has_value()) << name;
    EXPECT_STREQ(TensorDTypeName(*d), name);
  }
  EXPECT_EQ(TensorDTypeBits(TensorDType::kBF16), 16);
  EXPECT_EQ(TensorDTypeBits(TensorDType::kF8E4M3), 8);
  EXPECT_FALSE(ParseTensorDType("bf16").has_value());
}

TEST(SafetensorsTest, ShortOrTruncatedFile) {
  absl::StatusOr<SafetensorsHeader> h = Parse("1234567", "short.safetensors");
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("short.safetensors: 7 bytes"));

  // The header runs past the end of the file.
  const std::string good = SafetensorsBytes({{"w", "BF16", {4, 4}, Bytes(32, 1)}});
  std::string cut = good.substr(0, 20);
  h = Parse(cut, "cut.safetensors");
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("cut.safetensors: header length"));

  // The data section ends early: the last tensor's offsets run past it.
  const std::string two = SafetensorsBytes({{"first", "BF16", {4}, Bytes(8, 1)}, {"last", "F32", {4}, Bytes(16, 2)}});
  const std::string msg = ParseError(two.substr(0, two.size() - 1));
  EXPECT_THAT(msg, HasSubstr("x.safetensors: tensor \"last\": data_offsets [8, 24] run past the 23-byte data section"));
}

TEST(SafetensorsTest, TruncatedFileOnDisk) {
  const std::string dir = TempDir("truncated");
  const std::string good = SafetensorsBytes({{"w", "BF16", {4, 4}, Bytes(32, 1)}});
  WriteFile(dir + "/t.safetensors", good.substr(0, good.size() - 10));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(dir + "/t.safetensors");
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(std::string(f.status().message()), HasSubstr(dir + "/t.safetensors: tensor \"w\": data_offsets"));
  // Empty file.
  WriteFile(dir + "/e.safetensors", "");
  f = SafetensorsFile::Open(dir + "/e.safetensors");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss);
  f = SafetensorsFile::Open(dir + "/none.safetensors");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
}

struct HeaderCase {
  const char* header;
  size_t data_bytes;
  const char* message;  // substring the error must contain
};

TEST(SafetensorsTest, BadHeaders) {
  const HeaderCase cases[] = {
      {R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", 4,
       R"(tensor "w": data_offsets [0, 8] run past the 4-byte data section)"},
      {R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[6,2]}})", 8, R"(tensor "w": data_offsets [6, 2]: begin is past end)"},
      {R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})", 8,
       R"(tensor "w": data_offsets [0, 4] hold 4 bytes; shape [3] of BF16 needs 6)"},
      {R"({"w":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,4]}})", 4, R"(tensor "w": unknown dtype "Q4_K"; expected one of BOOL)"},
      {R"({"w":{"dtype":3,"shape":[2],"data_offsets":[0,4]}})", 4, R"(tensor "w": dtype: expected a string)"},
      {R"({"w":{"dtype":"BF16","shape":[-2],"data_offsets":[0,4]}})", 4, R"(tensor "w": shape: expected an array of non-negative integers)"},
      {R"({"w":{"dtype":"BF16","shape":[2.5],"data_offsets":[0,4]}})", 4, R"(tensor "w": shape: expected)"},
      {R"({"w":{"dtype":"BF16","shape":"2","data_offsets":[0,4]}})", 4, R"(tensor "w": shape: expected)"},
      {R"({"w":{"dtype":"BF16","shape":[2]}})", 4, R"(tensor "w": data_offsets: expected [begin, end])"},
      {R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0]}})", 4, R"(tensor "w": data_offsets: expected)"},
      {R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,-4]}})", 4, R"(tensor "w": data_offsets: expected)"},
      {R"({"w":[1,2]})", 4, R"(tensor "w": expected an object)"},
      {R"({"w":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 4, R"(tensor "w": shape [3] of F4 does not fill whole bytes)"},
      {R"({"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4, R"(tensor "w": shape [4294967296,4294967296] is too large)"},
      {R"({"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[6,10]}})", 12,
       R"(tensor "b": data_offsets [6, 10] overlap those of "a" [0, 8])"},
      // Overlap with an earlier, longer range that a shorter one in between hides.
      {R"({"a":{"dtype":"U8","shape":[10],"data_offsets":[0,10]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},"c":{"dtype":"U8","shape":[2],"data_offsets":[5,7]}})",
       12, R"(overlap those of "a")"},
      {R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"w":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}})", 8,
       R"(header: names "w" twice)"},
      {R"({"__metadata__":"pt"})", 0, "__metadata__: expected an object of strings"},
      {R"([1, 2])", 0, "header: expected a JSON object"},
      {R"({"w":{"dtype":"BF16",)", 0, "header: not valid JSON"},
      {"", 0, "header: not valid JSON"},
      {R"({"w":{"dtype":"BF16","shape":[[[[[[[[[[2]]]]]]]]]],"data_offsets":[0,4]}})", 4,
       "header: nests deeper than 8 levels"},
  };
  for (const HeaderCase& c : cases) {
    const std::string msg = ParseError(SafetensorsBytesFromHeader(c.header, std::string(c.data_bytes, '\x11')));
    EXPECT_THAT(msg, HasSubstr("x.safetensors: ")) << c.header;
    EXPECT_THAT(msg, HasSubstr(c.message)) << c.header;
  }
}

TEST(SafetensorsTest, HeaderLengthOverLimit) {
  std::string bytes(16, '\0');
  const uint64_t n = kMaxSafetensorsHeaderBytes + 1;
  std::memcpy(bytes.data(), &n, 8);
  EXPECT_THAT(ParseError(bytes), HasSubstr("is over the limit"));
}

TEST(SafetensorsTest, HolesAndEmptyTensorsAreAccepted) {
  // Not contiguous (a gap at [4, 6)) and an empty tensor inside another's range: neither
  // overlaps bytes.
  const std::string header =
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"e":{"dtype":"U8","shape":[0],"data_offsets":[2,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}})";
  absl::StatusOr<SafetensorsHeader> h = Parse(SafetensorsBytesFromHeader(header, std::string(8, 'x')));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors.size(), 3u);
  EXPECT_EQ(h->data_offset, 8u + header.size());
}

TEST(CheckpointTest, ScansFolderWithoutIndex) {
  const std::string dir = TempDir("scan");
  WriteFile(dir + "/a.safetensors", SafetensorsBytes({{"x", "BF16", {2}, Bytes(4, 1)}}));
  WriteFile(dir + "/b.safetensors", SafetensorsBytes({{"y", "F32", {1}, Bytes(4, 2)}}));
  WriteFile(dir + "/notes.txt", "not a checkpoint");
  absl::StatusOr<Checkpoint> c = Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_tensors(), 2u);
  EXPECT_EQ(c->source(), dir);
  ASSERT_TRUE(c->Find("y").has_value());
  EXPECT_EQ(c->Find("y")->file->path(), dir + "/b.safetensors");
  EXPECT_FALSE(c->Find("z").has_value());

  WriteFile(dir + "/c.safetensors", SafetensorsBytes({{"x", "BF16", {2}, Bytes(4, 3)}}));
  c = Checkpoint::Open(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr(dir + "/c.safetensors: tensor \"x\": also in " + dir + "/a.safetensors"));
}

TEST(CheckpointTest, EmptyFolder) {
  absl::StatusOr<Checkpoint> c = Checkpoint::Open(TempDir("empty"));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("no *.safetensors files"));
}

TEST(CheckpointTest, IndexWeightMap) {
  const std::string dir = TempDir("index");
  WriteFile(dir + "/m-1.safetensors", SafetensorsBytes({{"x", "BF16", {2}, Bytes(4, 1)}, {"extra", "U8", {1}, "e"}}));
  WriteFile(dir + "/m-2.safetensors", SafetensorsBytes({{"y", "F32", {1}, Bytes(4, 2)}}));
  // Not in the weight map: never opened, so its garbage does not matter.
  WriteFile(dir + "/stale.safetensors", "garbage");
  const std::string index = dir + "/model.safetensors.index.json";
  WriteFile(index, R"({"metadata": {"total_size": 8}, "weight_map": {"x": "m-1.safetensors", "y": "m-2.safetensors"}})");
  absl::StatusOr<Checkpoint> c = Checkpoint::Open(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->source(), index);
  EXPECT_EQ(c->num_tensors(), 2u);
  EXPECT_EQ(c->files().size(), 2u);
  ASSERT_TRUE(c->Find("x").has_value());
  EXPECT_EQ(c->Find("x")->file->path(), dir + "/m-1.safetensors");

  struct Bad {
    const char* index;
    std::string message;
  };
  const Bad bad[] = {
      {R"({"weight_map": {"x": "m-3.safetensors"}})", dir + "/m-3.safetensors: cannot open"},
      {R"({"weight_map": {"z": "m-1.safetensors"}})",
       dir + "/m-1.safetensors: tensor \"z\": missing, though " + index + " maps it to this file"},
      {R"({"weight_map": {"x": "../m-1.safetensors"}})", "is not a file name in the folder"},
      {R"({"weight_map": {"x": 3}})", "tensor \"x\": expected a file name"},
      {R"({"weight_map": {"x": "stale.safetensors"}})", dir + "/stale.safetensors: "},
      {R"({"metadata": {}})", "weight_map: expected an object"},
      {R"({"weight_map": )", "not valid JSON"},
  };
  for (const Bad& b : bad) {
    WriteFile(index, b.index);
    c = Checkpoint::Open(dir);
    ASSERT_FALSE(c.ok()) << b.index;
    const std::string msg(c.status().message());
    EXPECT_THAT(msg, HasSubstr(b.message)) << b.index;
    EXPECT_THAT(msg, HasSubstr(index)) << b.index;
  }
}

}  // namespace
}  // namespace latentd::engine::model
