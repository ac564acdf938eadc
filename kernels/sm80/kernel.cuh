// The SM80 MLA decode kernel: one CTA per (row tile, split-K partition, sequence x KV
// head). cp.async stages KV tiles through XOR-swizzled shared memory, ldmatrix feeds
// mma.sync.m16n8k16, and an fp32 online softmax runs on the accumulator fragments.
// Included only by the one-line instantiation files kernels/sm80/decode_*.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/kv_fp8.h"
#include "kernels/params.h"
#include "kernels/sm80/config.h"
#include "kernels/sm80/launch.h"
#include "kernels/sm80/traits.h"

namespace latentd::kernels::sm80 {
namespace detail {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy, bypassing L1 (KV is streamed once). src_bytes 0 fills
// the destination with zeros without reading src: keys past the end never touch memory
// (unowned cache rows hold NaN).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
// Barrier `id` (1 + group) over the 128 threads of one group of 4 warps; barrier 0 is
// __syncthreads.
__device__ __forceinline__ void GroupSync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
// The same barrier, returning whether `v` was true in any of the group's threads.
__device__ __forceinline__ bool GroupAny(int id, bool v) {
  int r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.s32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(int(v)), "r"(id), "n"(kThreads)
      : "memory");
  return r != 0;
}
// Named barrier `id` over `n` threads: wait for all n (sync), or count this thread in and
// go on (arrive), the producer/consumer pair of the 64-row tile's ping-pong.
__device__ __forceinline__ void BarSync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void BarArrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void Ldmatrix4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void Ldmatrix4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <DType kDType>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kDType == DType::kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// 2^x on the SFU alone. Results below 2^-126 flush to zero: they are P values or
// rescale factors under 2^-126 of the running max, whose rows' sums are >= 1, so they
// change no output; exp2f would spend three more instructions keeping them subnormal.
__device__ __forceinline__ float Exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// Two floats -> two 16-bit values in one register (lo in the low half).
template <DType kDType>
__device__ __forceinline__ uint32_t Pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (kDType == DType::kBF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    r = *reinterpret_cast<uint32_t*>(&v);
  }
  return r;
}

// Low part of a bf16 split: x - bf16(x), so that bf16(x) + PackLow(x) carries ~16 bits.
__device__ __forceinline__ uint32_t PackLowBf16(float lo, float hi, uint32_t packed_high) {
  const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&packed_high);
  const float2 f = __bfloat1622float2(h);
  __nv_bfloat162 v = __floats2bfloat162_rn(lo - f.x, hi - f.y);
  return *reinterpret_cast<uint32_t*>(&v);
}

// FP8 cache (kernels/kv_fp8.h): two e4m3 codes in bits 8-15 and 24-31 of y become two
// 16-bit values by moving their bits into place: x * 2^-120 as bf16, x * 2^-8 as fp16
// (subnormal codes included), exactly. One fma by 2^(e+120) (2^(e+8)) then applies the
// block scale 2^e, also exactly. So the kernel computes with the same 16-bit values the
// CPU implementation dequantizes to (DequantizeKvRowFp8).
template <DType kDType>
__device__ __forceinline__ uint32_t E4m3PairBits(uint32_t y) {
  if constexpr (kDType == DType::kBF16) {
    return (y & 0x80008000u) | ((y >> 4) & 0x07f007f0u);
  } else {
    return (y & 0x80008000u) | ((y >> 1) & 0x3f803f80u);
  }
}
// The block scale's multiplier as a pair of 16-bit values, from the float32 scale's bits.
template <DType kDType>
__device__ __forceinline__ uint32_t Fp8ScalePair(uint32_t scale_bits) {
  // Stored scales are 2^e with e in [Fp8MinExponent, 7]; the clamp only keeps rows no
  // sequence owns (zero-filled past the end) finite.
  const int e_biased = static_cast<int>((scale_bits >> 23) & 0xffu);  // e + 127
  uint32_t h;
  if constexpr (kDType == DType::kBF16) {
    h = static_cast<uint32_t>(min(max(e_biased, 127 - 119), 127 + kFp8MaxExponent) + 120) << 7;
  } else {
    h = static_cast<uint32_t>(min(max(e_biased, 127 - 22), 127 + kFp8MaxExponent) - 104) << 10;
  }
  return h | (h << 16);
}
template <DType kDType>
__device__ __forceinline__ uint32_t Fma2NegZero(uint32_t a, uint32_t b) {
  uint32_t r;
  if constexpr (kDType == DType::kBF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  }
  return r;
}
// The transpose of an 8x8 matrix of 16-bit values held in mma fragment order (lane l:
// row l / 4, columns 2 (l % 4) and +1), in the same order.
__device__ __forceinline__ uint32_t MovTrans(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}
// 16 e4m3 codes (one 16-byte chunk, one block) -> 16 values in two 16-byte chunks.
template <DType kDType>
__device__ __forceinline__ void DequantChunk(const uint4& raw, uint32_t scale_pair, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = Fma2NegZero<kDType>(E4m3PairBits<kDType>(__byte_perm(w[i], 0u, 0x1404)), scale_pair);
    o[2 * i + 1] = Fma2NegZero<kDType>(E4m3PairBits<kDType>(__byte_perm(w[i], 0u, 0x3424)), scale_pair);
  }
  lo = make_uint4(o[0], o[1], o[2], o[3]);
  hi = make_uint4(o[4], o[5], o[6], o[7]);
}

// Element offset of (row, 16-byte chunk) in a [rows][576] swizzled tile. A row is 72
// chunks = 1152 bytes, a multiple of 128, so without the XOR the 8 rows of an ldmatrix
// would all hit the same banks.
__device__ __forceinline__ int Swizzle(int row, int chunk) {
  return row * kHeadDimQK + (((chunk & ~7) | ((chunk ^ row) & 7)) << 3);
}
// The same swizzle for rows of kChunks chunks (a multiple of 8): the Q tile, which keeps
// fewer than 72 chunks per row when some of Q lives in registers.
template <int kChunks>
__device__ __forceinline__ int SwizzleRow(int row, int chunk) {
  static_assert(kChunks % 8 == 0, "whole 128-byte groups per row");
  return row * kChunks * 8 + (((chunk & ~7) | ((chunk ^ row) & 7)) << 3);
}

}  // namespace detail

