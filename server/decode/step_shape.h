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

  static StepShape For(const engine::ModelConfig& model, int max_s_q);
};

}  // namespace latentd::server::decode
