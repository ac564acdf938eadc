// Safetensors and tiny-checkpoint writers for the engine/model tests.
#include "engine/model/testing/checkpoint_writer.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace latentd::engine::model::testing {
namespace {

int64_t Product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void Put16(std::string& s, uint16_t v) {
  s.push_back(static_cast<char>(v & 0xff));
  s.push_back(static_cast<char>(v >> 8));
}

void PutF32(std::string& s, float f) {
  char b[4];
  std::memcpy(b, &f, 4);
  s.append(b, 4);
}

class Gen {
 public:
  explicit Gen(uint32_t seed) : rng_(seed) {}
  uint32_t Bits(int n) { return static_cast<uint32_t>(rng_()) & ((1u << n) - 1); }
  int Range(int lo, int hi) { return lo + static_cast<int>(rng_() % static_cast<uint32_t>(hi - lo + 1)); }

  // Magnitudes 2^-7 .. 2^2 with random mantissas and signs.
  uint16_t Bf16() { return static_cast<uint16_t>((Bits(1) << 15) | (Range(120, 129) << 7) | Bits(7)); }
  uint16_t Fp16() { return static_cast<uint16_t>((Bits(1) << 15) | (Range(8, 17) << 10) | Bits(10)); }
  // Any e4m3 code but zero and NaN, subnormals included.
  uint8_t E4m3() {
    uint8_t c;
    do {
      c = static_cast<uint8_t>(Bits(8));
    } while ((c & 0x7f) == 0 || (c & 0x7f) == 0x7f);
    return c;
  }
  // Block multipliers 2^-9 .. 2^-3 with random mantissas, as real checkpoints have.
  float Scale() {
    const uint32_t bits = (static_cast<uint32_t>(Range(118, 124)) << 23) | Bits(23);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }

 private:
  std::mt19937 rng_;
};

RawTensor Half(Gen& g, bool bf16, const std::string& name, std::vector<int64_t> shape) {
  RawTensor t{name, bf16 ? "BF16" : "F16", shape, {}};
  for (int64_t i = 0; i < Product(shape); ++i) Put16(t.bytes, bf16 ? g.Bf16() : g.Fp16());
  return t;
}

}  // namespace

std::string SafetensorsBytesFromHeader(const std::string& header_json, const std::string& data) {
  std::string out;
  const uint64_t n = header_json.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + header_json + data;
}

std::string SafetensorsBytes(const std::vector<RawTensor>& tensors) {
  std::string header = "{\"__metadata__\":{\"format\":\"pt\"}";
  std::string data;
  for (const RawTensor& t : tensors) {
    const uint64_t begin = data.size();
    data += t.bytes;
    absl::StrAppend(&header, ",\"", t.name, "\":{\"dtype\":\"", t.dtype, "\",\"shape\":[",
                    absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", begin, ",", data.size(), "]}");
  }
  header += "}";
  while (header.size() % 8 != 0) header += " ";
  return SafetensorsBytesFromHeader(header, data);
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::abort();
  }
}

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(base != nullptr ? base : "/tmp", "/", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

const RawTensor& TinyModel::Get(const std::string& name) const {
  for (const RawTensor& t : tensors) {
    if (t.name == name) return t;
  }
  std::fprintf(stderr, "TinyModel has no tensor %s\n", name.c_str());
  std::abort();
}

RawTensor& TinyModel::Mutable(const std::string& name) { return const_cast<RawTensor&>(Get(name)); }

void TinyModel::Remove(const std::string& name) {
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    if (it->name == name) {
      tensors.erase(it);
      return;
    }
  }
}

std::string ConfigJson(const TinyModelSpec& s) {
  const char* dtype = s.format == WeightFormat::kFP16 ? "float16" : "bfloat16";
  std::string j = absl::StrCat(
      "{\n  \"architectures\": [\"DeepseekV3ForCausalLM\"],\n  \"model_type\": \"deepseek_v3\",\n",
      "  \"hidden_size\": ", s.hidden_size, ",\n  \"num_attention_heads\": ", s.num_heads,
      ",\n  \"num_key_value_heads\": ", s.num_heads, ",\n  \"q_lora_rank\": ",
      s.q_lora ? absl::StrCat(s.q_lora_rank) : std::string("null"), ",\n  \"kv_lora_rank\": ", s.kv_lora_rank,
      ",\n  \"qk_nope_head_dim\": ", s.qk_nope_head_dim, ",\n  \"qk_rope_head_dim\": ", s.qk_rope_head_dim,
      ",\n  \"v_head_dim\": ", s.v_head_dim, ",\n  \"num_hidden_layers\": ", s.num_layers,
      ",\n  \"rms_norm_eps\": 1e-06,\n  \"rope_theta\": 10000,\n  \"vocab_size\": 8,\n  \"torch_dtype\": \"", dtype,
      "\"");
  if (s.yarn) {
    j += ",\n  \"rope_scaling\": {\"beta_fast\": 32, \"beta_slow\": 1, \"factor\": 40, \"mscale\": 1.0, "
         "\"mscale_all_dim\": 1.0, \"original_max_position_embeddings\": 4096, \"type\": \"yarn\"}";
  } else {
    j += ",\n  \"rope_scaling\": null";
  }
  if (s.format == WeightFormat::kFP8) {
    j += ",\n  \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", "
         "\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}";
  }
  return j + "\n}\n";
}

