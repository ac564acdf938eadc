// Attention weight loading from tiny random checkpoints: exact round trips (bf16, fp16),
// FP8 block dequantization against an independent decoding written here, tensor-parallel
// slices that concatenate back to the whole, and every bad checkpoint rejected with a
// message naming the file, the tensor and what was expected.
#include "engine/model/weights.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "engine/model/testing/checkpoint_writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace latentd::engine::model {
namespace {

using testing::MakeTinyModel;
using testing::RawTensor;
using testing::TempDir;
using testing::TinyModel;
using testing::TinyModelSpec;
using testing::WeightFormat;
using testing::WriteTinyModel;
using ::testing::HasSubstr;

struct Loaded {
  ModelConfig config;
  AttentionWeights weights;
};

absl::StatusOr<Loaded> Load(const std::string& dir, TensorParallel tp = {}) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<Checkpoint> ckpt = Checkpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  absl::StatusOr<AttentionWeights> w = LoadAttentionWeights(*ckpt, *config, tp);
  if (!w.ok()) return w.status();
  return Loaded{*std::move(config), *std::move(w)};
}

std::string LoadError(const std::string& dir, TensorParallel tp = {}) {
  absl::StatusOr<Loaded> l = Load(dir, tp);
  EXPECT_FALSE(l.ok()) << dir;
  return l.ok() ? "" : std::string(l.status().message());
}

std::vector<uint16_t> Values16(const RawTensor& t) {
  std::vector<uint16_t> v(t.bytes.size() / 2);
  std::memcpy(v.data(), t.bytes.data(), t.bytes.size());
  return v;
}

// Independent decodings: the formats' definitions, evaluated in double.
double Bf16Value(uint16_t b) {
  const int e = (b >> 7) & 0xff, m = b & 0x7f;
  const double v = e == 0 ? std::ldexp(m, -133) : std::ldexp(128 + m, e - 134);
  return (b & 0x8000) ? -v : v;
}
double E4m3Value(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (c & 0x80) ? -v : v;
}
// The bf16 nearest to x (ties to even), for the normal range the test values stay in.
double RoundToBf16(double x) {
  int e;
  const double m = std::frexp(x, &e);  // x = m * 2^e, 0.5 <= |m| < 1
  return std::ldexp(std::nearbyint(std::ldexp(m, 8)), e - 8);
}

std::string Layer(int l, const char* tensor) { return absl::StrCat("model.layers.", l, ".self_attn.", tensor, ".weight"); }

const HostTensor& Field(const AttentionLayerWeights& w, const std::string& tensor) {
  if (tensor == "q_a_proj") return w.q_a_proj;
  if (tensor == "q_a_layernorm") return w.q_a_layernorm;
  if (tensor == "q_b_proj") return w.q_b_proj;
  if (tensor == "q_proj") return w.q_proj;
  if (tensor == "kv_a_proj_with_mqa") return w.kv_a_proj_with_mqa;
  if (tensor == "kv_a_layernorm") return w.kv_a_layernorm;
  if (tensor == "kv_b_proj") return w.kv_b_proj;
  return w.o_proj;
}

std::vector<std::string> Names(bool q_lora) {
  std::vector<std::string> n = {"kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"};
  if (q_lora) {
    n.insert(n.begin(), {"q_a_proj", "q_a_layernorm", "q_b_proj"});
  } else {
    n.insert(n.begin(), "q_proj");
  }
  return n;
}

