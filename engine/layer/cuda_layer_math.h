// The MLA attention layer's math around the decode kernel on a CUDA device: CpuLayerMath's
// projections as cuBLAS GEMMs in the model dtype, with its rounding points, on device
// pointers and a caller's stream (docs/mla-layer-server.md, "The CUDA path").
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/layer/cuda/layer_kernels.h"
#include "engine/layer/layer_config.h"
#include "engine/layer/rope.h"
#include "engine/model/config.h"
#include "engine/model/weights.h"
#include "kernels/params.h"

typedef struct CUstream_st* cudaStream_t;
struct cublasContext;

namespace latentd::engine::layer {

// A cuBLAS handle on one device with a workspace of its own, set at creation, so that GEMMs
// never allocate. Any number of CudaLayerMath objects (a model's layers) may share one, from
// one host thread at a time. The workspace is one buffer: calls that use the handle on
// different streams must not overlap on the device (order the streams with events, or give
// each stream a handle of its own).
class CublasHandle {
 public:
  // NVIDIA's recommendation for Hopper (4 MiB suffices before it).
  static constexpr int64_t kDefaultWorkspaceBytes = int64_t{32} << 20;

  // INVALID_ARGUMENT for a device that does not exist or a negative workspace size;
  // INTERNAL naming the CUDA or cuBLAS call that failed.
  static absl::StatusOr<std::shared_ptr<CublasHandle>> Create(int device,
                                                              int64_t workspace_bytes = kDefaultWorkspaceBytes);
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;

  int device() const { return device_; }
  int64_t workspace_bytes() const { return workspace_bytes_; }

  // Points the handle at `stream`, with its workspace (cublasSetStream resets the workspace
  // to cuBLAS's own pool, which could allocate, so it is set again). Host-only, no sync. The
  // device must be current.
  absl::Status Bind(cudaStream_t stream);
  cublasContext* get() const { return handle_; }

 private:
  CublasHandle() = default;

  int device_ = 0;
  cublasContext* handle_ = nullptr;
  void* workspace_ = nullptr;
  int64_t workspace_bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  bool bound_ = false;
};

// A device copy of one Rope table (rope.h), which every layer of a model can share: they all
// rotate alike. Immutable after Create.
class CudaRopeTable {
 public:
  // Rope::Create's INVALID_ARGUMENT errors; INVALID_ARGUMENT naming qk_rope_head_dim (other
  // than 64) or device; RESOURCE_EXHAUSTED or INTERNAL from CUDA.
  static absl::StatusOr<std::shared_ptr<const CudaRopeTable>> Create(const RopeConfig& config, int max_positions,
                                                                     int device);
  ~CudaRopeTable();
  CudaRopeTable(const CudaRopeTable&) = delete;
  CudaRopeTable& operator=(const CudaRopeTable&) = delete;

  const DeviceRopeTable& table() const { return table_; }
  const RopeConfig& config() const { return config_; }
  int max_positions() const { return table_.max_positions; }
  int device() const { return device_; }
  // cos and sin, [max_positions, 32] float32 each: 42 MB at DeepSeek-V3's 163840 positions.
  int64_t device_bytes() const { return device_bytes_; }
  // Whether this table is the one Rope::Create(config, max_positions) makes.
  bool Matches(const RopeConfig& config, int max_positions) const;

 private:
  CudaRopeTable() = default;

  RopeConfig config_;
  DeviceRopeTable table_;
  int device_ = 0;
  void* memory_ = nullptr;
  int64_t device_bytes_ = 0;
};

// One layer's projections on one device. Weights are copied to the device once at Create in
// the model dtype (bf16/fp16 as the checkpoint has them; kv_b_proj stays whole and W_UK /
// W_UV are strided views of it), with scratch for up to max_tokens tokens and a device copy
// of the Rope table (its own, or one the model's layers share); a call allocates nothing and never synchronizes: it enqueues cuBLAS
// GEMMs (fp32 accumulation, CUBLAS_COMPUTE_32F, output written in the model dtype, so the
// GEMM's epilogue is the rounding after each Linear) and a few small kernels on `stream`,
// and returns. Every tensor is a device pointer, row-major, in the model dtype.
//
// The values are CpuLayerMath's: the same rounding points (after each Linear, twice in each
// RMSNorm, after RoPE, the absorbed query, after W_UV), and RMSNorm and RoPE in the same
// float32 operations in the same order, so they differ only where a GEMM's summation order
// moves a rounding (a unit in the last place here and there).
//
// Positions are device int32 values the host never sees: one outside [0, max_positions) is the
// caller's error, and makes that token's 64 rope values NaN (in q, every head's) instead of
// reading outside the table. A call's errors are INVALID_ARGUMENT for its arguments (n
// outside [1, max_tokens], a null pointer) and INTERNAL naming the failed cuBLAS call or
// kernel launch; faults during execution show up on the stream, as for any kernel.
//
// Not thread-safe: one call at a time per object (and per shared CublasHandle). The scratch
// is reused by the next call, so two calls on different streams must not overlap on the
// device either. The device of Create is made current for the call and restored afterwards.
class CudaLayerMath {
 public:
  // What the layers of one model on one device can share; a null member gets one of its own.
  struct Shared {
    std::shared_ptr<CublasHandle> blas;
    std::shared_ptr<const CudaRopeTable> rope;
  };