// Warps come in groups of 4 (Cfg::kGroups of them): a group owns kRows / kGroups rows
// of the tile, and its warp gw takes dims 144 gw .. 144 gw + 143 of QK^T and output
// columns 128 gw .. 128 gw + 127 of PV. The groups share the KV stages.
//
// With an FP8 cache (kKv == kFp8E4M3) the same stages first receive a tile's raw rows
// (656 bytes each, packed at the stage's end); after the copy lands, the CTA dequantizes
// them in place, through registers, into the swizzled 16-bit layout the mma loops read.
// Each value is dequantized once per CTA, and shared memory stays as for a 16-bit cache.
// The 64-row tile's SM90 plan instead lands raw rows in a ring of their own and converts
// tile t+1 during tile t's PV loop (TileConfig::kFp8DequantAhead).
//
// kRegsPipe (FP8, 16-row tile, DecodePlan::fp8_pipeline == kRegisters): the codes are
// converted in registers straight into the mma fragments (3a769b8; see kRegs below).
// kPRounding: how bf16 P is rounded for the PV mma (kernels/params.h, PRounding).
template <DType kDType, int kRows, KvDType kKv, bool kRegsPipe, bool kSm80Plan, PRounding kPRounding>
__global__ void __launch_bounds__(kCtaThreads<kRows>, kKv == KvDType::kFp8E4M3
                                                          ? TileConfig<kRows>::kFp8MinCtasPerSm
                                                          : TileConfig<kRows>::kMinCtasPerSm)
    MlaDecodeKernel(const DecodeArgs args) {
  using namespace detail;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A combine kernel launched after this one as a programmatic dependent may start now:
  // it waits (griddepcontrol.wait) for this grid's completion before reading anything.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  using Cfg = TileConfig<kRows>;
  // The A100 plan (kSm80Plan) keeps the 64-row tile within 163 KB (traits.h).
  constexpr bool kA100Plan = kSm80Plan;
  // FP8, dequantized one tile ahead inside the PV loop (TileConfig::kFp8DequantAhead).
  constexpr bool kFp8Ahead = kKv == KvDType::kFp8E4M3 && kFp8AheadOf<kRows, kA100Plan>;
  // FP8 converted in registers (TileConfig::kFp8Regs, the 16-row tile; 3a769b8). Warp w's
  // QK^T dims are the latent block it owns for PV (128 w .. 128 w + 127) plus rope dims
  // 16 w .. 16 w + 15. A lane's 16-byte load of its key's codes gives four 4-code words;
  // a word's codes (dims d .. d+3) become two 16-bit pairs, (d, d+2) and (d+1, d+3), which
  // are the B fragment of one k-step as they are: the k order within the warp's dims is
  // permuted, and Q's A fragments are loaded in the same order. movmatrix transposes each
  // pair register into the V fragment of the PV, whose n8 tiles therefore hold columns
  // d, d+2 (and d+1, d+3): the epilogue writes them back in place.
  constexpr bool kRegs = kUsesFp8Regs<kRows, kKv, kRegsPipe>;
  static_assert(kRegs == kRegsPipe, "conversion in registers: FP8 caches on the 16-row tile only");
  using Plan = PlanOf<kRows, kKv, kRegsPipe, kA100Plan, kDType>;
  constexpr int kCta = kCtaThreads<kRows>;
  constexpr int kN = Cfg::kKeys;
  // Copies in flight + 1.
  constexpr int kStages = kRegs ? Cfg::kFp8RegStages : Cfg::kStages;
  // Tiles whose copies are issued ahead of the one computed: one more when dequantizing
  // ahead (tile t+1 must have landed while tile t is computed).
  constexpr int kAhead = kFp8Ahead ? kStages : kStages - 1;
  // Ping-pong (TileConfig::kPingPong, 16-bit caches): group 1 alone copies the KV tiles
  // and runs up to half a tile behind group 0, the two synchronised by producer/consumer
  // barriers instead of one CTA barrier per tile, so one group's softmax and barriers
  // overlap the other's mma (be5ae71).
  constexpr bool kPingPong = Cfg::kPingPong && kKv == KvDType::kModel;
  static_assert(!kPingPong || (Cfg::kGroups == 2 && kStages == 2), "ping-pong: two groups, two stages");
  constexpr int kGroupRows = kRows / Cfg::kGroups;
  constexpr int kMT = kGroupRows / 16;  // m16 tiles per warp (each warp covers its group's rows)
  constexpr int kNT = kN / 8;           // n8 score tiles per KV tile
  constexpr int kKSteps = kDimsPerWarp / 16;  // 9
  constexpr int kVT = kColsPerWarp / 8;       // 16 n8 output tiles per warp
  // k-steps of each warp's Q slice held in registers (all of them for the 16-row tile).
  constexpr int kQRegSteps = kQRegStepsOf<kRows, kKv, kA100Plan, kDType>;  // with Q in shared memory
  constexpr int kRegSteps = Cfg::kQInRegisters ? kKSteps : kQRegSteps;
  static_assert(!Cfg::kQInRegisters || kMT == 1, "Q fully in registers only for one m-tile");
  static_assert(kPageSize % kN == 0, "a KV tile must not straddle pages");
  static_assert((kN * (kHeadDimQK / 8)) % kCta == 0, "KV tile copy must divide evenly");
  constexpr bool kFp8 = kKv == KvDType::kFp8E4M3;
  constexpr int kRawChunks = kFp8RowBytes / 16;               // 41 per row
  constexpr int kDequantItems = kN * (kHeadDimV / 16 + 8);    // 32 latent + 8 rope chunks per row
  static_assert(!kFp8 || kDequantItems % kCta == 0, "dequantization must divide evenly");
  // Raw rows at the end of their stage. Key k's values (bytes [1152 k, 1152 k + 1152))
  // overlap no raw row of a key >= k while k <= kN - 3, which the first dequantization
  // pass (the first half of the keys) relies on.
  constexpr int kRawOffset = kN * (kHeadDimQK * 2 - kFp8RowBytes);
  static_assert(kRawOffset % 16 == 0, "raw rows stay 16-byte aligned");
  // Items per thread per in-place pass: 2 on the 32-row tile (one pass spills there),
  // kTile64Sm80Fp8Passes on the 64-row tile (its A100 plan; the SM90 plan dequantizes
  // ahead). The 16-row tile converts its own chunks instead (kOwn).
  constexpr int kInPlacePasses = kRows == 64 ? kTile64Sm80Fp8Passes : 2;
  // FP8 in place, 16-row tile (f0bd541, 2ddcd90): each thread converts
  // exactly the raw chunks it copied, so it reads them as soon as its own copies have
  // landed, before the tile's first barrier, which then also orders every read before
  // any write: one barrier per tile fewer. Each of a key's kCta / kN threads copies the
  // key's scale chunk into a slot of its own.
  // Where key k's pieces land in its 16-bit row of the stage ([1152 k, 1152 k + 1152)):
  // its rope values (16-bit already) straight in their final, swizzled place (bytes
  // 1024-1151); its 512 raw latent codes in bytes 512-1023; the scale slots of its four
  // threads in bytes 0-63. The latent values written after the barrier cover bytes
  // 0-1023, raw codes and slots alike, once every thread has read its own.
  constexpr bool kOwn = kFp8 && !kFp8Ahead && !kRegs && kRows == 16;
  static_assert(!kRegs || (kRows == 16 && kN == 32 && kCta == 128 && Cfg::kQInRegisters && kHeadDimV == 128 * kWarps &&
                           kFp8BlockValues == 128 && kStages >= 2),
                "conversion in registers: the 16-row tile, 32-key tiles, one scale block per warp");
  constexpr int kOwnT = kCta / kN;                  // threads per raw row
  constexpr int kOwnItems = kHeadDimV / 16 / kOwnT;  // latent chunks per thread
  constexpr int kOwnRawAt = kHeadDimV;              // raw latent codes: byte 512 of the 16-bit row
  static_assert(!kOwn || (kOwnT == 4 && kOwnItems == 8), "own chunks: 4 threads per row, 8 latent chunks each");
  static_assert(kFp8ScaleOffset == 32 * 16 && kFp8RopeOffset == 33 * 16, "raw row: 32 latent chunks, scales, rope");
  static_assert(kOwnT * 16 <= kOwnRawAt && kOwnRawAt + kHeadDimV <= kHeadDimV * 2,
                "scale slots, raw codes and rope apart within a 16-bit row");
  constexpr int kFp8InPlacePassItems = (kDequantItems / kCta + kInPlacePasses - 1) / kInPlacePasses;
  static_assert(!kFp8 || (kDequantItems / kCta - 1) / kFp8InPlacePassItems * kFp8InPlacePassItems * kCta /
                                 (kHeadDimV / 16 + 8) <= kN - 3,
                "every pass but the last clear of later passes' raw rows");

  extern __shared__ __align__(128) uint8_t smem_raw[];
  Plan& sm = *reinterpret_cast<Plan*>(smem_raw);

  const MlaDecodeParams& p = args.p;
  const int tid = threadIdx.x, lane = tid & 31;
  const int grp = tid >> 7, warp = (tid >> 5) & 3;  // group, and warp within the group
  const int grow0 = grp * kGroupRows;                 // the group's first row in the tile
  const int tile = blockIdx.x, split = blockIdx.y;
  const int b = blockIdx.z / p.h_kv, kvh = blockIdx.z % p.h_kv;
  const int seqlen = p.seqlens[b];
  const int kps = args.keys_per_split;
  const int n_valid = (seqlen + kps - 1) / kps;
  if (split > 0 && split >= n_valid) return;  // nothing here; combine ignores it
  const bool direct = n_valid <= 1;            // the only partition writes out/lse itself
  const int group = p.h_q / p.h_kv;
  const int rows_kv = group * p.s_q;  // rows sharing this KV head
  const int row0 = tile * kRows;
  const int last_row = min(rows_kv, row0 + kRows) - 1;
  const int key_begin = split * kps;
  const int key_end = min(seqlen, key_begin + kps);
  // Query token i sees keys below seqlen - s_q + i + 1 when causal.
  auto limit_of = [&](int token) { return p.causal ? seqlen - p.s_q + token + 1 : seqlen; };
  const int lim_min = limit_of(row0 / group);
  const int cta_end = min(key_end, limit_of(last_row / group));
  const int num_tiles = cta_end > key_begin ? (cta_end - key_begin + kN - 1) / kN : 0;

  const auto* kv = static_cast<const uint16_t*>(p.kv);
  const int32_t* table = p.block_table + int64_t(b) * p.block_table_batch_stride;
  const int64_t kv_head_off = int64_t(kvh) * p.kv_head_stride;

  // Page of KV tile t (a tile never straddles pages).
  auto page_of = [&](int t) { return table[(key_begin + t * kN) / kPageSize]; };
  // Copies KV tile t (on `page`) into stage s: kN keys x 72 chunks over all threads
  // (with the ping-pong, over group 1's).
  // Each thread copies whole 128-byte-strided runs of one row, so its copies are one
  // source and one destination address plus constants (00df7d8: the per-chunk index
  // math was ~15% of the loop's instructions). A tile never straddles a page, so its
  // keys' page offsets are key0 % 64 + key without wrapping. Keys past cta_end copy
  // nothing (zero fill) from within row 0 of page 0, never from an unowned row.
  auto load_tile = [&](int t, int s, int page) {
    const int key0 = key_begin + t * kN;
    const int page_key0 = key0 & (kPageSize - 1);
    if constexpr (kFp8) {
      // kCta / kN threads per raw row; thread c of a row takes its chunks c, c + T, ...
      constexpr int kT = kCta / kN;
      static_assert(kT * kN == kCta, "whole threads per raw row");
      const auto* kv8 = static_cast<const uint8_t*>(p.kv);
      uint32_t dst0 = 0;
      if constexpr (kRegs) {
      } else if constexpr (kFp8Ahead) {
        dst0 = SmemAddr(&sm.raw[s][0][0]);
      } else {
        dst0 = SmemAddr(&sm.kv[s][0][0]) + kRawOffset;
      }
      const int key = tid / kT, c = tid % kT;
      const bool valid = key0 + key < cta_end;
      const uint8_t* src = valid ? kv8 + int64_t(page) * p.kv_page_stride + kv_head_off +
                                       int64_t(page_key0 + key) * p.kv_row_stride + c * 16
                                 : kv8;
      const uint32_t dst = dst0 + key * kFp8RowBytes + c * 16;
      if constexpr (kRegs) {
        // Chunk c + 4 j of the row (41 of them) to its place in the stage's pieces
        // (Fp8RegsSharedMemoryPlan): latent, scales, or rope.
        const uint8_t* row_src = src - c * 16;
#pragma unroll
        for (int j = 0; j < (kRawChunks + kT - 1) / kT; ++j) {
          const int q = c + kT * j;
          uint32_t d;
          if (q < kHeadDimV / 16) {
            d = SmemAddr(&sm.kv[s][key][0]) + ((q ^ ((key & 1) << 2)) << 4);
          } else if (q == kFp8ScaleOffset / 16) {
            d = SmemAddr(&sm.scales[s][key][0]);
          } else if (q < kRawChunks) {
            d = SmemAddr(&sm.rope[s][key][0]) + (((q - kFp8RopeOffset / 16) ^ (key & 7)) << 4);
          } else {
            break;
          }
          CpAsync16(d, row_src + q * 16, valid);
        }
      } else if constexpr (kOwn) {
        // Latent chunks c, c + 4, ..., c + 28 (raw), rope chunks c and c + 4 (in place),
        // and the row's scales into this thread's slot (layout above kOwn).
        const uint8_t* row_src = src - c * 16;
        const uint32_t row16 = SmemAddr(&sm.kv[s][0][0]) + key * (kHeadDimQK * 2);
#pragma unroll
        for (int i = 0; i < kOwnItems; ++i)
          CpAsync16(row16 + kOwnRawAt + (c + 4 * i) * 16, row_src + (c + 4 * i) * 16, valid);
#pragma unroll
        for (int r = c; r < 8; r += 4)
          CpAsync16(SmemAddr(&sm.kv[s][0][0]) + Swizzle(key, kHeadDimV / 8 + r) * 2, row_src + kFp8RopeOffset + r * 16,
                    valid);
        CpAsync16(row16 + c * 16, row_src + kFp8ScaleOffset, valid);
      } else {
#pragma unroll
        for (int j = 0; j < (kRawChunks + kT - 1) / kT; ++j) {
          if ((kRawChunks % kT) != 0 && j == kRawChunks / kT && c >= kRawChunks % kT) break;
          CpAsync16(dst + j * kT * 16, src + j * kT * 16, valid);
        }
      }
    } else {
      // 8 threads per row, each its chunks c + 8 j (j = 0..8): the swizzle permutes only
      // within 8-chunk groups, so chunk c + 8 j lands 128 j bytes after chunk c. With the
      // ping-pong, group 1's 128 threads copy the whole tile.
      constexpr int kLoaders = kPingPong ? kThreads : kCta;
      constexpr int kKeysPerPass = kLoaders / 8;
      static_assert(kN % kKeysPerPass == 0, "whole passes of rows");
      const int ltid = tid % kLoaders;
      const uint32_t dst0 = SmemAddr(&sm.kv[s][0][0]);
      const int c = ltid & 7;
#pragma unroll
      for (int pass = 0; pass < kN / kKeysPerPass; ++pass) {
        const int key = pass * kKeysPerPass + (ltid >> 3);
        const bool valid = key0 + key < cta_end;
        const uint16_t* src = valid ? kv + int64_t(page) * p.kv_page_stride + kv_head_off +
                                          int64_t(page_key0 + key) * p.kv_row_stride + c * 8
                                    : kv;
        const uint32_t dst = dst0 + Swizzle(key, c) * 2;
#pragma unroll
        for (int j = 0; j < kHeadDimQK / 64; ++j) CpAsync16(dst + j * 128, src + j * 64, valid);
      }
    }
  };

  // Query row r of this tile -> (token, head) -> element offset in q.
  auto q_row_ptr = [&](int r) -> const uint16_t* {
    const int row = row0 + r;
    const int token = row / group, head = kvh * group + row % group;
    return static_cast<const uint16_t*>(p.q) + int64_t(b) * p.q_batch_stride + int64_t(token) * p.q_seq_stride +
           int64_t(head) * p.q_head_stride;
  };

  // Q: registers (16-row tile: all of it; 64-row tile: each warp's first kQRegSteps
  // k-steps, loaded below) and shared memory (the rest, copied here). In shared memory
  // a row holds, warp slice after warp slice, the k-steps not in registers.
  uint32_t qf[kRegSteps > 0 ? kRegSteps : 1][kMT][4];
  if constexpr (!Cfg::kQInRegisters) {
    constexpr int kQC = Plan::kQChunks, kSliceChunks = kQC / kWarps;
    const uint32_t dst0 = SmemAddr(&sm.q[0][0]);
    for (int id = tid; id < kRows * kQC; id += kCta) {
      const int r = id / kQC, chunk = id % kQC;
      const int w = chunk / kSliceChunks, c = chunk % kSliceChunks;
      const int dim = w * kDimsPerWarp + (kQRegSteps + c / 2) * 16 + (c & 1) * 8;
      const bool valid = row0 + r < rows_kv;
      const uint16_t* src = valid ? q_row_ptr(r) + dim : static_cast<const uint16_t*>(p.q);
      CpAsync16(dst0 + SwizzleRow<kQC>(r, chunk) * 2, src, valid);
    }
  }

  // Pipeline prologue. Q's copies (shared-memory Q) join the first group; Q in registers
  // is loaded after the first KV copies are in flight.
#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (s < num_tiles && (!kPingPong || grp == 1)) load_tile(s, s % kStages, page_of(s));
    CpAsyncCommit();
  }
  // Page of the next tile to copy, read one iteration ahead so the block-table load is
  // off the copy-issue path.
  int next_page = kAhead < num_tiles ? page_of(kAhead) : 0;

  // Dequantizing ahead: part `part` (0-8) of a thread's share of raw stage `st` into
  // 16-bit stage `st`. Parts 0-7: 8 latent values (half a scale block's 16-byte chunk)
  // of key warp + 8 (part / 2), output chunk lane + 32 (part % 2), so a warp reads 256
  // contiguous raw bytes and writes 32 whole chunks of one row (conflict-free); part 8:
  // one 16-byte chunk of the rope values, copied. 8 warps x 4 keys = the 32 keys.
  static_assert(!kFp8Ahead || (kCta == 256 && kN == 32), "dequantization ahead: 8 warps over 32-key tiles");
  auto dequant_part = [&](int part, int st) {
    if constexpr (kFp8Ahead) {
      const uint8_t* raw = &sm.raw[st][0][0];
      uint16_t* dst = &sm.kv[st][0][0];
      if (part < 8) {
        const int key = (tid >> 5) + 8 * (part >> 1), c = lane + 32 * (part & 1);
        const uint8_t* row = raw + key * kFp8RowBytes;
        const uint2 codes = *reinterpret_cast<const uint2*>(row + c * 8);
        const uint32_t sp = Fp8ScalePair<kDType>(
            *reinterpret_cast<const uint32_t*>(row + kFp8ScaleOffset + (c * 8 / kFp8BlockValues) * 4));
        uint4 o;
        o.x = Fma2NegZero<kDType>(E4m3PairBits<kDType>(__byte_perm(codes.x, 0u, 0x1404)), sp);
        o.y = Fma2NegZero<kDType>(E4m3PairBits<kDType>(__byte_perm(codes.x, 0u, 0x3424)), sp);
        o.z = Fma2NegZero<kDType>(E4m3PairBits<kDType>(__byte_perm(codes.y, 0u, 0x1404)), sp);
        o.w = Fma2NegZero<kDType>(E4m3PairBits<kDType>(__byte_perm(codes.y, 0u, 0x3424)), sp);
        *reinterpret_cast<uint4*>(dst + Swizzle(key, c)) = o;
      } else {
        const int key = tid >> 3, c = tid & 7;
        *reinterpret_cast<uint4*>(dst + Swizzle(key, kHeadDimV / 8 + c)) =
            *reinterpret_cast<const uint4*>(raw + key * kFp8RowBytes + kFp8RopeOffset + c * 16);
      }
    }
  };
  if constexpr (kFp8Ahead) {
    // Tile 0 (and Q) landed: dequantize it before the loop; the loop's first barrier
    // publishes it.
    CpAsyncWait<kAhead - 1>();
    __syncthreads();
    if (num_tiles > 0)
#pragma unroll
      for (int part = 0; part < 9; ++part) dequant_part(part, 0);
  }
  int ahead_stage = 1;  // the 16-bit stage tile t+1 is dequantized into during tile t

  // Q in registers: this warp's first kRegSteps k-steps in A-fragment order.
  if constexpr (kRegSteps > 0) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const int r = grow0 + mt * 16 + (lane >> 2), c = (lane & 3) * 2;
      const bool v0 = row0 + r < rows_kv, v1 = row0 + r + 8 < rows_kv;
      const uint16_t* q0 = v0 ? q_row_ptr(r) : nullptr;
      const uint16_t* q1 = v1 ? q_row_ptr(r + 8) : nullptr;
      if constexpr (kRegs) {
        // k-step 4 H + j: dims d .. d+3, d = 128 warp + 64 H + 16 (lane % 4) + 4 j, as the
        // pairs (d, d+2) and (d+1, d+3) (the K fragments' order); k-step 8: rope dims.
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          const int d = warp * kColsPerWarp + (ks >> 2) * 64 + (lane & 3) * 16 + (ks & 3) * 4;
          const uint32_t u00 = v0 ? *reinterpret_cast<const uint32_t*>(q0 + d) : 0u;
          const uint32_t u01 = v0 ? *reinterpret_cast<const uint32_t*>(q0 + d + 2) : 0u;
          const uint32_t u10 = v1 ? *reinterpret_cast<const uint32_t*>(q1 + d) : 0u;
          const uint32_t u11 = v1 ? *reinterpret_cast<const uint32_t*>(q1 + d + 2) : 0u;
          qf[ks][mt][0] = __byte_perm(u00, u01, 0x5410);
          qf[ks][mt][1] = __byte_perm(u10, u11, 0x5410);
          qf[ks][mt][2] = __byte_perm(u00, u01, 0x7632);
          qf[ks][mt][3] = __byte_perm(u10, u11, 0x7632);
        }
        const int d = kHeadDimV + warp * 16 + c;
        qf[8][mt][0] = v0 ? *reinterpret_cast<const uint32_t*>(q0 + d) : 0u;
        qf[8][mt][1] = v1 ? *reinterpret_cast<const uint32_t*>(q1 + d) : 0u;
        qf[8][mt][2] = v0 ? *reinterpret_cast<const uint32_t*>(q0 + d + 8) : 0u;
        qf[8][mt][3] = v1 ? *reinterpret_cast<const uint32_t*>(q1 + d + 8) : 0u;
      } else {
#pragma unroll
        for (int ks = 0; ks < kRegSteps; ++ks) {
          const int d = warp * kDimsPerWarp + ks * 16 + c;
          qf[ks][mt][0] = v0 ? *reinterpret_cast<const uint32_t*>(q0 + d) : 0u;
          qf[ks][mt][1] = v1 ? *reinterpret_cast<const uint32_t*>(q1 + d) : 0u;
          qf[ks][mt][2] = v0 ? *reinterpret_cast<const uint32_t*>(q0 + d + 8) : 0u;
          qf[ks][mt][3] = v1 ? *reinterpret_cast<const uint32_t*>(q1 + d + 8) : 0u;
        }
      }
    }
  }

  // Per-thread rows: m-tile mt, half h -> tile row grow0 + mt*16 + lane/4 + 8h.
  int row_limit[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(row0 + grow0 + mt * 16 + (lane >> 2) + 8 * h, rows_kv - 1);
      row_limit[mt][h] = limit_of(row / group);
    }

  float acc[kMT][kVT][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int j = 0; j < kVT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;
  float m_run[kMT][2], l_run[kMT][2];  // running max (log2 domain, scaled) and partial sum
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_run[mt][h] = -INFINITY;
      l_run[mt][h] = 0.f;
    }
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;

  // bf16 keeps 8 bits of P: with few dominant keys that alone is an output error of
  // ~2^-9 |v|, beyond the split contract's tolerance, so by default (PRounding::kSplit)
  // bf16 P is split into a high and a low bf16 part and multiplied twice; kOnce rounds
  // it once (docs/p-rounding.md). fp16's 11 bits need no split.
  constexpr bool kSplitP = kDType == DType::kBF16 && kPRounding == PRounding::kSplit;
  // O[:, my 128 columns] += P[:, keys 16 kk .. 16 kk + 15] V[those keys, my columns],
  // P as A fragments (pa, and pl its low part for bf16).
  // Converted in registers (kRegs): the tile's V fragments, [8-key block][half of the
  // warp's 128 columns][k-step of the half][pair (d, d+2) or (d+1, d+3)], each the
  // movmatrix transpose of a K fragment; n8 output tile 8 H + 2 j + pair.
  uint32_t vfr[kRegs ? kNT : 1][2][4][2];
  auto pv_kstep = [&](int kk, const uint32_t(&pa)[kMT][4], const uint32_t(&pl)[kSplitP ? kMT : 1][4],
                      uint32_t kv_base) {
    if constexpr (kRegs) {
#pragma unroll
      for (int i = 0; i < kVT; ++i) {
        const uint32_t b0 = vfr[kRegs ? 2 * kk : 0][(i >> 3) & 1][(i >> 1) & 3][i & 1];
        const uint32_t b1 = vfr[kRegs ? 2 * kk + 1 : 0][(i >> 3) & 1][(i >> 1) & 3][i & 1];
        Mma<kDType>(acc[0][i], pa[0], b0, b1);
        if constexpr (kSplitP) Mma<kDType>(acc[0][i], pl[0], b0, b1);
      }
      return;
    }
    const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int np = 0; np < kVT / 2; ++np) {
      if constexpr (kFp8Ahead) {
        // Tile t+1's dequantization between the mma: parts 0-7 on even steps of the 16,
        // the rope copy on the last.
        static_assert(kVT == 16 && kNT == 4, "16 PV steps per tile");
        const int step = kk * (kVT / 2) + np;
        if (step % 2 == 0) dequant_part(step / 2, ahead_stage);
        if (step == 15) dequant_part(8, ahead_stage);
      }
      uint32_t vb[4];
      Ldmatrix4Trans(vb, kv_base + Swizzle(key, warp * (kColsPerWarp / 8) + np * 2 + (lane >> 4)) * 2);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        Mma<kDType>(acc[mt][2 * np], pa[mt], vb[0], vb[1]);
        Mma<kDType>(acc[mt][2 * np + 1], pa[mt], vb[2], vb[3]);
        if constexpr (kSplitP) {
          Mma<kDType>(acc[mt][2 * np], pl[mt], vb[0], vb[1]);
          Mma<kDType>(acc[mt][2 * np + 1], pl[mt], vb[2], vb[3]);
        }
      }
    }
  };

  if constexpr (kPingPong) {
    // Tile 0 (copied by all, with Q) visible to all; then group 1 copies tile 1.
    CpAsyncWait<0>();
    __syncthreads();
    if (grp == 1 && 1 < num_tiles) load_tile(1, 1, next_page);
    CpAsyncCommit();
    if (2 < num_tiles) next_page = page_of(2);
  }
  // Ping-pong barriers (kPingPong), by tile parity: FULL (group 1 arrives once its
  // copies of the tile have landed; group 0 waits) and EMPTY (group 0 arrives when done
  // with the tile; group 1 waits before copying tile t+2 into its stage).
  constexpr int kFullBar = 3, kEmptyBar = 5;
  uint4 own_raw[kOwn ? kOwnItems : 1], own_scales;  // kOwn: this thread's raw chunks of the tile
  for (int t = 0; t < num_tiles; ++t) {
    if constexpr (kPingPong) {
      if (grp == 0 && t > 0) BarSync(kFullBar + (t & 1), kCta);
    } else {
      // Dequantizing ahead: tile t+1's raw rows must have landed (they are converted during
      // this tile); otherwise tile t's.
      CpAsyncWait<kFp8Ahead ? 0 : kStages - 2>();
      if constexpr (kOwn) {
        // This thread's own copies of tile t have landed: read them now, so that the
        // barrier below also orders every raw read before the values are written.
        const int key = tid / kOwnT, c = tid % kOwnT;
        const uint8_t* row16 = reinterpret_cast<const uint8_t*>(&sm.kv[t % kStages][key][0]);
#pragma unroll
        for (int i = 0; i < kOwnItems; ++i)
          own_raw[i] = *reinterpret_cast<const uint4*>(row16 + kOwnRawAt + (c + 4 * i) * 16);
        own_scales = *reinterpret_cast<const uint4*>(row16 + c * 16);
      }
      __syncthreads();  // tile t visible to all; every warp is done with tile t-1's stage
      if (t + kAhead < num_tiles) load_tile(t + kAhead, (t + kAhead) % kStages, next_page);
      CpAsyncCommit();
      if (t + kAhead + 1 < num_tiles) next_page = page_of(t + kAhead + 1);
    }
    // On the last tile the conversion runs on whatever raw stage (t+1) % 2 holds, into a
    // stage nobody reads again: it keeps the PV loop free of a branch.
    ahead_stage = (t + 1) % kStages;
    const int stage = t % kStages;
    const uint32_t kv_base = SmemAddr(&sm.kv[stage][0][0]);
    if constexpr (kOwn) {
      // This thread's latent chunks c + 4 i of row key (scale block i / 2); the rope
      // values landed in place.
      uint16_t* tile_elems = &sm.kv[stage][0][0];
      const int key = tid / kOwnT, c = tid % kOwnT;
      const uint32_t scale_word[4] = {own_scales.x, own_scales.y, own_scales.z, own_scales.w};
#pragma unroll
      for (int i = 0; i < kOwnItems; ++i) {
        const int j = c + 4 * i;
        uint4 lo, hi;
        DequantChunk<kDType>(own_raw[i], Fp8ScalePair<kDType>(scale_word[i / 2]), lo, hi);
        *reinterpret_cast<uint4*>(tile_elems + Swizzle(key, 2 * j)) = lo;
        *reinterpret_cast<uint4*>(tile_elems + Swizzle(key, 2 * j + 1)) = hi;
      }
      __syncthreads();
    } else if constexpr (kFp8 && !kFp8Ahead && !kRegs) {
      // Raw rows -> registers, sync, dequantized values -> the same stage; in passes of
      // kPassItems items per thread, to bound the registers it takes. The raw rows sit at
      // the stage's end (kRawOffset), so a pass's values never land on a later pass's
      // raw rows (static_assert above).
      constexpr int kPer = kDequantItems / kCta, kItemsPerRow = kHeadDimV / 16 + 8;
      constexpr int kPassItems = kFp8InPlacePassItems;
      const uint8_t* raw_rows = reinterpret_cast<const uint8_t*>(&sm.kv[stage][0][0]) + kRawOffset;
      uint16_t* tile_elems = &sm.kv[stage][0][0];
#pragma unroll 1
      for (int first = 0; first < kPer; first += kPassItems) {
        uint4 raw[kPassItems];
        uint32_t scale_bits[kPassItems];
#pragma unroll
        for (int i = 0; i < kPassItems; ++i) {
          if (first + i >= kPer) break;
          const int id = tid + (first + i) * kCta, key = id / kItemsPerRow, c = id % kItemsPerRow;
          const uint8_t* row = raw_rows + key * kFp8RowBytes;
          raw[i] = *reinterpret_cast<const uint4*>(row + (c < 32 ? c * 16 : kFp8RopeOffset + (c - 32) * 16));
          scale_bits[i] = c < 32 ? *reinterpret_cast<const uint32_t*>(row + kFp8ScaleOffset + (c / 8) * 4) : 0u;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < kPassItems; ++i) {
          if (first + i >= kPer) break;
          const int id = tid + (first + i) * kCta, key = id / kItemsPerRow, c = id % kItemsPerRow;
          if (c < 32) {
            uint4 lo, hi;
            DequantChunk<kDType>(raw[i], Fp8ScalePair<kDType>(scale_bits[i]), lo, hi);
            *reinterpret_cast<uint4*>(tile_elems + Swizzle(key, 2 * c)) = lo;
            *reinterpret_cast<uint4*>(tile_elems + Swizzle(key, 2 * c + 1)) = hi;
          } else {
            *reinterpret_cast<uint4*>(tile_elems + Swizzle(key, kHeadDimV / 8 + c - 32)) = raw[i];
          }
        }
      }
      __syncthreads();
    }

    // S partial = Q[:, my dims] K[:, my dims]^T.
    float s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][j][e] = 0.f;
    if constexpr (kRegs) {
      // Key 8 i + lane / 4 of n8 tile i: the lane's 16 codes of each half H of the warp's
      // block (dims 128 warp + 64 H + 16 (lane % 4) ..), converted and scaled exactly as
      // in place (DequantChunk), then its rope k-step by ldmatrix.
      // The raw words of all four blocks are read first; each half H accumulates into
      // its own partial scores (s, s_hi: mma chains of 4, not 8, summed once per tile;
      // 3f32947: -1.4% for bf16 on (64,16,4096), fp16 unchanged).
      uint32_t sp[kNT];
      uint4 raw[kNT][2];
#pragma unroll
      for (int i = 0; i < kNT; ++i) {
        const int key = 8 * i + (lane >> 2);
        sp[i] = Fp8ScalePair<kDType>(__float_as_uint(sm.scales[stage][key][warp]));
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int q = warp * 8 + hh * 4 + (lane & 3);
          raw[i][hh] = *reinterpret_cast<const uint4*>(&sm.kv[stage][key][(q ^ ((key & 1) << 2)) << 4]);
        }
      }
      float s_hi[kNT][4];