TEST(WeightsTest, RoundTripExact) {
  for (WeightFormat format : {WeightFormat::kBF16, WeightFormat::kFP16}) {
    for (bool q_lora : {true, false}) {
      for (bool index : {true, false}) {
        TinyModelSpec spec;
        spec.format = format;
        spec.q_lora = q_lora;
        spec.yarn = index;
        spec.seed = 11 + q_lora + 2 * index;
        const TinyModel m = MakeTinyModel(spec);
        const std::string dir = TempDir("roundtrip");
        WriteTinyModel(m, dir, index ? 2 : 3, index);
        absl::StatusOr<Loaded> l = Load(dir);
        ASSERT_TRUE(l.ok()) << l.status();
        const AttentionWeights& w = l->weights;
        EXPECT_EQ(w.dtype, format == WeightFormat::kBF16 ? kernels::DType::kBF16 : kernels::DType::kFP16);
        EXPECT_EQ(w.num_heads, 4);
        ASSERT_EQ(w.layers.size(), 2u);
        int64_t bytes = 0;
        for (int layer = 0; layer < 2; ++layer) {
          EXPECT_EQ(w.layers[layer].layer, layer);
          for (const std::string& t : Names(q_lora)) {
            const RawTensor& raw = m.Get(Layer(layer, t.c_str()));
            const HostTensor& got = Field(w.layers[layer], t);
            EXPECT_EQ(got.name, raw.name);
            EXPECT_EQ(got.shape, raw.shape) << raw.name;
            EXPECT_EQ(got.values, Values16(raw)) << raw.name;
            bytes += static_cast<int64_t>(raw.bytes.size());
          }
          // The other form's tensors stay empty.
          EXPECT_TRUE(Field(w.layers[layer], q_lora ? "q_proj" : "q_b_proj").values.empty());
        }
        EXPECT_EQ(w.bytes(), bytes);
        // H 200, h 4, q_lora 136, kv_lora 144, heads 16 + 8 (q/k) and 16 (v), per layer:
        // q_a 136 x 200 + 136 + q_b 96 x 136 (or q_proj 96 x 200) + kv_a 152 x 200 + 144
        // + kv_b 128 x 144 + o 200 x 64, two bytes each.
        const int64_t per_layer = q_lora ? (27200 + 136 + 13056) + 30400 + 144 + 18432 + 12800
                                         : 19200 + 30400 + 144 + 18432 + 12800;
        EXPECT_EQ(w.bytes(), 2 * 2 * per_layer);
      }
    }
  }
}

TEST(WeightsTest, Fp8BlockDequantization) {
  for (bool q_lora : {true, false}) {
    TinyModelSpec spec;
    spec.format = WeightFormat::kFP8;
    spec.q_lora = q_lora;
    spec.seed = 5 + q_lora;
    const TinyModel m = MakeTinyModel(spec);
    const std::string dir = TempDir("fp8");
    WriteTinyModel(m, dir, 2, true);
    absl::StatusOr<Loaded> l = Load(dir);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->weights.dtype, kernels::DType::kBF16);
    int partial_blocks = 0;
    for (int layer = 0; layer < 2; ++layer) {
      for (const std::string& t : Names(q_lora)) {
        const RawTensor& raw = m.Get(Layer(layer, t.c_str()));
        const HostTensor& got = Field(l->weights.layers[layer], t);
        ASSERT_EQ(got.shape, raw.shape) << raw.name;
        if (raw.shape.size() == 1) {  // norms stay bf16
          EXPECT_EQ(raw.dtype, "BF16");
          EXPECT_EQ(got.values, Values16(raw)) << raw.name;
          continue;
        }
        ASSERT_EQ(raw.dtype, "F8_E4M3");
        const RawTensor& scale = m.Get(raw.name + "_scale_inv");
        const int64_t rows = raw.shape[0], cols = raw.shape[1], scols = (cols + 127) / 128;
        ASSERT_EQ(scale.shape, (std::vector<int64_t>{(rows + 127) / 128, scols})) << raw.name;
        if (rows % 128 != 0 || cols % 128 != 0) ++partial_blocks;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            float s;
            std::memcpy(&s, scale.bytes.data() + 4 * ((r / 128) * scols + c / 128), 4);
            // The product in float (e4m3 values are exact there), then one rounding to bf16.
            const float product = static_cast<float>(E4m3Value(static_cast<uint8_t>(raw.bytes[r * cols + c]))) * s;
            const double want = RoundToBf16(product);
            const double have = Bf16Value(got.values[r * cols + c]);
            ASSERT_NE(want, 0.0);
            ASSERT_EQ(have, want) << raw.name << " [" << r << ", " << c << "]";
          }
        }
      }
    }
    EXPECT_GT(partial_blocks, 0);  // the shapes exercise edge blocks
  }
}

