// Internal interface between the host side (kernels/mla_decode_cuda.cu) and the kernel
// instantiations (one .cu per dtype and tile). Not part of the public API.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/params.h"

namespace latentd::kernels::sm80 {

// Everything one decode launch needs, passed by value as the kernel parameter.
struct DecodeArgs {
  MlaDecodeParams p;       // device pointers
  int keys_per_split = 0;  // multiple of 32 (whole KV tiles)
  int num_splits = 1;      // grid.y
  int row_tiles = 1;       // grid.x
  float* o_part = nullptr;    // [b, num_splits, h_q * s_q, 512] fp32 partial outputs
  float* lse_part = nullptr;  // [b, num_splits, h_q * s_q] fp32 partial LSEs
};

// Kernel handle of one (dtype, tile, KV cache dtype, FP8 pipeline, plan, P rounding)
// instantiation: explicit instantiations live in
// kernels/sm80/decode_<dtype>_m<rows>[_fp8kv[_regs]][_sm80][_p_once].cu.
// kRegs: the FP8 cache converted in registers (Fp8Pipeline::kRegisters, the 16-row
// tile); kSm80Plan: the 64-row tile's plan for A100-class GPUs (SmemPlan::kA100, traits.h);
// kPRounding: how bf16 P is rounded for the PV mma (fp16 instantiations: kSplit only,
// which for fp16 means one rounding).
template <DType kDType, int kRows, KvDType kKv = KvDType::kModel, bool kRegs = false, bool kSm80Plan = false,
          PRounding kPRounding = PRounding::kSplit>
struct Decoder {
  static const void* Kernel();
  static int SmemBytes();
  // Raises the kernel's dynamic shared-memory limit on the current device (once per device).
  static cudaError_t Prepare();
  static cudaError_t Launch(const DecodeArgs& args, cudaStream_t stream);
};

// Combine kernel (kernels/combine/): merges the partitions of each sequence that has
// more than one; sequences with one partition were written by the decode kernel.
struct CombineArgs {
  MlaDecodeParams p;
  int keys_per_split = 0;
  int num_splits = 1;
  const float* o_part = nullptr;
  const float* lse_part = nullptr;
};
cudaError_t LaunchCombineKernel(const CombineArgs& args, cudaStream_t stream);

}  // namespace latentd::kernels::sm80