#pragma unroll
      for (int i = 0; i < kNT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s_hi[i][e] = 0.f;
#pragma unroll
      for (int i = 0; i < kNT; ++i)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const uint32_t wd[4] = {raw[i][hh].x, raw[i][hh].y, raw[i][hh].z, raw[i][hh].w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint32_t k02 = Fma2NegZero<kDType>(E4m3PairBits<kDType>(wd[j] << 8), sp[i]);
            const uint32_t k13 = Fma2NegZero<kDType>(E4m3PairBits<kDType>(wd[j]), sp[i]);
            Mma<kDType>(hh == 0 ? s[0][i] : s_hi[i], qf[kRegs ? hh * 4 + j : 0][0], k02, k13);
            vfr[kRegs ? i : 0][hh][j][0] = MovTrans(k02);
            vfr[kRegs ? i : 0][hh][j][1] = MovTrans(k13);
          }
        }
#pragma unroll
      for (int i = 0; i < kNT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][i][e] += s_hi[i][e];
      const uint32_t rope_base = SmemAddr(&sm.rope[stage][0][0]);
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t kb[4];
        const int key = np * 16 + (lane & 7) + ((lane >> 4) & 1) * 8;
        const int chunk = warp * 2 + ((lane >> 3) & 1);
        Ldmatrix4(kb, rope_base + (key * (kHeadDimQK - kHeadDimV) + ((chunk ^ (key & 7)) << 3)) * 2);
        Mma<kDType>(s[0][2 * np], qf[kRegs ? 8 : 0][0], kb[0], kb[1]);
        Mma<kDType>(s[0][2 * np + 1], qf[kRegs ? 8 : 0][0], kb[2], kb[3]);
      }
    }
