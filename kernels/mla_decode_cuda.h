// Host API of the SM80 MLA decode: device query, split-K planner, workspace sizing and
// its one-time initialisation, the decode launch (kernel + combine) and the combine alone.
// Plain C++: the only CUDA type is cudaStream_t. The caller owns all device memory;
// nothing here allocates per call.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/params.h"

typedef struct CUstream_st* cudaStream_t;

namespace latentd::kernels {

// What the planner needs to know about a device, read with cudaGetDeviceProperties.
struct DeviceInfo {
  int device = 0;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  int max_smem_per_sm = 0;           // bytes
  int max_smem_per_block_optin = 0;  // bytes
  int regs_per_sm = 0;
  int max_threads_per_sm = 0;
  char name[256] = {};
};

Status QueryDevice(int device, DeviceInfo* info);

// The launch decided by the planner for one call. Small and trivially copyable.
struct DecodePlan {
  int tile_rows = 0;        // query rows (heads x s_q sharing one KV head) per CTA tile
  int row_tiles = 0;        // CTAs along the rows of one (sequence, KV head)
  int ctas_per_sm = 0;      // resident CTAs per SM of the chosen kernel on this device
  int num_splits = 1;       // partitions per sequence (grid dimension); 1 = no combine
  int keys_per_split = 0;   // keys per partition, a multiple of 32
  int threads = 0;          // threads per CTA
  int smem_bytes = 0;       // dynamic shared memory per CTA
  // FP8 cache: false (PlanDecode's choice) dequantizes each tile in place in its stage;
  // true runs the raw-row ring variant (more shared memory, more bytes in flight),
  // selectable for benchmarks and tests until it is measured (docs/kernel-tuning.md,
  // round 8). Ignored for 16-bit caches and by the 64-row tile, which has one FP8
  // pipeline: raw rows in a 2-stage ring, each tile dequantized during the PV loop of
  // the tile before (round 11).
  bool fp8_ring = false;
  // FP8 cache, 16-row tile: true converts the codes in registers straight into the mma
  // fragments (no 16-bit copy in shared memory; docs/kernel-tuning.md, round 23).
  // PlanDecode sets it where a partition has at least kFp8RegsMinTiles 32-key tiles
  // (kernels/sm80/config.h): faster on long partitions, slower on short one-wave ones.
  // Ignored for 16-bit caches, other tiles, with fp8_ring, and while the build has the
  // pipeline off (LATENTD_FP8_REGS).
  bool fp8_regs = false;
  // Split plans of 2-4 partitions per stream: true merges them inside the decode kernel
  // (its last CTA per stream reads the partials back); false (PlanDecode's choice since
  // round 15 of docs/kernel-tuning.md) runs the combine kernel, which on SM90 launches
  // while the decode kernel runs and measured 1.5-3.5% faster on those plans.
  // Selectable for benchmarks and tests; the workspace is the same either way.
  bool fused_combine = false;
};

// Chooses the tile configuration and cuts sequences into split-K partitions from the
// seqlens (host copy, [b]) and from how many CTAs of that configuration fit on the
// device (cudaOccupancyMaxActiveBlocksPerMultiprocessor), never a fixed SM count.
// tile_rows: 0 for the planner's choice, or 16, 32 or 64 to force one (benchmarks and
// tests comparing tiles on one shape).
Status PlanDecode(const DeviceInfo& dev, const MlaDecodeParams& p, const int32_t* seqlens_host,
                  DecodePlan* plan, int tile_rows = 0);

// Device workspace (split-K: arrival counters of the fused combine, partial outputs and
// LSEs) that LaunchDecode needs.
size_t DecodeWorkspaceBytes(const MlaDecodeParams& p, const DecodePlan& plan);

// An upper bound of DecodeWorkspaceBytes over every plan PlanDecode can produce for
// batches up to max_batch with these head counts and s_q, for preallocation.
size_t MaxDecodeWorkspaceBytes(const DeviceInfo& dev, int max_batch, int s_q, int h_q, int h_kv);

// Zeroes the workspace's arrival counters (its first 16 KB at most) on stream. Run it
// once after allocating a workspace, before its first LaunchDecode / LaunchDecodeKernel,
// and again only if something else wrote over the workspace: the decode kernel leaves
// every counter at zero when it finishes, so no call needs a memset of its own. A
// workspace is used by one stream at a time.
Status InitDecodeWorkspace(void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Runs the decode on stream. With plan.num_splits > 1 the partitions of a stream
// (sequence, KV head, row tile) are merged by the last of its CTAs to finish, inside the
// decode kernel, when they are few; otherwise a separate combine kernel follows.
// p's pointers are device pointers; seqlens on the device must equal seqlens_host given
// to PlanDecode; the workspace must have been through InitDecodeWorkspace. Writes every
// element of out and lse.
Status LaunchDecode(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream);

// The decode kernel alone (out/lse when num_splits == 1; partials into the workspace
// otherwise, merged into out/lse by the kernel itself when LaunchDecode fuses the
// combine), and the combine kernel alone (merges the partials of any plan again).
// LaunchDecode is the first, then the second when the combine is not fused. For benchmarks.
Status LaunchDecodeKernel(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);
Status LaunchCombine(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream);

// Resident CTAs per SM of each tile configuration on this device, and the number the
// same kernel would have under A100 limits (164 KB shared memory, 64K registers per SM),
// computed from its registers and shared memory (cudaFuncGetAttributes); for the 64-row
// tile, from the shared memory of its sm_80 machine code's plan, the one A100s run.
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
