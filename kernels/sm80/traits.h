// The SM80 decode kernel's traits: the shared-memory plan of each (tile, KV format), whose
// sizeof is exactly the dynamic shared memory a CTA is launched with, and DecodeTraits,
// everything one kernel instantiation is (tile shape, pipeline, plan) as constants.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/kv_fp8.h"
#include "kernels/params.h"
#include "kernels/sm80/config.h"

namespace latentd::kernels::sm80 {

// kQRegSteps: k-steps of each warp's Q slice held in registers instead (Q in shared
// memory only; the 64-row tile's A100 plan holds 2, kQRegStepsOf below).
template <int kRows, bool kQInSmem = !TileConfig<kRows>::kQInRegisters, bool kCoop = TileConfig<kRows>::kCoopReduce,
          int kQRegSteps = TileConfig<kRows>::kQRegSteps>
struct SharedMemoryPlan {
  using Cfg = TileConfig<kRows>;
  // 16-byte chunks of Q per row kept in shared memory: each warp's 9 k-steps of 16 dims,
  // less the kQRegSteps it holds in registers, warp after warp.
  static constexpr int kQChunks = kWarps * (kDimsPerWarp / 16 - kQRegSteps) * 2;
  // KV tiles, [stage][key][576] 16-bit elements, 16-byte chunks XOR-swizzled per row so
  // that the 8 rows one ldmatrix reads fall in 8 different bank groups.
  uint16_t kv[Cfg::kStages][Cfg::kKeys][kHeadDimQK];
  // Q tile [row][kQChunks * 8], same swizzle (only when Q is not held in registers).
  uint16_t q[kRows][kQChunks * 8];
  // Partial scores of each warp in mma accumulator order:
  // [group][warp][m-tile][n-tile of the pass][lane] x 4 floats, read back lane-for-lane
  // (conflict-free).
  float s_part[Cfg::kGroups][kWarps][kRows / Cfg::kGroups / 16][Cfg::kKeys / 8 / Cfg::kExchangePasses][32][4];
};

template <int kRows, int kQRegSteps>
struct SharedMemoryPlan<kRows, false, false, kQRegSteps> {
  using Cfg = TileConfig<kRows>;
  uint16_t kv[Cfg::kStages][Cfg::kKeys][kHeadDimQK];
  float s_part[Cfg::kGroups][kWarps][kRows / Cfg::kGroups / 16][Cfg::kKeys / 8 / Cfg::kExchangePasses][32][4];
};

// The cooperative reduction (TileConfig::kCoopReduce): KV and Q as above; warp w of a
// group reduces the scores of keys 8w .. 8w+7 of a tile, so the other warps leave it
// their partials of those keys, and it writes that slice of P for all of the group.
template <int kRows, int kQRegSteps>
struct SharedMemoryPlan<kRows, true, true, kQRegSteps> {
  using Cfg = TileConfig<kRows>;
  static constexpr int kGroupRows = kRows / Cfg::kGroups;
  static constexpr int kQChunks = kWarps * (kDimsPerWarp / 16 - kQRegSteps) * 2;
  static_assert(Cfg::kKeys == 8 * kWarps, "one 8-key slice per warp of a group");
  uint16_t kv[Cfg::kStages][Cfg::kKeys][kHeadDimQK];
  uint16_t q[kRows][kQChunks * 8];
  // [group][slice (its reducing warp)][source warp][m-tile][lane] x 4 floats in
  // accumulator order, read back lane-for-lane (conflict-free). A reducer's own slot
  // [g][w][w] (1 KB) holds no partials: it holds the slice's P instead, as 16-bit values
  // [high, low part (bf16 split)][row][8 keys], written by warp w after its reduction and
  // read by the group's ldmatrix (16-byte rows, 8 rows per 128 bytes: conflict-free).
  // No partial is ever written there, so the next tile's partials cannot overwrite a P
  // still being read (35ea763: 8 KB less, towards A100's 163 KB).
  float s_part[Cfg::kGroups][kWarps][kWarps][kGroupRows / 16][32][4];
  // Per row, each slice's score maximum of the tile, and (in the epilogue) its sum of P.
  float row_max[Cfg::kGroups][kGroupRows][kWarps];
  float row_sum[Cfg::kGroups][kGroupRows][kWarps];
  static constexpr bool kPackedSlices = false;
  static constexpr bool kPInSlots = true;
  static_assert(sizeof(s_part[0][0][0]) == 2 * kGroupRows * Cfg::kKeys / kWarps * sizeof(uint16_t),
                "a slot holds both planes of one slice's P");
};

// Q in registers with the cooperative reduction (the 16-row tile's variant): the
// partial-score slots packed, 3 sources per slice with no unused slot, since 2 CTAs per
// A100 SM leave no room for it. KV first: the fused combine's weights go there.
template <int kRows, int kQRegSteps>
struct SharedMemoryPlan<kRows, false, true, kQRegSteps> {
  using Cfg = TileConfig<kRows>;
  static constexpr int kGroupRows = kRows / Cfg::kGroups;
  static_assert(Cfg::kKeys == 8 * kWarps, "one 8-key slice per warp of a group");
  uint16_t kv[Cfg::kStages][Cfg::kKeys][kHeadDimQK];
  // [group][slice][source warp, skipping the slice's own][m-tile][lane] x 4 floats.
  float s_part[Cfg::kGroups][kWarps][kWarps - 1][kGroupRows / 16][32][4];
  uint16_t p[Cfg::kGroups][2][kGroupRows][Cfg::kKeys];
  float row_max[Cfg::kGroups][kGroupRows][kWarps];
  float row_sum[Cfg::kGroups][kGroupRows][kWarps];
  static constexpr bool kPackedSlices = true;
  static constexpr bool kPInSlots = false;  // P in its own array, p
};

// FP8 cache, dequantized one tile ahead (TileConfig::kFp8DequantAhead): the 16-bit plan
// plus a 2-stage ring of raw rows. Tile t's raw rows land in raw[t % 2] while tile t-1
// is computed; during tile t they become kv[(t + 1) % 2] of tile t+1.
template <int kRows>
struct Fp8AheadSharedMemoryPlan : SharedMemoryPlan<kRows> {
  uint8_t raw[2][TileConfig<kRows>::kKeys][kFp8RowBytes];  // raw rows, packed
};

// FP8 cache converted in registers (TileConfig::kFp8Regs, 16-row tile, Q in registers):
// the stages hold a tile's pieces apart. Latent codes [stage][key][512]: 16-byte chunk q
// of key k at chunk q ^ 4 (k % 2), so the 8 lanes of a quarter-warp's 16-byte loads
// (keys 2m and 2m+1, 4 chunks each) fall in 8 different bank groups. Rope values
// [stage][key][64] in 16 bits, chunk r at r ^ (k % 8) for ldmatrix. Scales [stage][key][4].
template <int kRows, bool kCoop = TileConfig<kRows>::kCoopReduce>
struct Fp8RegsSharedMemoryPlan {
  using Cfg = TileConfig<kRows>;
  static_assert(Cfg::kQInRegisters, "conversion in registers: Q in registers (the 16-row tile)");
  uint8_t kv[Cfg::kFp8RegStages][Cfg::kKeys][kHeadDimV];
  uint16_t rope[Cfg::kFp8RegStages][Cfg::kKeys][kHeadDimQK - kHeadDimV];
  float scales[Cfg::kFp8RegStages][Cfg::kKeys][kFp8Blocks];
  float s_part[Cfg::kGroups][kWarps][kRows / Cfg::kGroups / 16][Cfg::kKeys / 8 / Cfg::kExchangePasses][32][4];
};
// The same with the cooperative reduction's scratch (as SharedMemoryPlan<k, false, true>).
template <int kRows>
struct Fp8RegsSharedMemoryPlan<kRows, true> {
  using Cfg = TileConfig<kRows>;
  static constexpr int kGroupRows = kRows / Cfg::kGroups;
  static_assert(Cfg::kQInRegisters, "conversion in registers: Q in registers (the 16-row tile)");
  uint8_t kv[Cfg::kFp8RegStages][Cfg::kKeys][kHeadDimV];
  uint16_t rope[Cfg::kFp8RegStages][Cfg::kKeys][kHeadDimQK - kHeadDimV];
  float scales[Cfg::kFp8RegStages][Cfg::kKeys][kFp8Blocks];
  float s_part[Cfg::kGroups][kWarps][kWarps - 1][kGroupRows / 16][32][4];
  uint16_t p[Cfg::kGroups][2][kGroupRows][Cfg::kKeys];
  float row_max[Cfg::kGroups][kGroupRows][kWarps];
  float row_sum[Cfg::kGroups][kGroupRows][kWarps];
  static constexpr bool kPackedSlices = true;
  static constexpr bool kPInSlots = false;  // P in its own array, p
};

// Q k-steps per warp in registers of one instantiation (35ea763, 010b870). The 64-row
// tile: its A100 plan (kSm80Plan: the instantiations built as sm_80 machine code) holds
// 2, so that it fits A100's 163 KB per CTA (162 KB); its SM90 plan, with 227 KB, holds 1
// for bf16 (170 KB; 2 spill there) and 2 for fp16 (162 KB) with a 16-bit cache, each the
// fastest measured on an H100, and none with an FP8 cache (its raw-row ring takes the
// room). Other tiles: their TileConfig's.
inline constexpr int kTile64Sm80QRegSteps = 2;
inline constexpr int kTile64Sm90Bf16QRegSteps = 1;
inline constexpr int kTile64Sm90Fp16QRegSteps = 2;
template <int kRows, KvDType kKv, bool kSm80Plan, DType kDType>
inline constexpr int kQRegStepsOf =
    kRows != 64                ? TileConfig<kRows>::kQRegSteps
    : kSm80Plan                ? kTile64Sm80QRegSteps
    : kKv != KvDType::kModel   ? TileConfig<kRows>::kQRegSteps
    : kDType == DType::kBF16   ? kTile64Sm90Bf16QRegSteps
                               : kTile64Sm90Fp16QRegSteps;

// Whether an FP8 instantiation dequantizes one tile ahead from a raw-row ring of its own
// (TileConfig::kFp8DequantAhead). Not in the 64-row tile's A100 plan: the ring (41 KB)
// does not fit A100's 163 KB, so it converts in place, in kTile64Sm80Fp8Passes
// passes of one chunk per thread (fewer passes spill there; 35ea763).
template <int kRows, bool kSm80Plan>
inline constexpr bool kFp8AheadOf = TileConfig<kRows>::kFp8DequantAhead && !(kRows == 64 && kSm80Plan);
inline constexpr int kTile64Sm80Fp8Passes = 5;

// Whether an instantiation converts FP8 in registers (Decoder's kRegs, TileConfig::kFp8Regs).
template <int kRows, KvDType kKv, bool kRegs>
inline constexpr bool kUsesFp8Regs = kKv == KvDType::kFp8E4M3 && kRegs && TileConfig<kRows>::kFp8Regs;

// The plan of one kernel instantiation: FP8 converted in registers, FP8 dequantized
// ahead (the 64-row tile's FP8 pipeline), or the 16-bit plan, which FP8 in place shares.
// kSm80Plan: the 64-row tile's A100 plan (kQRegStepsOf, kFp8AheadOf), else SM90's, which
// may differ by dtype.
template <int kRows, KvDType kKv, bool kRegs = false, bool kSm80Plan = false, DType kDType = DType::kBF16>
using PlanOf = std::conditional_t<
    kUsesFp8Regs<kRows, kKv, kRegs>, Fp8RegsSharedMemoryPlan<kRows>,
    std::conditional_t<kKv == KvDType::kFp8E4M3 && kFp8AheadOf<kRows, kSm80Plan>, Fp8AheadSharedMemoryPlan<kRows>,
                       SharedMemoryPlan<kRows, !TileConfig<kRows>::kQInRegisters, TileConfig<kRows>::kCoopReduce,
                                        kQRegStepsOf<kRows, kKv, kSm80Plan, kDType>>>>;

// Everything one kernel instantiation is, as constants (the kernel, kernel.cuh, is
// written against this type): its tile configuration, its shared-memory plan, which FP8
// pipeline it runs, and the fragment counts the phases loop over. kRegsPipe: FP8
// converted in registers (Fp8Pipeline::kRegisters); kSm80Plan: the 64-row tile's A100
// plan (SmemPlan::kA100); the other tiles have one plan each.
template <DType kDType_, int kRows_, KvDType kKv_, bool kRegsPipe, bool kSm80Plan, PRounding kPRounding_>
struct DecodeTraits {
  using Cfg = TileConfig<kRows_>;
  static constexpr DType kDType = kDType_;
  static constexpr int kRows = kRows_;
  static constexpr KvDType kKv = kKv_;
  static constexpr PRounding kPRounding = kPRounding_;
  static constexpr bool kFp8 = kKv == KvDType::kFp8E4M3;