#pragma unroll
    for (int ks = 0; ks < (kRegs ? 0 : kKSteps); ++ks) {
      const int chunk0 = (warp * kDimsPerWarp + ks * 16) / 8;
      uint32_t a[kMT][4];
      if (ks < kRegSteps) {  // unrolled: decided at compile time
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = qf[ks < kRegSteps ? ks : 0][mt][e];
      } else if constexpr (!Cfg::kQInRegisters) {
        constexpr int kQC = Plan::kQChunks;
        const int qchunk0 = (warp * (kKSteps - kQRegSteps) + ks - kQRegSteps) * 2;
        const uint32_t q_base = SmemAddr(&sm.q[0][0]);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const int r = grow0 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
          Ldmatrix4(a[mt], q_base + SwizzleRow<kQC>(r, qchunk0 + (lane >> 4)) * 2);
        }
      }
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t kb[4];
        const int key = np * 16 + (lane & 7) + ((lane >> 4) & 1) * 8;
        Ldmatrix4(kb, kv_base + Swizzle(key, chunk0 + ((lane >> 3) & 1)) * 2);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          Mma<kDType>(s[mt][2 * np], a[mt], kb[0], kb[1]);
          Mma<kDType>(s[mt][2 * np + 1], a[mt], kb[2], kb[3]);
        }
      }
    }
    if constexpr (kPingPong) {
      // Group 1, its QK of tile t done: tile t+1's copies (its own) have landed; group 0
      // may start it. The group barrier below makes them visible within group 1.
      if (grp == 1 && t + 1 < num_tiles) {
        CpAsyncWait<0>();
        BarArrive(kFullBar + ((t + 1) & 1), kCta);
      }
    }
    if constexpr (Cfg::kCoopReduce) {
      // Cooperative reduction: warp w sums keys 8w .. 8w+7 of the 4 partials (its own
      // from registers) and keeps only that slice, x. The other warps' slices of its
      // partial go to shared memory for them.
      static_assert(kNT == kWarps, "one 8-key slice per warp of the group");
      constexpr bool kPacked = Plan::kPackedSlices;  // 3 source slots per slice, not 4
      const int bar = 1 + grp;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        if (j == warp) continue;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
          *reinterpret_cast<float4*>(&sm.s_part[grp][j][kPacked ? warp - (warp > j) : warp][mt][lane][0]) =
              make_float4(s[mt][j][0], s[mt][j][1], s[mt][j][2], s[mt][j][3]);
      }
      float x[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          x[mt][e] = warp == 0 ? s[mt][0][e] : warp == 1 ? s[mt][1][e] : warp == 2 ? s[mt][2][e] : s[mt][3][e];
      GroupSync(bar);
#pragma unroll
      for (int src = 0; src < kWarps; ++src) {
        if (src == warp) continue;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const float4 u =
              *reinterpret_cast<const float4*>(&sm.s_part[grp][warp][kPacked ? src - (src > warp) : src][mt][lane][0]);
          x[mt][0] += u.x;
          x[mt][1] += u.y;
          x[mt][2] += u.z;
          x[mt][3] += u.w;
        }
      }
      const int key0 = key_begin + t * kN;
      if (key0 + kN > lim_min) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key0 + warp * 8 + (lane & 3) * 2 + (e & 1);
            if (key >= row_limit[mt][e >> 1]) x[mt][e] = -INFINITY;
          }
      }
      // This slice's row maxima (a quad of lanes holds a row), published for the
      // exchange below; the barrier that follows (the vote's, or the exchange's) makes
      // them visible to the group.
      float mx[kMT][2];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float m = fmaxf(x[mt][2 * h], x[mt][2 * h + 1]);
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
          mx[mt][h] = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
          if ((lane & 3) == 0) sm.row_max[grp][mt * 16 + (lane >> 2) + 8 * h][warp] = mx[mt][h];
        }
      // P's planes (high, low) and where this warp's slice of them goes: in its own
      // partial-score slot (Plan::kPInSlots: planes of 8-key rows), or in the array p
      // (planes of 32-key rows, each row's 8-key chunks swizzled by (row / 2) % 4).
      constexpr bool kPInSlots = Plan::kPInSlots;
      constexpr int kPPlane = kPInSlots ? kGroupRows * 8 : kGroupRows * kN;  // elements per P plane
      uint16_t* p_tile;
      if constexpr (kPInSlots) {
        p_tile = reinterpret_cast<uint16_t*>(&sm.s_part[grp][warp][warp][0][0][0]);
        // Every lane has read its partials from this slot (the same lane's addresses
        // only, but the warp's stores below cover the whole slot).
        __syncwarp();
      } else {
        p_tile = &sm.p[grp][0][0][0];
      }
      // Writes this slice's P for (m-tile, half) against max m_use; returns its row sum.
      auto store_p = [&](int mt, int h, float m_use) {
        const float p0 = Exp2(fmaf(x[mt][2 * h], scale_log2, -m_use));
        const float p1 = Exp2(fmaf(x[mt][2 * h + 1], scale_log2, -m_use));
        // (row / 2) % 4 is (lane / 8) % 4 for every m-tile and half.
        const int row = mt * 16 + (lane >> 2) + 8 * h;
        const int off = kPInSlots ? row * 8 + (lane & 3) * 2
                                  : row * kN + ((warp ^ ((lane >> 3) & 3)) << 3) + (lane & 3) * 2;
        const uint32_t hi = Pack2<kDType>(p0, p1);
        *reinterpret_cast<uint32_t*>(p_tile + off) = hi;
        if constexpr (kSplitP) *reinterpret_cast<uint32_t*>(p_tile + kPPlane + off) = PackLowBf16(p0, p1, hi);
        return p0 + p1;
      };
      bool exchange = true;
      if constexpr (kLazyMaxLog2 > 0) {
        // P against the running max as it stands; kept, with no rescale, when no slice's
        // max of any row is above it by more than 2^kLazyMaxLog2 (so P stays small
        // enough for 16 bits and for l). The vote's barrier also completes P.
        bool over = false;
        float sum[kMT][2];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            over |= mx[mt][h] * scale_log2 > m_run[mt][h] + kLazyMaxLog2;
            sum[mt][h] = store_p(mt, h, m_run[mt][h] == -INFINITY ? 0.f : m_run[mt][h]);
          }
        exchange = GroupAny(bar, over);
        if (!exchange)
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) l_run[mt][h] += sum[mt][h];
      }
      if (exchange) {
        // The group's row maxima: each slice's, exchanged, combined by fmax (exact, so
        // every warp of the group gets the same m and alpha). After a vote, its barrier
        // has already made them visible.
        if constexpr (kLazyMaxLog2 <= 0) GroupSync(bar);
        bool rescale = false;
        float alpha[kMT][2];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float4 m4 = *reinterpret_cast<const float4*>(&sm.row_max[grp][mt * 16 + (lane >> 2) + 8 * h][0]);
            const float m_new = fmaxf(m_run[mt][h], fmaxf(fmaxf(m4.x, m4.y), fmaxf(m4.z, m4.w)) * scale_log2);
            const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no (-inf) - (-inf)
            alpha[mt][h] = Exp2(m_run[mt][h] - m_use);
            rescale |= m_new != m_run[mt][h];
            m_run[mt][h] = m_new;
            l_run[mt][h] = fmaf(l_run[mt][h], alpha[mt][h], store_p(mt, h, m_use));
          }
        if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int j = 0; j < kVT; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[mt][j][e] *= alpha[mt][e >> 1];
        }
        GroupSync(bar);  // the group's P is complete
      }
      // Slots: slice c's P at slot [c][c], (kWarps + 1) slots after slice 0's.
      constexpr uint32_t kSlotStride = sizeof(sm.s_part[0][0]) + sizeof(sm.s_part[0][0][0]);
      const uint32_t p_base = kPInSlots ? SmemAddr(&sm.s_part[grp][0][0][0][0][0]) : SmemAddr(p_tile);
