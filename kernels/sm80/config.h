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
// bf16: P for the PV mma as a high and a low bf16 part (16 significant bits), as the
// accuracy contract needs; false builds a variant with P rounded once to bf16, as
// FlashMLA and FlashInfer round it, to measure what the split costs (round 36).
#ifndef LATENTD_BF16_P_SPLIT  // overridable only to build tuning variants
#define LATENTD_BF16_P_SPLIT true
#endif
inline constexpr bool kBf16PSplit = LATENTD_BF16_P_SPLIT;
// Diagnostic builds only: the 16- and 64-row tiles' first CTA records the SM clock at 8 points
// of 4 tiles per warp, and every 64-row CTA the global timer at entry, loop start, loop
// end and epilogue end; both are printed (docs/kernel-tuning.md, round 33c).
#ifndef LATENTD_PHASE_TRACE  // overridable only to build diagnostic variants
#define LATENTD_PHASE_TRACE 0
#endif

template <int kRows>
struct TileConfig;

// Few rows (h_q / h_kv * s_q <= 16): memory-bound. Q lives in registers (36 per thread),
// leaving shared memory for 32-key tiles in 2 stages: 2 x 36 KB + 8.5 KB of reduction
// scratch = 80.5 KB, so 2 CTAs fit in A100's 164 KB. 32 keys per online-softmax rescale.
// The partial scores are reduced cooperatively, as in the 64-row tile (round 11d: 20%
// fewer instructions, FP8 rows 2.5-4% faster, 16-bit rows unchanged).
#ifndef LATENTD_TILE16_KEYS  // overridable only to build tuning variants
#define LATENTD_TILE16_KEYS 32
#define LATENTD_TILE16_STAGES 2
#endif
#ifndef LATENTD_TILE16_COOP  // overridable only to build tuning variants
#define LATENTD_TILE16_COOP true
#endif
// Resident CTAs per SM the 16-row tile is compiled for (__launch_bounds__): 2 caps it at
// 255 registers, 3 at 168 (round 22).
#ifndef LATENTD_TILE16_MIN_CTAS  // overridable only to build tuning variants
#define LATENTD_TILE16_MIN_CTAS 2
#endif
// The same for FP8 caches: their conversion needs more registers than 168 (round 22).
#ifndef LATENTD_TILE16_FP8_MIN_CTAS  // overridable only to build tuning variants
#define LATENTD_TILE16_FP8_MIN_CTAS 2
#endif
// FP8 cache, 16-row tile: e4m3 codes converted in registers straight into mma fragments
// (round 23): each warp's QK^T dims are its 128 PV columns' block plus 16 rope dims, so
// one conversion serves as K and, transposed by movmatrix, as V; the stages hold raw
// rows only (20.5 KB per 32 keys), so 3 of them fit with 2 CTAs per A100 SM. Measured
// faster when a CTA computes many tiles, slower on short one-wave CTAs, so the planner
// picks it from this many 32-key tiles per partition (DecodePlan::fp8_regs; round 23b:
// -7 to -8% at (64,16,4096), clean under compute-sanitizer). More stages on 228 KB SMs
// gained nothing (round 24): the tile waits on its own instruction chain, not on copies.
#ifndef LATENTD_FP8_REGS  // overridable only to build tuning variants
#define LATENTD_FP8_REGS true
#endif
#ifndef LATENTD_FP8_REGS_MIN_TILES  // overridable only to build tuning variants
#define LATENTD_FP8_REGS_MIN_TILES 16
#endif
inline constexpr int kFp8RegsMinTiles = LATENTD_FP8_REGS_MIN_TILES;
#ifndef LATENTD_FP8_REG_STAGES  // overridable only to build tuning variants
#define LATENTD_FP8_REG_STAGES 3
#endif
template <>
struct TileConfig<16> {
  static constexpr int kRowsPerTile = 16;
  static constexpr int kKeys = LATENTD_TILE16_KEYS;      // keys per staged KV tile (and per softmax step)
  static constexpr int kStages = LATENTD_TILE16_STAGES;  // cp.async pipeline depth
  static constexpr bool kQInRegisters = true;
  static constexpr int kGroups = 1;       // groups of 4 warps, each owning kRows / kGroups rows
  static constexpr int kQRegSteps = 0;    // with Q in shared memory: k-steps per warp held in registers
  static constexpr int kExchangePasses = 1;  // partial-score exchanges per KV tile (keys split evenly)
  // Cooperative reduction: each warp sums one 8-key slice of the partial scores and runs
  // the softmax on it; P goes through shared memory to the PV (below, the 64-row tile).
  static constexpr bool kCoopReduce = LATENTD_TILE16_COOP;
  static constexpr int kMinCtasPerSm = LATENTD_TILE16_MIN_CTAS;
  static constexpr int kFp8MinCtasPerSm = LATENTD_TILE16_FP8_MIN_CTAS;
  static constexpr int kFp8Stages = 3;  // FP8 cache: raw-row ring depth (traits.h)
  static constexpr bool kFp8Regs = LATENTD_FP8_REGS;          // FP8: conversion in registers
  static constexpr int kFp8RegStages = LATENTD_FP8_REG_STAGES;  // ... and its raw stages
  // FP8 cache: dequantize tile t+1 inside tile t's PV loop from a raw-row ring of its
  // own, instead of in place between a tile's arrival and its mma loops (64-row tile
  // only: here the second 16-bit stage plus the ring would leave 1 CTA per SM).
  static constexpr bool kFp8DequantAhead = false;
  static constexpr bool kPingPong = false;  // two groups only (the 64-row tile)
};

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
  static constexpr int kFp8Stages = 4;
  static constexpr bool kFp8Regs = false;  // the 16-row tile only
  static constexpr int kFp8RegStages = 0;
  static constexpr bool kFp8DequantAhead = false;
  static constexpr bool kPingPong = false;  // two groups only (the 64-row tile)
};