// Rank r's rows (q_b/q_proj, kv_b) and o_proj columns, side by side in rank order, are
// the whole tensors; replicated tensors are identical on every rank.
TEST(WeightsTest, TensorParallelSlicesConcatenate) {
  for (WeightFormat format : {WeightFormat::kBF16, WeightFormat::kFP8}) {
    for (bool q_lora : {true, false}) {
      TinyModelSpec spec;
      spec.format = format;
      spec.q_lora = q_lora;
      spec.seed = 21 + q_lora;
      const std::string dir = TempDir("tp");
      WriteTinyModel(MakeTinyModel(spec), dir, 2, true);
      absl::StatusOr<Loaded> full = Load(dir);
      ASSERT_TRUE(full.ok()) << full.status();
      for (int n : {2, 4}) {
        std::vector<AttentionWeights> ranks;
        for (int r = 0; r < n; ++r) {
          absl::StatusOr<Loaded> l = Load(dir, {n, r});
          ASSERT_TRUE(l.ok()) << l.status();
          EXPECT_EQ(l->weights.num_heads, 4 / n);
          EXPECT_EQ(l->weights.tensor_parallel.rank, r);
          ranks.push_back(std::move(l->weights));
        }
        for (int layer = 0; layer < 2; ++layer) {
          const AttentionLayerWeights& f = full->weights.layers[layer];
          for (const std::string& t : Names(q_lora)) {
            const HostTensor& whole = Field(f, t);
            std::vector<uint16_t> joined;
            if (t == "o_proj") {  // columns: row by row, each rank's part in order
              const int64_t part = whole.shape[1] / n;
              for (int64_t row = 0; row < whole.shape[0]; ++row) {
                for (int r = 0; r < n; ++r) {
                  const HostTensor& s = Field(ranks[r].layers[layer], t);
                  ASSERT_EQ(s.shape, (std::vector<int64_t>{whole.shape[0], part}));
                  joined.insert(joined.end(), s.values.begin() + row * part, s.values.begin() + (row + 1) * part);
                }
              }
            } else if (t == "q_b_proj" || t == "q_proj" || t == "kv_b_proj") {
              for (int r = 0; r < n; ++r) {
                const HostTensor& s = Field(ranks[r].layers[layer], t);
                ASSERT_EQ(s.shape, (std::vector<int64_t>{whole.shape[0] / n, whole.shape[1]})) << t;
                joined.insert(joined.end(), s.values.begin(), s.values.end());
              }
            } else {
              for (int r = 1; r < n; ++r) {
                EXPECT_EQ(Field(ranks[r].layers[layer], t).values, whole.values) << t;
              }
              joined = Field(ranks[0].layers[layer], t).values;
            }
            EXPECT_EQ(joined, whole.values) << t << " tp " << n;
          }
        }
      }
    }
  }
}

TEST(WeightsTest, TensorParallelArguments) {
  const std::string dir = TempDir("tp_args");
  WriteTinyModel(MakeTinyModel({}), dir, 1, false);
  EXPECT_THAT(LoadError(dir, {3, 0}), HasSubstr("tensor_parallel: 3 does not divide the 4 num_attention_heads of " +
                                                dir + "/config.json"));
  EXPECT_THAT(LoadError(dir, {2, 2}), HasSubstr("tensor_rank: must be in [0, 1]"));
  EXPECT_THAT(LoadError(dir, {0, 0}), HasSubstr("tensor_parallel: must be at least 1"));
}

// The checkpoint is read layer by layer: one layer alone gives what the whole load gives.
TEST(WeightsTest, SingleLayer) {
  const std::string dir = TempDir("single");
  WriteTinyModel(MakeTinyModel({}), dir, 2, true);
  absl::StatusOr<Loaded> full = Load(dir);
  ASSERT_TRUE(full.ok()) << full.status();
  absl::StatusOr<Checkpoint> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  absl::StatusOr<AttentionLayerWeights> l1 = LoadAttentionLayer(*ckpt, full->config, 1);
  ASSERT_TRUE(l1.ok()) << l1.status();
  EXPECT_EQ(l1->o_proj.values, full->weights.layers[1].o_proj.values);
  EXPECT_EQ(l1->bytes(), full->weights.layers[1].bytes());
  absl::StatusOr<AttentionLayerWeights> l2 = LoadAttentionLayer(*ckpt, full->config, 2);
  ASSERT_FALSE(l2.ok());
  EXPECT_THAT(std::string(l2.status().message()), HasSubstr("layer 2: must be in [0, 1]"));
}

// A bad checkpoint: what to change in a freshly made model, and what the error must say.
struct BadCheckpoint {
  const char* what;
  std::function<void(TinyModel&)> edit;
  std::string tensor;  // the message must name it
  std::string expect;  // and contain this
};