#pragma unroll
      for (int kk = 0; kk < kNT / 2; ++kk) {
        uint32_t pa[kMT][4], pl[kSplitP ? kMT : 1][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          // (row / 2) % 4 is (lane / 2) % 4 for every m-tile.
          const int row = mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, chunk = kk * 2 + (lane >> 4);
          const uint32_t addr = kPInSlots ? p_base + chunk * kSlotStride + row * 16
                                          : p_base + (row * kN + ((chunk ^ ((lane >> 1) & 3)) << 3)) * 2;
          Ldmatrix4(pa[mt], addr);
          if constexpr (kSplitP) Ldmatrix4(pl[mt], addr + kPPlane * 2);
        }
        pv_kstep(kk, pa, pl, kv_base);
      }
      if constexpr (kPingPong) {
        // Stage t % 2 is free once both groups are done with tile t: group 1 copies tile
        // t+2 into it.
        if (t + 2 < num_tiles) {
          if (grp == 0) {
            BarArrive(kEmptyBar + (t & 1), kCta);
          } else {
            BarSync(kEmptyBar + (t & 1), kCta);
            load_tile(t + 2, t & 1, next_page);
            CpAsyncCommit();
          }
          if (t + 3 < num_tiles) next_page = page_of(t + 3);
        }
      }
    } else {
      // Sum the 4 warps' partials. Every warp sums in the same order, so all warps hold
      // bit-identical scores and run identical softmax arithmetic; a warp's own partial
      // comes from its registers (the same bits it stored), so each warp reads 3 of the 4.
      // The 64-row tile exchanges its 32 keys in two passes of 16 through one buffer,
      // which is what lets Q stay whole in shared memory within A100's 163 KB.
      constexpr int kPasses = Cfg::kExchangePasses, kPassNT = kNT / kPasses;
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        if (pass > 0) __syncthreads();  // every warp has read the previous pass
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int jj = 0; jj < kPassNT; ++jj) {
            const int j = pass * kPassNT + jj;
            *reinterpret_cast<float4*>(&sm.s_part[grp][warp][mt][jj][lane][0]) =
                make_float4(s[mt][j][0], s[mt][j][1], s[mt][j][2], s[mt][j][3]);
          }
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int jj = 0; jj < kPassNT; ++jj) {
            const int j = pass * kPassNT + jj;
            const float4 own = make_float4(s[mt][j][0], s[mt][j][1], s[mt][j][2], s[mt][j][3]);
            float4 v = own;
            if (warp != 0) v = *reinterpret_cast<const float4*>(&sm.s_part[grp][0][mt][jj][lane][0]);
#pragma unroll
            for (int w = 1; w < kWarps; ++w) {
              float4 u = own;
              if (w != warp) u = *reinterpret_cast<const float4*>(&sm.s_part[grp][w][mt][jj][lane][0]);
              v.x += u.x;
              v.y += u.y;
              v.z += u.z;
              v.w += u.w;
            }
            s[mt][j][0] = v.x;
            s[mt][j][1] = v.y;
            s[mt][j][2] = v.z;
            s[mt][j][3] = v.w;
          }
      }

      // Mask keys past each row's limit (past seqlen, or causal), only on tiles that need it.
      const int key0 = key_begin + t * kN;
      if (key0 + kN > lim_min) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int j = 0; j < kNT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = key0 + j * 8 + (lane & 3) * 2 + (e & 1);
              if (key >= row_limit[mt][e >> 1]) s[mt][j][e] = -INFINITY;
            }
      }

      // Online softmax, once per kN keys. A quad of lanes holds one row.
      bool rescale = false;
      float alpha[kMT][2];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = -INFINITY;