  // The shared-memory plan: sizeof is the launch's dynamic shared memory.
  static constexpr SmemPlan kSmemPlan = kSm80Plan ? SmemPlan::kA100 : SmemPlan::kSm90;
  static constexpr bool kA100Plan = kSm80Plan;
  using SharedMemoryPlan = PlanOf<kRows, kKv, kRegsPipe, kSm80Plan, kDType>;

  // The FP8 pipeline (one header each: fp8_in_place.cuh, fp8_in_registers.cuh,
  // fp8_dequant_ahead.cuh); kNone for 16-bit caches.
  static constexpr bool kFp8Ahead = kFp8 && kFp8AheadOf<kRows, kSm80Plan>;
  static constexpr bool kRegs = kUsesFp8Regs<kRows, kKv, kRegsPipe>;
  static_assert(kRegs == kRegsPipe, "conversion in registers: FP8 caches on the 16-row tile only");
  static constexpr Fp8Pipeline kFp8Pipeline = !kFp8      ? Fp8Pipeline::kNone
                                              : kRegs     ? Fp8Pipeline::kRegisters
                                              : kFp8Ahead ? Fp8Pipeline::kDequantAhead
                                                          : Fp8Pipeline::kInPlace;

  static constexpr int kCta = kCtaThreads<kRows>;
  static constexpr int kMinCtasPerSm = kFp8 ? Cfg::kFp8MinCtasPerSm : Cfg::kMinCtasPerSm;
  static constexpr int kN = Cfg::kKeys;  // keys per KV tile
  // Copies in flight + 1.
  static constexpr int kStages = kRegs ? Cfg::kFp8RegStages : Cfg::kStages;
  // Tiles whose copies are issued ahead of the one computed: one more when dequantizing
  // ahead (tile t+1 must have landed while tile t is computed).
  static constexpr int kAhead = kFp8Ahead ? kStages : kStages - 1;
  // Ping-pong (TileConfig::kPingPong, 16-bit caches): group 1 alone copies the KV tiles
  // and runs up to half a tile behind group 0, the two synchronised by producer/consumer
  // barriers instead of one CTA barrier per tile, so one group's softmax and barriers
  // overlap the other's mma (be5ae71).
  static constexpr bool kPingPong = Cfg::kPingPong && kKv == KvDType::kModel;
  static_assert(!kPingPong || (Cfg::kGroups == 2 && kStages == 2), "ping-pong: two groups, two stages");

