// The attention layer around the decode kernel for layer steps (DecodeStep::hidden):
// before a batch is staged, its hidden states become queries and latent rows; after it
// finished, the kernel's latent output becomes the layer's output. docs/mla-layer-server.md.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/batch.h"
#include "engine/layer/layer_math.h"
#include "engine/types.h"

namespace latentd::engine {

// Runs on the host (engine/layer's CpuLayerMath on OpenBLAS) for either backend: the
// queries and rows it makes are plain host tensors the backend stages like a client's.
// Prepare and Complete belong to the scheduler thread; Rows may be called from any.
// Buffers for two batches (the scheduler's double buffer) are sized once from
// max_batch_tokens, so a batch allocates nothing.
class LayerStage {
 public:
  // INVALID_ARGUMENT naming the field when the weights do not match options.model
  // (layers, heads, dtype, h_kv 1) or the layer math refuses them.
  static absl::StatusOr<std::unique_ptr<LayerStage>> Create(const EngineOptions& options);

  int hidden_size() const { return hidden_; }
  int max_positions() const { return max_positions_; }
  int64_t weight_bytes() const { return weight_bytes_; }

  // Every OK layer entry of the batch (position set): computes q and the new rows, one
  // GEMM per projection and layer over the batch's tokens, and points the step's q, kv,
  // out and lse at this stage's buffers for batch.slot. A failure marks the entries of
  // that layer.
  void Prepare(Batch& batch);
  // After the backend's Finish: each OK layer entry's output into step->layer_out, and
  // every layer step's q, kv, out and lse unset again.
  void Complete(Batch& batch);

  // The latent rows [n, 576] of n hidden states [n, hidden_size] (model dtype bytes) at
  // positions first .. first + n - 1, for an upload of hidden states. Thread-safe.
  absl::StatusOr<std::string> Rows(int layer, absl::string_view hidden, int64_t first) const;

 private:
  LayerStage() = default;

  struct Slot {
    std::vector<int> order;          // the batch's layer entries, by layer
    std::vector<uint16_t> x, out;    // [tokens, hidden]
    std::vector<int64_t> positions;  // [tokens]
    std::vector<uint16_t> q;         // [tokens, h, 576]
    std::vector<uint16_t> rows;      // [tokens, 576]
    std::vector<uint16_t> latent;    // [tokens, h, 512]
    std::vector<float> lse;          // [tokens, h]
  };

  int hidden_ = 0, heads_ = 0, max_positions_ = 0;
  int64_t weight_bytes_ = 0;
  std::vector<std::unique_ptr<layer::CpuLayerMath>> math_;  // per layer, the scheduler's
  Slot slots_[2];
};

}  // namespace latentd::engine