#pragma unroll
          for (int j = 0; j < kNT; ++j) mx = fmaxf(mx, fmaxf(s[mt][j][2 * h], s[mt][j][2 * h + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m_run[mt][h], mx * scale_log2);
          const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no (-inf) - (-inf)
          alpha[mt][h] = Exp2(m_run[mt][h] - m_use);
          rescale |= m_new != m_run[mt][h];
          m_run[mt][h] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < kNT; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pv = Exp2(fmaf(s[mt][j][2 * h + e], scale_log2, -m_use));
              s[mt][j][2 * h + e] = pv;
              sum += pv;
            }
          l_run[mt][h] = fmaf(l_run[mt][h], alpha[mt][h], sum);
        }
      if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
          for (int j = 0; j < kVT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][j][e] *= alpha[mt][e >> 1];
      }

      // O[:, my 128 columns] += P V. P's accumulator layout is the A-fragment layout.
#pragma unroll
      for (int kk = 0; kk < kNT / 2; ++kk) {
        uint32_t pa[kMT][4], pl[kSplitP ? kMT : 1][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const float* x0 = s[mt][2 * kk];
          const float* x1 = s[mt][2 * kk + 1];
          pa[mt][0] = Pack2<kDType>(x0[0], x0[1]);
          pa[mt][1] = Pack2<kDType>(x0[2], x0[3]);
          pa[mt][2] = Pack2<kDType>(x1[0], x1[1]);
          pa[mt][3] = Pack2<kDType>(x1[2], x1[3]);
          if constexpr (kSplitP) {
            pl[mt][0] = PackLowBf16(x0[0], x0[1], pa[mt][0]);
            pl[mt][1] = PackLowBf16(x0[2], x0[3], pa[mt][1]);
            pl[mt][2] = PackLowBf16(x1[0], x1[1], pa[mt][2]);
            pl[mt][3] = PackLowBf16(x1[2], x1[3], pa[mt][3]);
          }
        }
        pv_kstep(kk, pa, pl, kv_base);
      }
    }
  }
  CpAsyncWait<0>();

  // Row sums: a quad of lanes holds a row's keys (of the warp's slice, with the
  // cooperative reduction, whose slices' sums then go through shared memory and are
  // added in one order by every warp of the group).
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l_run[mt][h] += __shfl_xor_sync(0xffffffffu, l_run[mt][h], 1);
      l_run[mt][h] += __shfl_xor_sync(0xffffffffu, l_run[mt][h], 2);
    }
  if constexpr (Cfg::kCoopReduce) {
    if ((lane & 3) == 0)
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) sm.row_sum[grp][mt * 16 + (lane >> 2) + 8 * h][warp] = l_run[mt][h];
    GroupSync(1 + grp);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4 l4 = *reinterpret_cast<const float4*>(&sm.row_sum[grp][mt * 16 + (lane >> 2) + 8 * h][0]);
        l_run[mt][h] = ((l4.x + l4.y) + l4.z) + l4.w;
      }
  }

  // Epilogue: normalise and write out/lse directly, or the partition's partials.
  const int rows_total = p.h_q * p.s_q;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = l_run[mt][h];
      const int row = row0 + grow0 + mt * 16 + (lane >> 2) + 8 * h;
      if (row >= rows_kv) continue;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float lse = l > 0.f ? (m_run[mt][h] + __log2f(l)) * 0.6931471805599453f : -INFINITY;
      const int token = row / group, head = kvh * group + row % group;
      const int col0 = warp * kColsPerWarp + (lane & 3) * 2;
      if constexpr (kRegs) {
        // n8 tiles 8 H + 2 j and 8 H + 2 j + 1 hold dims (d, d+2) and (d+1, d+3) of this
        // row, d = 128 warp + 64 H + 16 (lane % 4) + 4 j.
        uint16_t* o16 = static_cast<uint16_t*>(p.out) + int64_t(b) * p.out_batch_stride +
                        int64_t(token) * p.out_seq_stride + int64_t(head) * p.out_head_stride;
        const int64_t prow = (int64_t(b) * args.num_splits + split) * rows_total + kvh * rows_kv + row;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int d = warp * kColsPerWarp + hh * 64 + (lane & 3) * 16 + j * 4;
            const float* lo = acc[mt][hh * 8 + j * 2];
            const float* hi = acc[mt][hh * 8 + j * 2 + 1];
            const float v0 = lo[2 * h] * inv, v1 = hi[2 * h] * inv, v2 = lo[2 * h + 1] * inv, v3 = hi[2 * h + 1] * inv;
            if (direct) {
              *reinterpret_cast<uint32_t*>(o16 + d) = Pack2<kDType>(v0, v1);
              *reinterpret_cast<uint32_t*>(o16 + d + 2) = Pack2<kDType>(v2, v3);
            } else {
              *reinterpret_cast<float4*>(args.o_part + prow * kHeadDimV + d) = make_float4(v0, v1, v2, v3);
            }
          }
        if (warp == 0 && (lane & 3) == 0) {
          if (direct) {
            p.lse[int64_t(b) * p.lse_batch_stride + int64_t(head) * p.lse_head_stride + token] = lse;
          } else {
            args.lse_part[prow] = lse;
          }
        }
        continue;
      }
      if (direct) {
        uint16_t* o = static_cast<uint16_t*>(p.out) + int64_t(b) * p.out_batch_stride +
                      int64_t(token) * p.out_seq_stride + int64_t(head) * p.out_head_stride + col0;
#pragma unroll
        for (int j = 0; j < kVT; ++j)
          *reinterpret_cast<uint32_t*>(o + j * 8) =
              Pack2<kDType>(acc[mt][j][2 * h] * inv, acc[mt][j][2 * h + 1] * inv);
        if (warp == 0 && (lane & 3) == 0)
          p.lse[int64_t(b) * p.lse_batch_stride + int64_t(head) * p.lse_head_stride + token] = lse;
      } else {
        const int64_t prow = (int64_t(b) * args.num_splits + split) * rows_total + kvh * rows_kv + row;
        float* o = args.o_part + prow * kHeadDimV + col0;
#pragma unroll
        for (int j = 0; j < kVT; ++j)
          *reinterpret_cast<float2*>(o + j * 8) = make_float2(acc[mt][j][2 * h] * inv, acc[mt][j][2 * h + 1] * inv);
        if (warp == 0 && (lane & 3) == 0) args.lse_part[prow] = lse;
      }
    }
}