  static constexpr int kGroupRows = kRows / Cfg::kGroups;
  static constexpr int kMT = kGroupRows / 16;          // m16 tiles per warp (each warp covers its group's rows)
  static constexpr int kNT = kN / 8;                   // n8 score tiles per KV tile
  static constexpr int kKSteps = kDimsPerWarp / 16;    // 9
  static constexpr int kVT = kColsPerWarp / 8;         // 16 n8 output tiles per warp
  // k-steps of each warp's Q slice held in registers (all of them for the 16-row tile).
  static constexpr int kQRegSteps = kQRegStepsOf<kRows, kKv, kSm80Plan, kDType>;  // with Q in shared memory
  static constexpr int kRegSteps = Cfg::kQInRegisters ? kKSteps : kQRegSteps;
  static constexpr int kQFragSteps = kRegSteps > 0 ? kRegSteps : 1;  // the register array's extent
  static_assert(!Cfg::kQInRegisters || kMT == 1, "Q fully in registers only for one m-tile");
  static_assert(kPageSize % kN == 0, "a KV tile must not straddle pages");
  static_assert((kN * (kHeadDimQK / 8)) % kCta == 0, "KV tile copy must divide evenly");

  // bf16 keeps 8 bits of P: with few dominant keys that alone is an output error of
  // ~2^-9 |v|, beyond the split contract's tolerance, so by default (PRounding::kSplit)
  // bf16 P is split into a high and a low bf16 part and multiplied twice; kOnce rounds
  // it once (docs/p-rounding.md). fp16's 11 bits need no split.
  static constexpr bool kSplitP = kDType == DType::kBF16 && kPRounding == PRounding::kSplit;
};

// A100: 164 KB per SM, 1 KB reserved per CTA; 2 CTAs must fit for the 16- and 32-row
// tiles, one for the 64-row tile's A100 plan; its SM90 plan must fit SM90's 227 KB per
// CTA.
static_assert(2 * (sizeof(SharedMemoryPlan<16>) + 1024) <= 164 * 1024, "16-row tile: 2 CTAs on A100");
static_assert(2 * (sizeof(SharedMemoryPlan<32>) + 1024) <= 164 * 1024, "32-row tile: 2 CTAs on A100");
static_assert(sizeof(PlanOf<64, KvDType::kModel, false, true, DType::kBF16>) + 1024 <= 164 * 1024 &&
                  sizeof(PlanOf<64, KvDType::kModel, false, true, DType::kFP16>) + 1024 <= 164 * 1024 &&
                  sizeof(PlanOf<64, KvDType::kFp8E4M3, false, true, DType::kBF16>) + 1024 <= 164 * 1024,
              "64-row tile, A100 plan: 1 CTA on A100, 16-bit and FP8 caches");
static_assert(sizeof(PlanOf<64, KvDType::kModel, false, false, DType::kBF16>) <= 227 * 1024 &&
                  sizeof(PlanOf<64, KvDType::kModel, false, false, DType::kFP16>) <= 227 * 1024,
              "64-row tile, SM90 plan: within SM90's 227 KB per CTA");
static_assert(sizeof(PlanOf<64, KvDType::kFp8E4M3, false, false>) <= 227 * 1024,
              "fp8 64-row tile, SM90 plan: within SM90's 227 KB per CTA");
// FP8 in place shares the 16-bit plan (2 CTAs on A100 above); converted in registers,
// the 16-row tile keeps 2 CTAs on A100 too.
static_assert(2 * (sizeof(Fp8RegsSharedMemoryPlan<16>) + 1024) <= 164 * 1024,
              "fp8 16-row tile converted in registers: 2 CTAs on A100");

}  // namespace latentd::kernels::sm80