TEST(WeightsTest, BadCheckpointsNameFileAndTensor) {
  const std::string q_b = Layer(1, "q_b_proj");
  const std::string kv_b = Layer(0, "kv_b_proj");
  const std::string o = Layer(1, "o_proj");
  const std::string norm = Layer(0, "kv_a_layernorm");
  const std::vector<BadCheckpoint> cases = {
      {"missing tensor", [&](TinyModel& m) { m.Remove(kv_b); }, kv_b,
       "missing; expected shape [128, 144], num_attention_heads 4 x (qk_nope_head_dim 16 + v_head_dim 16) x "
       "kv_lora_rank 144"},
      {"misshapen tensor",
       [&](TinyModel& m) {
         RawTensor& t = m.Mutable(o);
         t.shape = {200, 60};
         t.bytes.resize(200 * 60 * 2);
       },
       o, "shape [200, 60]; expected [200, 64], hidden_size 200 x num_attention_heads 4 x v_head_dim 16"},
      {"transposed tensor", [&](TinyModel& m) { m.Mutable(o).shape = {64, 200}; }, o, "expected [200, 64]"},
      {"norm of the wrong length",
       [&](TinyModel& m) {
         RawTensor& t = m.Mutable(norm);
         t.shape = {143};
         t.bytes.resize(143 * 2);
       },
       norm, "shape [143]; expected [144], kv_lora_rank 144"},
      {"unknown dtype", [&](TinyModel& m) { m.Mutable(q_b).dtype = "Q8_0"; }, q_b, "unknown dtype \"Q8_0\""},
      {"unsupported dtype",
       [&](TinyModel& m) {
         RawTensor& t = m.Mutable(q_b);
         t.dtype = "I32";
         t.bytes += t.bytes;
       },
       q_b, "dtype I32; expected BF16, F16, F32 or F8_E4M3"},
      {"byte size that does not match the shape",
       [&](TinyModel& m) { m.Mutable(q_b).bytes.resize(m.Get(q_b).bytes.size() - 2); }, q_b,
       "shape [96, 136] of BF16 needs 26112"},
      {"NaN value", [&](TinyModel& m) { m.Mutable(q_b).bytes.replace(2 * (136 * 3 + 5), 2, "\xc0\x7f"); }, q_b,
       "element [3, 5] is not finite in bf16"},
  };
  for (const BadCheckpoint& c : cases) {
    TinyModel m = MakeTinyModel({});
    c.edit(m);
    const std::string dir = TempDir("bad");
    WriteTinyModel(m, dir, 2, true);
    const std::string msg = LoadError(dir);
    EXPECT_THAT(msg, HasSubstr(dir + "/")) << c.what;  // a file of the folder, or the folder
    EXPECT_THAT(msg, HasSubstr(c.tensor)) << c.what;
    EXPECT_THAT(msg, HasSubstr(c.expect)) << c.what << ": " << msg;
  }
}

TEST(WeightsTest, BadFilesNameFileAndTensor) {
  TinyModel m = MakeTinyModel({});
  const std::string dir = TempDir("bad_files");
  WriteTinyModel(m, dir, 2, true);
  const std::string file = dir + "/model-00002-of-00002.safetensors";
  // Truncated: the last tensor of the file runs past its end.
  std::filesystem::resize_file(file, std::filesystem::file_size(file) - 100);
  std::string msg = LoadError(dir);
  EXPECT_THAT(msg, HasSubstr(file + ": tensor \"model.norm.weight\": data_offsets"));
  EXPECT_THAT(msg, HasSubstr("a truncated file?"));
  // Cut inside the header.
  std::filesystem::resize_file(file, 100);
  EXPECT_THAT(LoadError(dir), HasSubstr(file + ": header length"));
  // Offsets out of range in an otherwise intact file.
  testing::WriteFile(file, testing::SafetensorsBytesFromHeader(
                               R"({"model.norm.weight":{"dtype":"BF16","shape":[200],"data_offsets":[400,800]}})",
                               std::string(400, '\x3c')));
  EXPECT_THAT(LoadError(dir), HasSubstr(file + ": tensor \"model.norm.weight\": data_offsets [400, 800] run past"));
}

