// The fixed per-model byte sizes a Decode stream checks and lays out steps with,
// computed once per service from the engine's model and the daemon's --max_s_q.
#pragma once

#include <cstdint>

#include "engine/types.h"

namespace latentd::server::decode {

struct StepShape {
  int num_layers = 0, h_q = 0, h_kv = 0, max_s_q = 0;
  int64_t q_row_bytes = 0;    // per query token: h_q * 576 * 2
  int64_t kv_row_bytes = 0;   // per token: h_kv * 576 * 2
  int64_t out_row_bytes = 0;  // per query token: h_q * 512 * 2
  int64_t lse_row_bytes = 0;  // per query token: h_q * 4
  // The layer API (engine::EngineInfo::layer_api): a layer step's hidden state and
  // output per token, hidden_size * 2; 0 without it.
  int64_t hidden_row_bytes = 0;
  int64_t max_positions = 0;

  static StepShape For(const engine::ModelConfig& model, int max_s_q);
  // With the layer API's sizes from the engine's info.
  static StepShape For(const engine::EngineInfo& info, int max_s_q);
};

// A step's result per query token: a layer step's output is [hidden_size], a kernel
// step's out [h_q, 512] and lse [h_q].
inline int64_t OutRowBytes(const StepShape& sh, bool layer_step) {
  return layer_step ? sh.hidden_row_bytes : sh.out_row_bytes;
}
inline int64_t LseRowBytes(const StepShape& sh, bool layer_step) { return layer_step ? 0 : sh.lse_row_bytes; }

}  // namespace latentd::server::decode
