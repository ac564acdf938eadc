// The MLA attention weights of every layer, read from a checkpoint into host memory in
// the model dtype: shapes checked against config.json, FP8 block-quantized weights
// dequantized, and a tensor-parallel rank's slice of the heads cut out at load.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/model/config.h"
#include "engine/model/safetensors.h"
#include "kernels/params.h"

namespace latentd::engine::model {

// Rank `rank` of `size` holds heads [rank * h / size, (rank + 1) * h / size).
struct TensorParallel {
  int size = 1;
  int rank = 0;
};

// One weight, row-major 16-bit values of the model dtype (bf16 or fp16 bits).
struct HostTensor {
  std::string name;            // the checkpoint's name for it
  std::vector<int64_t> shape;  // this rank's slice: [rows, cols] or [n]
  std::vector<uint16_t> values;

  int64_t bytes() const { return static_cast<int64_t>(values.size() * sizeof(uint16_t)); }
};

// model.layers.N.self_attn.*.weight. With q_lora_rank set, q_a_proj, q_a_layernorm and
// q_b_proj are loaded and q_proj is empty; with it null, the reverse. Shapes for h heads
// on this rank, nope/rope/v the head dims, H hidden_size, r_q q_lora_rank, r_kv kv_lora_rank:
//   q_a_proj [r_q, H], q_a_layernorm [r_q], q_b_proj [h * (nope + rope), r_q],
//   q_proj [h * (nope + rope), H], kv_a_proj_with_mqa [r_kv + rope, H],
//   kv_a_layernorm [r_kv], kv_b_proj [h * (nope + v), r_kv], o_proj [H, h * v].
struct AttentionLayerWeights {
  int layer = 0;
  HostTensor q_a_proj;
  HostTensor q_a_layernorm;
  HostTensor q_b_proj;
  HostTensor q_proj;
  HostTensor kv_a_proj_with_mqa;
  HostTensor kv_a_layernorm;
  HostTensor kv_b_proj;
  HostTensor o_proj;

  int64_t bytes() const;
};

struct AttentionWeights {
  kernels::DType dtype = kernels::DType::kBF16;
  TensorParallel tensor_parallel;
  int num_heads = 0;  // this rank's
  std::vector<AttentionLayerWeights> layers;  // num_hidden_layers of them

  // Host bytes the weights hold.
  int64_t bytes() const;
};

// INVALID_ARGUMENT unless 1 <= size, 0 <= rank < size and size divides num_attention_heads.
absl::Status ValidateTensorParallel(const ModelConfig& config, TensorParallel tp);

// One layer (for loading layer by layer, so the host never holds the whole model). Every
// error names the file, the tensor and what was expected: a missing tensor, a shape
// other than config.json's, a dtype other than BF16, F16, F32 or F8_E4M3 (the last with
// its `<name>_scale_inv` float32 [ceil(rows / block), ceil(cols / block)]), or a value
// that is not finite in the model dtype.
absl::StatusOr<AttentionLayerWeights> LoadAttentionLayer(const Checkpoint& checkpoint, const ModelConfig& config,
                                                         int layer, TensorParallel tp = {});

// Every layer, 0 .. num_hidden_layers - 1 (later layers in the files, such as DeepSeek-V3's
// multi-token-prediction layer, are not read).
absl::StatusOr<AttentionWeights> LoadAttentionWeights(const Checkpoint& checkpoint, const ModelConfig& config,
                                                      TensorParallel tp = {});

}  // namespace latentd::engine::model