  // CpuLayerMath::Create's INVALID_ARGUMENT errors (layer_config.h, Rope::Create), and
  // INVALID_ARGUMENT naming max_tokens (outside [1, 65536]), device (no such device), blas (on
  // another device) or rope (on another device, or not this config's table for
  // max_positions); RESOURCE_EXHAUSTED when device memory runs out; INTERNAL naming a failed
  // CUDA or cuBLAS call. Weights are copied with synchronous cudaMemcpy from pageable memory.
  static absl::StatusOr<std::unique_ptr<CudaLayerMath>> Create(const model::ModelConfig& config,
                                                               const model::AttentionLayerWeights& weights,
                                                               const LayerMathOptions& options, int max_tokens,
                                                               int device, Shared shared = {});
  ~CudaLayerMath();
  CudaLayerMath(const CudaLayerMath&) = delete;
  CudaLayerMath& operator=(const CudaLayerMath&) = delete;

  static constexpr int kMaxTokens = 65536;

  int hidden_size() const { return hidden_; }
  int num_heads() const { return heads_; }
  int max_tokens() const { return max_tokens_; }
  int max_positions() const { return rope_->max_positions(); }
  int device() const { return device_; }
  kernels::DType dtype() const { return dtype_; }
  const std::shared_ptr<CublasHandle>& blas() const { return blas_; }
  const std::shared_ptr<const CudaRopeTable>& rope() const { return rope_; }

  // Device memory this layer uses: weights + rope table + scratch. The rope table counts in
  // full even when shared (rope()->device_bytes() of it); the CublasHandle's workspace does
  // not count (blas()->workspace_bytes()).
  int64_t device_bytes() const { return arena_bytes_ + rope_->device_bytes(); }
  // The weights alone, every byte of which each set of calls reads once (Queries reads q_a_proj,
  // q_b_proj or q_proj and W_UK; LatentRows kv_a_proj_with_mqa; Output W_UV and o_proj).
  int64_t weight_bytes() const { return weight_bytes_; }

  // x [n, hidden] -> q [n, h, 576]: per head [q_nope . W_UK (512) | RoPE(q_pe) (64)].
  absl::Status Queries(const uint16_t* x, const int32_t* positions, int n, uint16_t* q, cudaStream_t stream);
  // x [n, hidden] -> rows [n, 576]: [kv_a_layernorm(c) (512) | RoPE(k_pe) (64)].
  absl::Status LatentRows(const uint16_t* x, const int32_t* positions, int n, uint16_t* rows, cudaStream_t stream);
  // latent_out [n, h, 512] -> out [n, hidden]: o_proj(concat over heads of latent_out_h . W_UV_h^T).
  absl::Status Output(const uint16_t* latent_out, int n, uint16_t* out, cudaStream_t stream);
  // The same with o_proj's output left in float32 (a tensor-parallel rank's partial sum, to be
  // added to the others' before the one rounding), as CpuLayerMath::OutputFloat.
  absl::Status OutputFloat(const uint16_t* latent_out, int n, float* out, cudaStream_t stream);

 private:
  // A row-major model-dtype weight [rows, cols] in device memory.
  struct Matrix {
    const uint16_t* data = nullptr;
    int rows = 0;
    int cols = 0;
  };

  CudaLayerMath() = default;

  absl::Status CheckCall(int n, const void* a, const char* a_name, const void* b, const char* b_name, const void* c,
                         const char* c_name) const;
  // y [n, w.rows] = x [n, w.cols] . w^T, written in the model dtype (or float32).
  absl::Status Linear(const uint16_t* x, int n, const Matrix& w, void* y, bool float_out) const;
  absl::Status OutputInto(const uint16_t* latent_out, int n, void* out, bool float_out, cudaStream_t stream);

  kernels::DType dtype_ = kernels::DType::kBF16;
  int device_ = 0;
  int hidden_ = 0, heads_ = 0, q_rank_ = 0, nope_ = 0, v_dim_ = 0, max_tokens_ = 0;
  float eps_ = 0;
  bool has_q_lora_ = false;
  std::shared_ptr<CublasHandle> blas_;
  std::shared_ptr<const CudaRopeTable> rope_;

  void* arena_ = nullptr;  // one cudaMalloc holding the weights and the scratch below
  int64_t arena_bytes_ = 0, weight_bytes_ = 0;
  Matrix q_a_, q_b_, q_proj_, kv_a_, o_proj_;
  const uint16_t* q_a_norm_ = nullptr;   // [q_lora_rank]
  const uint16_t* kv_a_norm_ = nullptr;  // [512]
  const uint16_t* kv_b_ = nullptr;       // [h * (nope + v), 512]: per head W_UK's nope rows, then W_UV's v rows

  // Scratch for max_tokens tokens, model dtype.
  uint16_t* q_a_out_ = nullptr;  // [n, q_lora_rank]
  uint16_t* q_full_ = nullptr;   // [n, h * (nope + 64)]
  uint16_t* o_ = nullptr;        // [n, h * v]
};

}  // namespace latentd::engine::layer
