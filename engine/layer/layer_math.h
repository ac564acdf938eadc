// The MLA attention layer's math around the decode kernel, on the CPU: from hidden states to the
// absorbed queries and the new latent rows the kernel reads, and from the kernel's latent
// output back to the layer's output (docs/mla-layer-server.md).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/layer/layer_config.h"
#include "engine/layer/rope.h"
#include "engine/model/config.h"
#include "engine/model/weights.h"
#include "kernels/params.h"

namespace latentd::engine::layer {

// One layer's projections in float32 through OpenBLAS's sgemm. The weights are converted to
// float32 once (twice the bytes of the checkpoint's bf16/fp16) and W_UK / W_UV are split out of
// kv_b_proj at construction; calls then reuse scratch buffers that only grow with the batch.
// Not thread-safe: one call at a time per object (sgemm itself runs on OpenBLAS's threads,
// OPENBLAS_NUM_THREADS of them); Clone() gives another thread its own object over the same
// weights.
//
// Every value crossing a call boundary is in the model dtype (bf16 or fp16 bits) except the
// float overloads' hidden states (used as given) and OutputFloat's result. Inside, values are
// rounded to the model dtype where Hugging Face's bf16/fp16 model rounds them: after each
// Linear (q_a_proj, q_b_proj or q_proj, kv_a_proj_with_mqa, o_proj), after RMSNorm's
// normalisation and again after its weight product, after RoPE (written back into a model-dtype
// tensor), and after the attention's value product (here W_UV applied to the latent output).
// The absorbed query q_nope . W_UK is rounded once more because the kernel reads model-dtype q;
// kv_b_proj's k_nope and v, which the model rounds, never exist in the absorbed form.
// OpenBLAS starts its worker threads when the library loads, before main() runs, so they
// keep the signal mask of that moment. A daemon that blocks signals in main() for a sigwait
// thread calls this afterwards: the pool is stopped and started again from the calling
// thread, whose mask the new workers inherit (otherwise a SIGTERM may be delivered to a
// BLAS worker and kill the process instead of starting a drain).
void RestartBlasThreads();

class CpuLayerMath {
 public:
  // INVALID_ARGUMENT naming the field: kv_lora_rank other than 512 or qk_rope_head_dim other
  // than 64 (the decode kernel's row), a non-positive dimension, num_heads outside
  // [1, num_attention_heads], max_positions outside [1, Rope::kMaxPositions], or a weight whose
  // shape or value count is not the one config.json implies for num_heads heads
  // (layer_config.h).
  static absl::StatusOr<std::unique_ptr<CpuLayerMath>> Create(const model::ModelConfig& config,
                                                              const model::AttentionLayerWeights& weights,
                                                              const LayerMathOptions& options);

  int hidden_size() const { return hidden_; }
  int num_heads() const { return heads_; }
  kernels::DType dtype() const { return dtype_; }
  const Rope& rope() const { return *rope_; }
  // Float32 bytes the weights take (shared by every clone).
  int64_t weight_bytes() const;

  // Another CpuLayerMath over the same weights and rotary table (shared, read-only) with
  // scratch of its own: one per thread that calls concurrently.
  std::unique_ptr<CpuLayerMath> Clone() const;
  // Uses `other`'s scratch from now on: for objects called one at a time (a model's
  // layers on one thread), which then hold one set of buffers between them. Both must
  // have the same shape.
  void ShareScratch(const CpuLayerMath& other);
  // Grows the scratch for calls of up to n tokens now, so that they allocate nothing.
  void Reserve(int n);

  // The decode kernel's queries for n = positions.size() tokens: x [n, hidden] -> q [n, h, 576],
  // per head [q_nope . W_UK (512) | RoPE(q_pe) (64)].
  absl::Status Queries(absl::Span<const uint16_t> x, absl::Span<const int64_t> positions, absl::Span<uint16_t> q);
  absl::Status Queries(absl::Span<const float> x, absl::Span<const int64_t> positions, absl::Span<uint16_t> q);

  // The latent rows to append to the KV cache: x [n, hidden] -> rows [n, 576],
  // [kv_a_layernorm(c) (512) | RoPE(k_pe) (64)].
  absl::Status LatentRows(absl::Span<const uint16_t> x, absl::Span<const int64_t> positions, absl::Span<uint16_t> rows);
  absl::Status LatentRows(absl::Span<const float> x, absl::Span<const int64_t> positions, absl::Span<uint16_t> rows);

  // The layer's output from the kernel's: latent_out [n, h, 512] -> out [n, hidden],
  // o_proj(concat over heads of latent_out_h . W_UV_h^T). With tensor parallelism this is the
  // rank's partial sum; OutputFloat leaves it unrounded so partials can be added first.
  absl::Status Output(int n, absl::Span<const uint16_t> latent_out, absl::Span<uint16_t> out);
  absl::Status OutputFloat(int n, absl::Span<const uint16_t> latent_out, absl::Span<float> out);

 private:
  // A row-major float32 weight [rows, cols].
  struct Matrix {
    int rows = 0;
    int cols = 0;
    std::vector<float> values;
  };

  // The weights, converted once and shared by clones.
  struct Weights {
    Matrix q_a, q_b, q_proj, kv_a, o_proj;
    std::vector<float> q_a_norm, kv_a_norm;
    std::vector<float> w_uk;  // [h, nope, 512]: kv_b_proj rows of each head's k_nope
    std::vector<float> w_uv;  // [h, v, 512]: kv_b_proj rows of each head's v
  };

  explicit CpuLayerMath(std::shared_ptr<const Rope> rope) : rope_(std::move(rope)) {}

  absl::Status CheckTokens(size_t x_size, absl::Span<const int64_t> positions, size_t out_size, size_t out_width,
                           const char* out_name) const;
  const float* HiddenAsFloat(absl::Span<const uint16_t> x);
  void QueriesFloat(const float* x, absl::Span<const int64_t> positions, uint16_t* q);
  void LatentRowsFloat(const float* x, absl::Span<const int64_t> positions, uint16_t* rows);
  absl::Status OutputInto(int n, absl::Span<const uint16_t> latent_out, size_t out_size, const char* out_name);

  // y [n, w.rows] = x [n, w.cols] . w^T, then rounded to the model dtype.
  void Linear(const float* x, int n, const Matrix& w, float* y) const;
  // RMSNorm over rows of `width` values (stride `stride`), in place, HF's two roundings.
  void RmsNorm(float* v, int n, int width, int64_t stride, const std::vector<float>& weight) const;
  void Round(float* v, size_t count) const;

  kernels::DType dtype_ = kernels::DType::kBF16;
  int hidden_ = 0, heads_ = 0, q_rank_ = 0, nope_ = 0, v_dim_ = 0;
  float eps_ = 0;
  bool has_q_lora_ = false;
  std::shared_ptr<const Rope> rope_;
  std::shared_ptr<const Weights> w_;

  // Scratch, grown to the largest batch seen (or reserved); layers called one after
  // another may share one (ShareScratch).
  struct Scratch {
    std::vector<float> x;        // [n, hidden] hidden states converted to float
    std::vector<float> q_a_out;  // [n, q_lora_rank]
    std::vector<float> q_full;   // [n, h * (nope + 64)]
    std::vector<float> q_out;    // [n, h * 576]
    std::vector<float> kv;       // [n, 576]
    std::vector<float> latent;   // [n, h * 512]
    std::vector<float> o;        // [n, h * v]
    std::vector<float> out;      // [n, hidden]
  };
  std::shared_ptr<Scratch> s_ = std::make_shared<Scratch>();
};

}  // namespace latentd::engine::layer