// 64+ rows (h_q 128 with data-parallel attention, MTP): two groups of 4 warps in one
// CTA of 256 threads, each group the 32-row decomposition (dims split for QK^T,
// columns for PV), sharing 32-key KV stages: every KV byte staged once serves 64 rows,
// and Q is re-read every 32 keys instead of 16 (docs/kernel-tuning.md, round 7).
// The partial scores are reduced cooperatively (round 10): warp w of a group sums only
// keys 8w .. 8w+7 of the 32 (3 KB written and 3 KB read per warp instead of 3 x 8 KB
// read), runs the softmax on that slice with the group's row maxima exchanged through
// shared memory, and writes its slice of P, which every warp of the group then reads as
// the PV's A operand. The exchanges synchronise only the group (named barriers).
// One CTA per SM: 8 warps, as 2 x 4 before. Shared memory: Q 72 KB + KV 2 x 36 KB +
// partial slices 32 KB (P in each reducer's own slot) + row maxima and sums 2 KB =
// 178 KB, less 8 KB per Q k-step each warp holds in registers (traits.h, kQRegStepsOf:
// 2 in the A100 plan, which so fits A100's 163 KB per CTA; round 28).
#ifndef LATENTD_PING_PONG  // overridable only to build tuning variants
#define LATENTD_PING_PONG true
#endif
#ifndef LATENTD_FP8_DEQUANT_AHEAD  // overridable only to build tuning variants
#define LATENTD_FP8_DEQUANT_AHEAD true
#endif
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
  static constexpr int kFp8Stages = 4;  // unused: no raw-row ring variant of this tile
  static constexpr bool kFp8Regs = false;  // the 16-row tile only
  static constexpr int kFp8RegStages = 0;
  // FP8 cache: raw rows land in a 2-stage ring of their own (41 KB more shared memory);
  // tile t+1 is dequantized into the other 16-bit stage between tile t's PV mma, whose
  // issue slots are two-thirds idle (round 11), so the conversion costs no barriers.
  static constexpr bool kFp8DequantAhead = LATENTD_FP8_DEQUANT_AHEAD;
  // 16-bit caches: the groups run offset, group 1 copying the tiles (kernel.cuh, round 12).
  static constexpr bool kPingPong = LATENTD_PING_PONG;
};

