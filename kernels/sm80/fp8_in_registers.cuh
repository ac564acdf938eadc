// FP8 KV cache, converted in registers (Fp8Pipeline::kRegisters: the 16-row tile, where a
// partition has at least kFp8RegsMinTiles tiles; 3a769b8, 264d5b2). The stages hold a
// tile's raw pieces (Fp8RegsSharedMemoryPlan); each warp converts its codes straight
// into the B fragments of its QK^T and, transposed by movmatrix, reuses them as the V
// fragments of its PV, so nothing 16-bit is written to shared memory.
//
// Warp w's QK^T dims are the latent block it owns for PV (128 w .. 128 w + 127) plus
// rope dims 16 w .. 16 w + 15. A lane's 16-byte load of its key's codes gives four
// 4-code words; a word's codes (dims d .. d+3) become two 16-bit pairs, (d, d+2) and
// (d+1, d+3), which are the B fragment of one k-step as they are: the k order within
// the warp's dims is permuted, and Q's A fragments are loaded in the same order. The
// PV's n8 tiles therefore hold columns d, d+2 (and d+1, d+3): the epilogue writes them
// back in place.
#pragma once

#include <cstdint>

#include "kernels/kv_fp8.h"
#include "kernels/sm80/cta.cuh"
#include "kernels/sm80/fp8_common.cuh"
#include "kernels/sm80/launch.h"
#include "kernels/sm80/primitives.cuh"
#include "kernels/sm80/traits.h"

namespace latentd::kernels::sm80::detail {

template <class T>
struct Fp8InRegisters {
  using Plan = typename T::SharedMemoryPlan;
  static constexpr int kRawChunks = kFp8RowBytes / 16;  // 41 per row
  static constexpr int kMT = T::kMT, kNT = T::kNT, kVT = T::kVT;
  static_assert(T::kRows == 16 && T::kN == 32 && T::kCta == 128 && T::Cfg::kQInRegisters &&
                    kHeadDimV == 128 * kWarps && kFp8BlockValues == 128 && T::kStages >= 2,
                "conversion in registers: the 16-row tile, 32-key tiles, one scale block per warp");
  // The tile's V fragments: [8-key block][half of the warp's 128 columns][k-step of the
  // half][pair (d, d+2) or (d+1, d+3)], each the movmatrix transpose of a K fragment;
  // n8 output tile 8 H + 2 j + pair.
  using VFrags = uint32_t[kNT][2][4][2];

  // Copies tile t (on `page`) into stage s: chunk c + 4 j of each row (41 of them) to its
  // place in the stage's pieces: latent, scales, or rope.
  static __device__ __forceinline__ void CopyTile(const Cta<T>& cta, Plan& sm, int t, int s, int page) {
    const Fp8RowCopy<T> rc(cta, t, page);
    constexpr int kT = Fp8RowCopy<T>::kT;
    const int key = rc.key, c = rc.c;
    const uint8_t* row_src = rc.src - c * 16;
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
      CpAsync16(d, row_src + q * 16, rc.valid);
    }
  }

  // Q's A fragments of row pointers q0 (rows lane / 4) and q1 (8 further), null past the
  // last row, in the permuted k order: k-step 4 H + j holds dims d .. d+3, d = 128 warp +
  // 64 H + 16 (lane % 4) + 4 j, as the pairs (d, d+2) and (d+1, d+3) (the K fragments'
  // order); k-step 8: rope dims.
  static __device__ __forceinline__ void LoadQ(const Cta<T>& cta, const uint16_t* q0, const uint16_t* q1, bool v0,
                                               bool v1, int c, uint32_t (&qf)[T::kQFragSteps][kMT][4], int mt) {
    const int warp = cta.warp, lane = cta.lane;
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
  }

