// Test-only: writes safetensors files (well-formed or with a given header) and tiny random
// MLA checkpoints (config.json, weights in bf16, fp16 or FP8 block-quantized form, split
// over several files with or without an index). Plain string building, independent of
// the reader under test.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace latentd::engine::model::testing {

struct RawTensor {
  std::string name;
  std::string dtype;  // as the header spells it: "BF16", "F8_E4M3", ...
  std::vector<int64_t> shape;
  std::string bytes;  // little-endian values, row-major
};

// A well-formed file: the header lists the tensors in order with contiguous offsets,
// padded with spaces to a multiple of 8 bytes.
std::string SafetensorsBytes(const std::vector<RawTensor>& tensors);

// A file from a given header text and data section (for malformed headers).
std::string SafetensorsBytesFromHeader(const std::string& header_json, const std::string& data);

void WriteFile(const std::string& path, const std::string& bytes);

// A fresh, empty folder under the test's temporary directory.
std::string TempDir(const std::string& name);

enum class WeightFormat { kBF16, kFP16, kFP8 };

struct TinyModelSpec {
  WeightFormat format = WeightFormat::kBF16;
  bool q_lora = true;  // false: q_lora_rank null and a plain q_proj
  bool yarn = true;
  int num_layers = 2;
  uint32_t seed = 1;
  // Widths above 128 in several weights, so FP8 blocks include partial ones.
  int hidden_size = 200;
  int num_heads = 4;
  int q_lora_rank = 136;
  int kv_lora_rank = 144;
  int qk_nope_head_dim = 16;
  int qk_rope_head_dim = 8;
  int v_head_dim = 16;
};

struct TinyModel {
  TinyModelSpec spec;
  std::string config_json;
  // Attention weights (with *_scale_inv for FP8) and a few unrelated tensors.
  std::vector<RawTensor> tensors;

  const RawTensor& Get(const std::string& name) const;  // aborts when absent
  RawTensor& Mutable(const std::string& name);
  void Remove(const std::string& name);
};

// config.json for a spec.
std::string ConfigJson(const TinyModelSpec& spec);

// Random weights, never zero, NaN or infinite.
TinyModel MakeTinyModel(const TinyModelSpec& spec);

// config.json plus the tensors spread over `num_files` files (model-0000i-of-0000n), and
// with `index` a model.safetensors.index.json naming each tensor's file.
void WriteTinyModel(const TinyModel& model, const std::string& dir, int num_files, bool index);

}  // namespace latentd::engine::model::testing