// Threads per CTA of a tile configuration.
template <int kRows>
inline constexpr int kCtaThreads = kThreads * TileConfig<kRows>::kGroups;

// Split-K combine fused into the decode kernel: the last CTA of a (sequence, KV head,
// row tile) to finish merges that stream's partials itself, read back from L2 by that one
// CTA, when they are at most this many partition rows (partitions x tile rows; 128 rows
// = 256 KB of fp32 partials). Larger merges go to the separate combine kernel, which
// spreads them over many SMs (docs/kernel-tuning.md, round 6). Only plans that ask for it
// (DecodePlan::fused_combine, off by default since round 15) fuse.
#ifndef LATENTD_MAX_FUSED_PARTIAL_ROWS  // overridable only to build tuning variants
#define LATENTD_MAX_FUSED_PARTIAL_ROWS 128
#endif
inline constexpr int kMaxFusedPartialRows = LATENTD_MAX_FUSED_PARTIAL_ROWS;
// ... and at most this many partitions: one CTA merges ~32 KB per L2 round trip, so 8
// partitions of 16 rows already cost more than the combine kernel at small batch.
#ifndef LATENTD_MAX_FUSED_SPLITS  // overridable only to build tuning variants
#define LATENTD_MAX_FUSED_SPLITS 4
#endif
inline constexpr int kMaxFusedSplits = LATENTD_MAX_FUSED_SPLITS;
// Arrival counters of the fused combine: one per (sequence, KV head, row tile), at the
// start of the workspace; plans with more of these streams use the combine kernel.
inline constexpr int kMaxFusedStreams = 4096;

// KV tiles ahead of the copies in flight whose rows the kernel asks L2 for (0: none);
// docs/kernel-tuning.md, round 9.
#ifndef LATENTD_L2_PREFETCH_TILES  // overridable only to build tuning variants
#define LATENTD_L2_PREFETCH_TILES 0
#endif
inline constexpr int kL2PrefetchTiles = LATENTD_L2_PREFETCH_TILES;

// 64-row tile: a tile's P is computed against the running row max as it stands, with
// no exchange of maxima, while no score is above it by more than 2^this (log2 units;
// 0: always exchange); docs/kernel-tuning.md, round 10.
#ifndef LATENTD_LAZY_MAX_LOG2  // overridable only to build tuning variants
#define LATENTD_LAZY_MAX_LOG2 8
#endif
inline constexpr float kLazyMaxLog2 = LATENTD_LAZY_MAX_LOG2;

// FP8 cache, in place, 16-row tile: the passes a tile's dequantization takes, each one
// barrier between reading its raw rows into registers and writing their 16-bit values;
// fewer passes hold more registers across the barrier (round 8: 2; round 19: 1). The
// 32-row tile keeps 2 (one pass spills there).
#ifndef LATENTD_FP8_INPLACE_PASSES  // overridable only to build tuning variants
#define LATENTD_FP8_INPLACE_PASSES 1
#endif
inline constexpr int kFp8InPlacePasses = LATENTD_FP8_INPLACE_PASSES;
// FP8 cache, in place, 16-row tile: each thread converts the raw chunks it copied, read
// before the tile's first barrier (rounds 20, 20b); false: the pass scheme above (round
// 19 with one pass), which LATENTD_FP8_INPLACE_PASSES configures.
#ifndef LATENTD_FP8_OWN_CHUNKS  // overridable only to build tuning variants
#define LATENTD_FP8_OWN_CHUNKS true
#endif
inline constexpr bool kFp8OwnChunks = LATENTD_FP8_OWN_CHUNKS;

// Row tiles the planner can choose, smallest first.
inline constexpr int kTileRowOptions[] = {16, 32, 64};
inline constexpr int kNumTileConfigs = 3;

}  // namespace latentd::kernels::sm80