TEST(WeightsTest, ConfigThatDoesNotMatchTheCheckpoint) {
  TinyModelSpec spec;
  const std::string dir = TempDir("mismatch");
  WriteTinyModel(MakeTinyModel(spec), dir, 2, true);
  TinyModelSpec other = spec;
  other.hidden_size = 208;
  testing::WriteFile(dir + "/config.json", testing::ConfigJson(other));
  std::string msg = LoadError(dir);
  EXPECT_THAT(msg, HasSubstr(dir + "/model-0000"));
  EXPECT_THAT(msg, HasSubstr(Layer(0, "q_a_proj") + ": shape [136, 200]; expected [136, 208], q_lora_rank 136 x "
                                                    "hidden_size 208 in " + dir + "/config.json"));

  other = spec;
  other.num_heads = 2;
  testing::WriteFile(dir + "/config.json", testing::ConfigJson(other));
  EXPECT_THAT(LoadError(dir), HasSubstr(Layer(0, "q_b_proj") + ": shape [96, 136]; expected [48, 136]"));

  other = spec;
  other.q_lora = false;
  testing::WriteFile(dir + "/config.json", testing::ConfigJson(other));
  msg = LoadError(dir);
  EXPECT_THAT(msg, HasSubstr(dir + "/model.safetensors.index.json: tensor " + Layer(0, "q_proj") + ": missing"));
  EXPECT_THAT(msg, HasSubstr("config.json's q_lora_rank is null"));

  // More layers in config.json than in the checkpoint.
  other = spec;
  other.num_layers = 3;
  testing::WriteFile(dir + "/config.json", testing::ConfigJson(other));
  EXPECT_THAT(LoadError(dir), HasSubstr(Layer(2, "q_a_proj") + ": missing"));
}

TEST(WeightsTest, BadFp8Checkpoints) {
  TinyModelSpec spec;
  spec.format = WeightFormat::kFP8;
  const std::string w = Layer(1, "kv_a_proj_with_mqa");
  const std::string s = w + "_scale_inv";
  const std::vector<BadCheckpoint> cases = {
      {"missing scale", [&](TinyModel& m) { m.Remove(s); }, s, "missing; expected shape [2, 2], one float32 per 128x128 block"},
      {"scale of the wrong shape",
       [&](TinyModel& m) {
         RawTensor& t = m.Mutable(s);
         t.shape = {1, 2};
         t.bytes.resize(8);
       },
       s, "shape [1, 2]; expected [2, 2]"},
      {"scale in bf16",
       [&](TinyModel& m) {
         RawTensor& t = m.Mutable(s);
         t.dtype = "BF16";
         t.bytes.resize(8);
       },
       s, "dtype BF16; expected F32"},
      {"quantized norm",
       [&](TinyModel& m) {
         RawTensor& t = m.Mutable(Layer(0, "kv_a_layernorm"));
         t.dtype = "F8_E4M3";
         t.bytes.resize(144);
       },
       Layer(0, "kv_a_layernorm"), "is F8_E4M3; expected BF16, F16 or F32"},
      {"NaN code", [&](TinyModel& m) { m.Mutable(w).bytes[200 * 130 + 7] = '\x7f'; }, w,
       "element [130, 7] is not finite"},
      {"infinite scale",
       [&](TinyModel& m) { m.Mutable(s).bytes.replace(4, 4, std::string("\x00\x00\x80\x7f", 4)); }, w,
       "element [0, 128] is not finite"},
  };
  for (const BadCheckpoint& c : cases) {
    TinyModel m = MakeTinyModel(spec);
    c.edit(m);
    const std::string dir = TempDir("bad_fp8");
    WriteTinyModel(m, dir, 2, false);
    const std::string msg = LoadError(dir);
    EXPECT_THAT(msg, HasSubstr(dir)) << c.what;
    EXPECT_THAT(msg, HasSubstr(c.tensor)) << c.what;
    EXPECT_THAT(msg, HasSubstr(c.expect)) << c.what << ": " << msg;
  }
  // An e4m3 checkpoint whose config.json has no quantization_config.
  const std::string dir = TempDir("fp8_noquant");
  WriteTinyModel(MakeTinyModel(spec), dir, 2, true);
  TinyModelSpec plain = spec;
  plain.format = WeightFormat::kBF16;
  testing::WriteFile(dir + "/config.json", testing::ConfigJson(plain));
  EXPECT_THAT(LoadError(dir), HasSubstr(Layer(0, "q_a_proj") + ": is F8_E4M3, but config.json has no "
                                                               "quantization_config"));
}

}  // namespace
}  // namespace latentd::engine::model
