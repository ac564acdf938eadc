// Tile configurations of the SM80 MLA decode kernel. One configuration per row tile:
// rows = query heads x query tokens that share one KV head, packed into one CTA.
// Plain C++ so the host planner and the ptxas-facing kernel agree on the same numbers.
#pragma once

#include "kernels/params.h"

namespace latentd::kernels::sm80 {

// Every configuration runs 4 warps. QK^T is split across the warps along the 576-wide
// contraction dimension (each warp 144 dims = 9 k-steps), so every K element and every
// Q element is read from shared memory (or registers) by exactly one warp; the partial
// scores are summed through shared memory. PV is split along the 512 output columns
// (128 per warp), so every V element is also read once.
inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kDimsPerWarp = kHeadDimQK / kWarps;  // 144
inline constexpr int kColsPerWarp = kHeadDimV / kWarps;   // 128

template <int kRows>
struct TileConfig;

// Few rows (h_q / h_kv * s_q <= 16): memory-bound. Q lives in registers (36 per thread),
// leaving shared memory for 32-key tiles in 2 stages: 2 x 36 KB + 8.5 KB of reduction
// scratch = 80.5 KB, so 2 CTAs fit in A100's 164 KB. 32 keys per online-softmax rescale.
// The partial scores are reduced cooperatively, as in the 64-row tile (d9e2b0b, 89f1320:
// 20% fewer instructions, FP8 rows 2.5-4% faster, 16-bit rows unchanged). 2 resident
// CTAs per SM (__launch_bounds__) cap it at 255 registers; 3 (168 registers) spilled the
// FP8 pipelines and did not pay on 16-bit caches (284b878).
//
// FP8 cache: either dequantized in place (each thread converts the raw chunks it copied,
// f0bd541, 2ddcd90) or converted in registers straight into mma fragments (3a769b8,
// 264d5b2): each warp's QK^T dims are its 128 PV columns' block plus 16 rope dims, so
// one conversion serves as K and, transposed by movmatrix, as V; its stages hold raw
// rows only (20.5 KB per 32 keys), so 3 of them fit with 2 CTAs per A100 SM. Measured
// faster when a CTA computes many tiles, slower on short one-wave CTAs, so the planner
// picks it from kFp8RegsMinTiles 32-key tiles per partition (264d5b2: -7 to -8% at
// (64,16,4096)). More stages on 228 KB SMs gained nothing (dc6849f): the tile waits on
// its own instruction chain, not on copies.
template <>
struct TileConfig<16> {
  static constexpr int kRowsPerTile = 16;
  static constexpr int kKeys = 32;    // keys per staged KV tile (and per softmax step)
  static constexpr int kStages = 2;   // cp.async pipeline depth
  static constexpr bool kQInRegisters = true;
  static constexpr int kGroups = 1;       // groups of 4 warps, each owning kRows / kGroups rows
  static constexpr int kQRegSteps = 0;    // with Q in shared memory: k-steps per warp held in registers
  static constexpr int kExchangePasses = 1;  // partial-score exchanges per KV tile (keys split evenly)
  // Cooperative reduction: each warp sums one 8-key slice of the partial scores and runs
  // the softmax on it; P goes through shared memory to the PV (below, the 64-row tile).
  static constexpr bool kCoopReduce = true;
  static constexpr int kMinCtasPerSm = 2;
  static constexpr int kFp8MinCtasPerSm = 2;
  static constexpr bool kFp8Regs = true;    // FP8: the conversion-in-registers pipeline exists
  static constexpr int kFp8RegStages = 3;   // ... and its raw stages
  // FP8 cache: dequantize tile t+1 inside tile t's PV loop from a raw-row ring of its
  // own (64-row tile only: here the second 16-bit stage plus the ring would leave 1 CTA
  // per SM).
  static constexpr bool kFp8DequantAhead = false;
  static constexpr bool kPingPong = false;  // two groups only (the 64-row tile)
};

// 16-row tile, FP8 cache: the conversion in registers from this many 32-key tiles per
// partition (DecodePlan::fp8_pipeline).
inline constexpr int kFp8RegsMinTiles = 16;

// Many rows (> 16): compute-heavy. 32 rows, because the fp32 output accumulator of a
// 64-row tile (64 x 512 x 4 B = 128 KB of registers) would by itself fill the register
// file of one SM, ruling out 2 CTAs per SM. Q (36 KB) stays in shared memory; 16-key
// tiles in 2 stages (36 KB) + 8 KB partial scores = 80 KB.
template <>
struct TileConfig<32> {
  static constexpr int kRowsPerTile = 32;
  static constexpr int kKeys = 16;
  static constexpr int kStages = 2;
  static constexpr bool kQInRegisters = false;
  static constexpr int kGroups = 1;
  static constexpr int kQRegSteps = 0;
  static constexpr int kExchangePasses = 1;
  static constexpr bool kCoopReduce = false;
  static constexpr int kMinCtasPerSm = 2;
  static constexpr int kFp8MinCtasPerSm = 2;
  static constexpr bool kFp8Regs = false;  // the 16-row tile only
  static constexpr int kFp8RegStages = 0;
  static constexpr bool kFp8DequantAhead = false;
  static constexpr bool kPingPong = false;  // two groups only (the 64-row tile)
};

// 64+ rows (h_q 128 with data-parallel attention, MTP): two groups of 4 warps in one
// CTA of 256 threads, each group the 32-row decomposition (dims split for QK^T,
// columns for PV), sharing 32-key KV stages: every KV byte staged once serves 64 rows,
// and Q is re-read every 32 keys instead of 16 (e0a6345).
// The partial scores are reduced cooperatively (5bbcfba): warp w of a group sums only
// keys 8w .. 8w+7 of the 32 (3 KB written and 3 KB read per warp instead of 3 x 8 KB
// read), runs the softmax on that slice with the group's row maxima exchanged through
// shared memory, and writes its slice of P, which every warp of the group then reads as
// the PV's A operand. The exchanges synchronise only the group (named barriers).
// One CTA per SM: 8 warps, as 2 x 4 before. Shared memory: Q 72 KB + KV 2 x 36 KB +
// partial slices 32 KB (P in each reducer's own slot) + row maxima and sums 2 KB =
// 178 KB, less 8 KB per Q k-step each warp holds in registers (traits.h, kQRegStepsOf:
// 2 in the A100 plan, which so fits A100's 163 KB per CTA; 35ea763).
template <>
struct TileConfig<64> {
  static constexpr int kRowsPerTile = 64;
  static constexpr int kKeys = 32;
  static constexpr int kStages = 2;
  static constexpr bool kQInRegisters = false;
  static constexpr int kGroups = 2;
  static constexpr int kQRegSteps = 0;  // FP8 caches; 16-bit caches: traits.h, kQRegStepsOf
  static constexpr int kExchangePasses = 1;
  static constexpr bool kCoopReduce = true;
  static constexpr int kMinCtasPerSm = 1;
  static constexpr int kFp8MinCtasPerSm = 1;
  static constexpr bool kFp8Regs = false;  // the 16-row tile only
  static constexpr int kFp8RegStages = 0;
  // FP8 cache: raw rows land in a 2-stage ring of their own (41 KB more shared memory);
  // tile t+1 is dequantized into the other 16-bit stage between tile t's PV mma, whose
  // issue slots are two-thirds idle, so the conversion costs no barriers (904a104).
  static constexpr bool kFp8DequantAhead = true;
  // 16-bit caches: the groups run offset, group 1 copying the tiles (kernel.cuh, be5ae71).
  static constexpr bool kPingPong = true;
};

// Threads per CTA of a tile configuration.
template <int kRows>
inline constexpr int kCtaThreads = kThreads * TileConfig<kRows>::kGroups;

// 64-row tile: a tile's P is computed against the running row max as it stands, with
// no exchange of maxima, while no score is above it by more than 2^this (log2 units;
// afe1fd3).
inline constexpr float kLazyMaxLog2 = 8;

// Row tiles the planner can choose, smallest first.
inline constexpr int kTileRowOptions[] = {16, 32, 64};
inline constexpr int kNumTileConfigs = 3;

}  // namespace latentd::kernels::sm80