  // The warp's partial scores of the tile in `stage`, s (zeroed), and the tile's V
  // fragments. Key 8 i + lane / 4 of n8 tile i: the lane's 16 codes of each half H of
  // the warp's block (dims 128 warp + 64 H + 16 (lane % 4) ..), converted and scaled
  // exactly as in place (DequantChunk), then its rope k-step by ldmatrix. The raw words
  // of all four blocks are read first; each half H accumulates into its own partial
  // scores (s, s_hi: mma chains of 4, not 8, summed once per tile; 3f32947: -1.4% for
  // bf16 on (64,16,4096), fp16 unchanged).
  static __device__ __forceinline__ void Qk(const Cta<T>& cta, const Plan& sm, int stage,
                                            const uint32_t (&qf)[T::kQFragSteps][kMT][4], float (&s)[kMT][kNT][4],
                                            VFrags& vfr) {
    constexpr DType kD = T::kDType;
    const int warp = cta.warp, lane = cta.lane;
    uint32_t sp[kNT];
    uint4 raw[kNT][2];
#pragma unroll
    for (int i = 0; i < kNT; ++i) {
      const int key = 8 * i + (lane >> 2);
      sp[i] = Fp8ScalePair<kD>(__float_as_uint(sm.scales[stage][key][warp]));
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
          const uint32_t k02 = Fma2NegZero<kD>(E4m3PairBits<kD>(wd[j] << 8), sp[i]);
          const uint32_t k13 = Fma2NegZero<kD>(E4m3PairBits<kD>(wd[j]), sp[i]);
          Mma<kD>(hh == 0 ? s[0][i] : s_hi[i], qf[hh * 4 + j][0], k02, k13);
          vfr[i][hh][j][0] = MovTrans(k02);
          vfr[i][hh][j][1] = MovTrans(k13);
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
      Mma<kD>(s[0][2 * np], qf[8][0], kb[0], kb[1]);
      Mma<kD>(s[0][2 * np + 1], qf[8][0], kb[2], kb[3]);
    }
  }

  // O[:, my 128 columns] += P[:, keys 16 kk .. 16 kk + 15] V from the tile's V fragments.
  static __device__ __forceinline__ void PvStep(int kk, const uint32_t (&pa)[kMT][4],
                                                const uint32_t (&pl)[T::kSplitP ? kMT : 1][4], const VFrags& vfr,
                                                float (&acc)[kMT][kVT][4]) {
#pragma unroll
    for (int i = 0; i < kVT; ++i) {
      const uint32_t b0 = vfr[2 * kk][(i >> 3) & 1][(i >> 1) & 3][i & 1];
      const uint32_t b1 = vfr[2 * kk + 1][(i >> 3) & 1][(i >> 1) & 3][i & 1];
      Mma<T::kDType>(acc[0][i], pa[0], b0, b1);
      if constexpr (T::kSplitP) Mma<T::kDType>(acc[0][i], pl[0], b0, b1);
    }
  }

  // Epilogue of one row (m-tile mt, half h): n8 tiles 8 H + 2 j and 8 H + 2 j + 1 hold
  // dims (d, d+2) and (d+1, d+3) of this row, d = 128 warp + 64 H + 16 (lane % 4) + 4 j.
  static __device__ __forceinline__ void StoreRow(const Cta<T>& cta, const DecodeArgs& args, bool direct,
                                                  const float (&acc)[kMT][kVT][4], int mt, int h, float inv, float lse,
                                                  int row, int token, int head, int rows_total) {
    const MlaDecodeParams& p = *cta.p;
    const int warp = cta.warp, lane = cta.lane, b = cta.b;
    uint16_t* o16 = static_cast<uint16_t*>(p.out) + int64_t(b) * p.out_batch_stride +
                    int64_t(token) * p.out_seq_stride + int64_t(head) * p.out_head_stride;
    const int64_t prow = (int64_t(b) * args.num_splits + cta.split) * rows_total + cta.kvh * cta.rows_kv + row;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int d = warp * kColsPerWarp + hh * 64 + (lane & 3) * 16 + j * 4;
        const float* lo = acc[mt][hh * 8 + j * 2];
        const float* hi = acc[mt][hh * 8 + j * 2 + 1];
        const float v0 = lo[2 * h] * inv, v1 = hi[2 * h] * inv, v2 = lo[2 * h + 1] * inv, v3 = hi[2 * h + 1] * inv;
        if (direct) {
          *reinterpret_cast<uint32_t*>(o16 + d) = Pack2<T::kDType>(v0, v1);
          *reinterpret_cast<uint32_t*>(o16 + d + 2) = Pack2<T::kDType>(v2, v3);
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
  }
};

}  // namespace latentd::kernels::sm80::detail