// Host side of one instantiation.
template <DType kDType, int kRows, KvDType kKv, bool kRegs, bool kSm80Plan, PRounding kP>
const void* Decoder<kDType, kRows, kKv, kRegs, kSm80Plan, kP>::Kernel() {
  return reinterpret_cast<const void*>(&MlaDecodeKernel<kDType, kRows, kKv, kRegs, kSm80Plan, kP>);
}

template <DType kDType, int kRows, KvDType kKv, bool kRegs, bool kSm80Plan, PRounding kP>
int Decoder<kDType, kRows, kKv, kRegs, kSm80Plan, kP>::SmemBytes() {
  return static_cast<int>(sizeof(PlanOf<kRows, kKv, kRegs, kSm80Plan, kDType>));
}

template <DType kDType, int kRows, KvDType kKv, bool kRegs, bool kSm80Plan, PRounding kP>
cudaError_t Decoder<kDType, kRows, kKv, kRegs, kSm80Plan, kP>::Prepare() {
  // One bit per device: the attribute is per device and costs a driver call.
  static std::atomic<uint64_t> done{0};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  e = cudaFuncSetAttribute(&MlaDecodeKernel<kDType, kRows, kKv, kRegs, kSm80Plan, kP>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                           SmemBytes());
  if (e == cudaSuccess && bit) done.fetch_or(bit, std::memory_order_acq_rel);
  return e;
}

template <DType kDType, int kRows, KvDType kKv, bool kRegs, bool kSm80Plan, PRounding kP>
cudaError_t Decoder<kDType, kRows, kKv, kRegs, kSm80Plan, kP>::Launch(const DecodeArgs& args, cudaStream_t stream) {
  cudaError_t e = Prepare();
  if (e != cudaSuccess) return e;
  const dim3 grid(args.row_tiles, args.num_splits, args.p.batch * args.p.h_kv);
  MlaDecodeKernel<kDType, kRows, kKv, kRegs, kSm80Plan, kP><<<grid, kCtaThreads<kRows>, SmemBytes(), stream>>>(args);
  return cudaGetLastError();
}

}  // namespace latentd::kernels::sm80
