// The SM80 MLA decode planner: which tile, shared-memory plan and FP8 pipeline a call
// runs and how its sequences are cut into split-K partitions, from a plain description
// of the device. Pure host code (no CUDA), so its rules run in CPU-only CI; QueryDevice
// (kernels/mla_decode_cuda.h) fills the description on a GPU host.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/params.h"

namespace latentd::kernels {

// SmemPlan and Fp8Pipeline (kernels/params.h): the plan a DecodePlan names.
const char* SmemPlanName(SmemPlan plan);
const char* Fp8PipelineName(Fp8Pipeline pipeline);

// One decode kernel as a device runs it (cudaFuncGetAttributes and the occupancy
// calculator), for the 16-bit cache (the planner's occupancy basis for both caches).
struct KernelResources {
  bool present = false;       // false: no machine code for this device, or its plan does not fit
  int threads = 0;            // per CTA
  int regs_per_thread = 0;
  int static_smem_bytes = 0;  // static shared memory, besides the plan's dynamic bytes
  int ctas_per_sm = 0;        // resident CTAs per SM with the plan's dynamic shared memory
};

// What the planner needs to know about a device. QueryDevice fills it once (CUDA calls);
// tests build it by hand.
struct DeviceInfo {
  int device = 0;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  int max_smem_per_sm = 0;           // bytes
  int max_smem_per_block_optin = 0;  // bytes
  int regs_per_sm = 0;
  int max_threads_per_sm = 0;
  char name[256] = {};
  // [dtype][tile: 16, 32, 64 rows]; the 64-row entry is of Tile64SmemPlan(*this)'s plan.
  KernelResources kernels[2][3];
};

// The 64-row tile's shared-memory plan for a device by compute capability: SM90 parts run
// the SM90 plan, SM8x parts the A100 plan (sm_80 machine code). Where that plan does not
// fit the device's shared memory per CTA (SM86/SM89: 99 KB) or it has no machine code
// (past SM90), the 64-row tile is not available: false.
bool Tile64SmemPlan(const DeviceInfo& dev, KvDType kv_dtype, SmemPlan* plan);

// Dynamic shared memory of a kernel: sizeof its plan (kernels/sm80/traits.h). 0 for a
// combination that has no kernel.
int PlanSmemBytes(DType dtype, KvDType kv_dtype, int tile_rows, Fp8Pipeline pipeline, SmemPlan smem_plan);

// The launch decided by the planner for one call. Small and trivially copyable; the
// launch dispatches on it without re-deriving anything: with the params' dtype and KV
// format, tile_rows, smem_plan, fp8_pipeline and p_rounding name one kernel
// instantiation and its shared-memory plan (kernels/sm80/traits.h, DecodeTraits).
struct DecodePlan {
  int tile_rows = 0;        // query rows (heads x s_q sharing one KV head) per CTA tile
  int row_tiles = 0;        // CTAs along the rows of one (sequence, KV head)
  int ctas_per_sm = 0;      // resident CTAs per SM of the chosen kernel on this device
  int num_splits = 1;       // partitions per sequence (grid dimension); 1 = no combine
  int keys_per_split = 0;   // keys per partition, a multiple of 32
  int threads = 0;          // threads per CTA
  int smem_bytes = 0;       // dynamic shared memory per CTA: PlanSmemBytes of the fields below
  SmemPlan smem_plan = SmemPlan::kSm90;
  // FP8 caches: kInPlace, or kRegisters on the 16-row tile where a partition has at least
  // kFp8RegsMinTiles 32-key tiles (faster on long partitions, slower on short one-wave
  // ones), kDequantAhead on the 64-row tile's SM90 plan. kNone for 16-bit caches.
  Fp8Pipeline fp8_pipeline = Fp8Pipeline::kNone;
  PRounding p_rounding = PRounding::kSplit;  // from the params (bf16 only; fp16 has one kernel)
};

// Chooses the tile configuration and cuts sequences into split-K partitions from the
// seqlens (host copy, [b]) and from how many CTAs of that configuration fit on the
// device (dev.kernels), never a fixed SM count.
// tile_rows: 0 for the planner's choice, or 16, 32 or 64 to force one (benchmarks and
// tests comparing tiles on one shape).
Status PlanDecode(const DeviceInfo& dev, const MlaDecodeParams& p, const int32_t* seqlens_host,
                  DecodePlan* plan, int tile_rows = 0);

// Checks a plan against the params before a launch: tile, partitions, the FP8 pipeline
// and shared-memory plan for the tile and cache, the shared memory they take, and the
// workspace.
Status ValidatePlan(const MlaDecodeParams& p, const DecodePlan& plan, size_t workspace_bytes,
                    const void* workspace);

// Device workspace (split-K: partial outputs and LSEs) that LaunchDecode needs.
size_t DecodeWorkspaceBytes(const MlaDecodeParams& p, const DecodePlan& plan);

// An upper bound of DecodeWorkspaceBytes over every plan PlanDecode can produce for
// batches up to max_batch with these head counts and s_q, for preallocation.
size_t MaxDecodeWorkspaceBytes(const DeviceInfo& dev, int max_batch, int s_q, int h_q, int h_kv);

// Resident CTAs per SM of each tile configuration on this device, and the number the
// same kernel would have under A100 limits (164 KB shared memory, 64K registers per SM),
// computed from its registers and shared memory; for the 64-row tile, from the shared
// memory of its A100 plan, the one A100s run.
struct TileOccupancy {
  int tile_rows = 0;
  int threads = 0;
  int regs_per_thread = 0;
  int smem_bytes = 0;
  int ctas_per_sm = 0;
  int ctas_per_sm_a100 = 0;
};
// Fills up to max_configs entries; *num_configs gets the count.
Status DescribeTiles(const DeviceInfo& dev, DType dtype, TileOccupancy* configs, int max_configs,
                     int* num_configs);

}  // namespace latentd::kernels
