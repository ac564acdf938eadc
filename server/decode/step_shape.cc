// StepShape from the model: 16-bit q, kv and out rows, fp32 lse.
#include "server/decode/step_shape.h"

#include "kernels/params.h"

namespace latentd::server::decode {

StepShape StepShape::For(const engine::ModelConfig& model, int max_s_q) {
  constexpr int64_t kDtypeBytes = 2;  // fp16 and bf16 alike
  StepShape s;
  s.num_layers = model.num_layers;
  s.h_q = model.num_heads_q;
  s.h_kv = model.num_heads_kv;
  s.max_s_q = max_s_q;
  s.q_row_bytes = int64_t{s.h_q} * kernels::kHeadDimQK * kDtypeBytes;
  s.kv_row_bytes = int64_t{s.h_kv} * kernels::kHeadDimQK * kDtypeBytes;
  s.out_row_bytes = int64_t{s.h_q} * kernels::kHeadDimV * kDtypeBytes;
  s.lse_row_bytes = int64_t{s.h_q} * static_cast<int64_t>(sizeof(float));
  return s;
}

StepShape StepShape::For(const engine::EngineInfo& info, int max_s_q) {
  StepShape s = For(info.model, max_s_q);
  if (info.layer_api) {
    s.hidden_row_bytes = int64_t{info.hidden_size} * 2;
    s.max_positions = info.max_positions;
  }
  return s;
}

}  // namespace latentd::server::decode