TinyModel MakeTinyModel(const TinyModelSpec& s) {
  TinyModel m;
  m.spec = s;
  m.config_json = ConfigJson(s);
  Gen g(s.seed);
  const bool bf16 = s.format != WeightFormat::kFP16;
  const int64_t H = s.hidden_size, h = s.num_heads, qk = s.qk_nope_head_dim + s.qk_rope_head_dim;
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols) {
    if (s.format != WeightFormat::kFP8) {
      m.tensors.push_back(Half(g, bf16, name, {rows, cols}));
      return;
    }
    RawTensor w{name, "F8_E4M3", {rows, cols}, {}};
    for (int64_t i = 0; i < rows * cols; ++i) w.bytes.push_back(static_cast<char>(g.E4m3()));
    m.tensors.push_back(std::move(w));
    RawTensor sc{name + "_scale_inv", "F32", {(rows + 127) / 128, (cols + 127) / 128}, {}};
    for (int64_t i = 0; i < Product(sc.shape); ++i) PutF32(sc.bytes, g.Scale());
    m.tensors.push_back(std::move(sc));
  };
  m.tensors.push_back(Half(g, bf16, "model.embed_tokens.weight", {8, H}));
  for (int l = 0; l < s.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".self_attn.");
    if (s.q_lora) {
      matrix(p + "q_a_proj.weight", s.q_lora_rank, H);
      m.tensors.push_back(Half(g, bf16, p + "q_a_layernorm.weight", {s.q_lora_rank}));
      matrix(p + "q_b_proj.weight", h * qk, s.q_lora_rank);
    } else {
      matrix(p + "q_proj.weight", h * qk, H);
    }
    matrix(p + "kv_a_proj_with_mqa.weight", s.kv_lora_rank + s.qk_rope_head_dim, H);
    m.tensors.push_back(Half(g, bf16, p + "kv_a_layernorm.weight", {s.kv_lora_rank}));
    matrix(p + "kv_b_proj.weight", h * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank);
    matrix(p + "o_proj.weight", H, h * s.v_head_dim);
    m.tensors.push_back(Half(g, bf16, absl::StrCat("model.layers.", l, ".input_layernorm.weight"), {H}));
  }
  m.tensors.push_back(Half(g, bf16, "model.norm.weight", {H}));
  return m;
}

void WriteTinyModel(const TinyModel& model, const std::string& dir, int num_files, bool index) {
  WriteFile(dir + "/config.json", model.config_json);
  std::vector<std::vector<RawTensor>> files(static_cast<size_t>(num_files));
  std::vector<std::string> names;
  for (int i = 0; i < num_files; ++i) {
    names.push_back(absl::StrCat("model-", absl::Dec(i + 1, absl::kZeroPad5), "-of-",
                                 absl::Dec(num_files, absl::kZeroPad5), ".safetensors"));
  }
  std::string weight_map;
  size_t total = 0;
  for (size_t i = 0; i < model.tensors.size(); ++i) {
    const size_t f = i % files.size();
    files[f].push_back(model.tensors[i]);
    total += model.tensors[i].bytes.size();
    absl::StrAppend(&weight_map, weight_map.empty() ? "" : ",\n", "    \"", model.tensors[i].name, "\": \"",
                    names[f], "\"");
  }
  for (size_t f = 0; f < files.size(); ++f) WriteFile(dir + "/" + names[f], SafetensorsBytes(files[f]));
  if (index) {
    WriteFile(dir + "/model.safetensors.index.json",
              absl::StrCat("{\n  \"metadata\": {\"total_size\": ", total, "},\n  \"weight_map\": {\n", weight_map,
                           "\n  }\n}\n"));
  }
}

}  // namespace latentd::engine::model::testing
