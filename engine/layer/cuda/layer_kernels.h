// The small elementwise kernels of the MLA layer's CUDA math (CudaLayerMath) between its
// cuBLAS GEMMs: RMSNorm with Hugging Face's two roundings and RoPE from a device copy of the
// Rope table, both bit for bit CpuLayerMath's arithmetic. Plain C++ header.
#pragma once

#include <cstdint>

#include "kernels/params.h"

typedef struct CUstream_st* cudaStream_t;

namespace latentd::engine::layer {

// A device copy of a Rope's table (rope.h) for qk_rope_head_dim 64: cos and sin
// [max_positions, 32] float32, the attention factor included.
struct DeviceRopeTable {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int max_positions = 0;
  bool interleave = true;  // rope_interleave: pairs (x0, x1), (x2, x3), ... in, de-interleaved out
};

// RMSNorm in place over n rows of `width` model-dtype values (row t at v + t * stride), as
// CpuLayerMath does it: the sum of squares in double, x * (1 / sqrt(mean + eps)) in float32
// rounded to the dtype, then weight * that rounded again. Every float32 operation is
// IEEE-rounded on its own (no contraction into FMA), in CpuLayerMath's order.
// Returns a cudaError_t value (0 = success); n == 0 launches nothing.
int LaunchRmsNorm(kernels::DType dtype, uint16_t* v, int n, int width, int64_t stride, const uint16_t* weight,
                  float eps, cudaStream_t stream);

// RoPE of n x heads vectors of 64 model-dtype values: token t, head j reads
// src + t * src_token_stride + j * src_head_stride and writes the rotated, once-rounded
// values to dst + t * dst_token_stride + j * dst_head_stride (src == dst is allowed).
// positions is a device array of n int32. A position outside [0, max_positions) is the
// caller's error: the table is not read for it and its token's vectors become NaN.
// Returns a cudaError_t value.
int LaunchRope(kernels::DType dtype, const uint16_t* src, int64_t src_token_stride, int64_t src_head_stride,
               uint16_t* dst, int64_t dst_token_stride, int64_t dst_head_stride, int n, int heads,
               const int32_t* positions, const DeviceRopeTable& table, cudaStream_t stream);

// Latent rows in place, one launch: rows [n, 576] hold kv_a_proj_with_mqa's rounded output;
// the first 512 values of each row get RMSNorm with `weight` (kv_a_layernorm), the last 64
// RoPE at positions[t] (NaN outside the table, as LaunchRope). Returns a cudaError_t value.
int LaunchLatentNormRope(kernels::DType dtype, uint16_t* rows, int n, const uint16_t* weight, float eps,
                         const int32_t* positions, const DeviceRopeTable& table, cudaStream_t stream);

}  // namespace latentd::engine::layer
