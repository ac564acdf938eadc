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
#include "engine/types.h"

namespace latentd::engine {

class AttentionBackend;

// Two implementations: on the CPU backend the layer math runs on the host (engine/layer's
// CpuLayerMath on OpenBLAS) and the queries and rows it makes are host tensors the backend
// stages like a client's; on the CUDA backend it runs on the device (CudaLayerMath on
// cuBLAS) on the backend's compute stream, and the queries, rows and latent outputs stay
// in device memory. Prepare, AfterLaunch and Complete belong to the scheduler thread;
// Rows may be called from any. Buffers for two batches (the scheduler's double buffer)
// are sized once from max_batch_tokens, so a batch allocates nothing.
class LayerStage {
 public:
  virtual ~LayerStage() = default;

  // INVALID_ARGUMENT naming the field when the weights do not match options.model
  // (layers, heads, dtype, h_kv 1) or the layer math refuses them; on_device: the CUDA
  // math (its weights take device memory before the KV pool is sized), else the host's.
  static absl::StatusOr<std::unique_ptr<LayerStage>> Create(const EngineOptions& options, bool on_device);

  int hidden_size() const { return hidden_; }
  int max_positions() const { return max_positions_; }
  // Bytes the weights take where the math holds them (host float32, or device).
  int64_t weight_bytes() const { return weight_bytes_; }

  // Once the backend exists: the CUDA stage queues its work on the backend's streams.
  virtual absl::Status Attach(AttentionBackend* backend) { return absl::OkStatus(); }

  // Every OK layer entry of the batch (position set): computes q and the new rows, one
  // GEMM per projection and layer over the batch's tokens, and points the step's q, kv,
  // out and lse at this stage's buffers for batch.slot. A failure marks the entries of
  // that layer.
  virtual void Prepare(Batch& batch) = 0;
  // After the backend's Launch: work queued behind the batch's attention (the CUDA
  // stage's output projections).
  virtual void AfterLaunch(Batch& batch) {}
  // After the backend's Finish: each OK layer entry's output into step->layer_out, and
  // every layer step's q, kv, out and lse unset again.
  virtual void Complete(Batch& batch) = 0;

  // The latent rows [n, 576] of n hidden states [n, hidden_size] (model dtype bytes) at
  // positions first .. first + n - 1, for an upload of hidden states. Thread-safe.
  virtual absl::StatusOr<std::string> Rows(int layer, absl::string_view hidden, int64_t first) = 0;

 protected:
  LayerStage() = default;
  // The checks and sizes both implementations share; fills the fields below.
  absl::Status Init(const EngineOptions& options);

  int hidden_ = 0, heads_ = 0, max_positions_ = 0;
  int64_t weight_bytes_ = 0;
};

// The batch's OK layer entries, by layer (ties by index, so the sort needs no buffer),
// into *order (reserved for max_batch_size).
void CollectLayerEntries(const Batch& batch, std::vector<int>* order);

// Calls run(layer, a, b, first_token, tokens) for each run order[a, b) of one layer, its
// tokens numbered in order from 0: one GEMM per projection and run.
template <typename Run>
void ForEachLayerRun(const Batch& batch, const std::vector<int>& order, Run run) {
  int token = 0;
  for (size_t a = 0; a < order.size();) {
    const int layer = batch.entries[order[a]].step->layer;
    const int first = token;
    size_t b = a;
    for (; b < order.size() && batch.entries[order[b]].step->layer == layer; ++b) token += batch.entries[order[b]].step->s_q;
    run(layer, a, b, first, token - first);
    a = b;
  }
}

// Gives every layer step of the batch its q, kv, out and lse back unset (Complete's end).
void UnsetLayerTensors(Batch& batch);

// Defined in layer_stage_cuda.cc when built with CUDA; elsewhere UNIMPLEMENTED.
absl::StatusOr<std::unique_ptr<LayerStage>> MakeCudaLayerStage(const EngineOptions& options);

}  // namespace latentd::engine
