// The SM80 MLA decode kernel: one CTA per (row tile, split-K partition, sequence x KV
// head). cp.async stages KV tiles through XOR-swizzled shared memory, ldmatrix feeds
// mma.sync.m16n8k16, and an fp32 online softmax runs on the accumulator fragments.
// Phase functions over the instantiation's DecodeTraits (traits.h) first: copy of a KV
// tile and of Q, QK, the 32-row tile's cross-warp reduction and softmax, PV (P from
// registers or from shared memory; the k-step itself is the kernel's pv_kstep), and the
// row sums' reduction. Then MlaDecodeKernel, the loop over KV tiles that calls them.
// Each FP8 pipeline's code is in its own header (fp8_in_place.cuh, fp8_in_registers.cuh,
// fp8_dequant_ahead.cuh), selected by T::kFp8Pipeline. Included only by the one-line
// instantiation files kernels/sm80/decode_*.cu.
//
// Register arrays and per-step scratch (Q fragments, O, the row state, QK's A and PV's
// P fragments, the reductions' float4s, the pass registers of the in-place conversion)
// are declared in the kernel body and passed to the phases, in the order the kernel has
// always declared them: the compiler numbers its values by the order of these
// variables, and ptxas's register allocation follows that numbering, so declaring them
// inside the phases changes the machine code (by one register on some instantiations).
// The cooperative reduction with its lazy-max softmax (16- and 64-row tiles) and the
// epilogue's stores are still written in the loop body: moved into functions, even with
// their scratch passed in, they changed the machine code, which is kept byte for byte
// as of fe5ffeb.
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
#include "kernels/sm80/cta.cuh"
#include "kernels/sm80/fp8_common.cuh"
#include "kernels/sm80/fp8_dequant_ahead.cuh"
#include "kernels/sm80/fp8_in_place.cuh"
#include "kernels/sm80/fp8_in_registers.cuh"
#include "kernels/sm80/primitives.cuh"
#include "kernels/sm80/traits.h"

namespace latentd::kernels::sm80 {

namespace detail {
// A 16-bit cache's tile t (on `page`) into stage s: kN keys x 72 chunks over all threads
// (with the ping-pong, over group 1's). Each thread copies whole 128-byte-strided runs of
// one row, so its copies are one source and one destination address plus constants
// (00df7d8: the per-chunk index math was ~15% of the loop's instructions). A tile never
// straddles a page, so its keys' page offsets are key0 % 64 + key without wrapping.
// Keys past cta_end copy nothing (zero fill) from within row 0 of page 0, never from an
// unowned row.
template <class T>
__device__ __forceinline__ void CopyKv16Tile(const Cta<T>& cta, typename T::SharedMemoryPlan& sm, int t, int s,
                                             int page) {
  const MlaDecodeParams& p = *cta.p;
  const int key0 = cta.key_begin + t * T::kN;
  const int page_key0 = key0 & (kPageSize - 1);
  // 8 threads per row, each its chunks c + 8 j (j = 0..8): the swizzle permutes only
  // within 8-chunk groups, so chunk c + 8 j lands 128 j bytes after chunk c. With the
  // ping-pong, group 1's 128 threads copy the whole tile.
  constexpr int kLoaders = T::kPingPong ? kThreads : T::kCta;
  constexpr int kKeysPerPass = kLoaders / 8;
  static_assert(T::kN % kKeysPerPass == 0, "whole passes of rows");
  const int ltid = cta.tid % kLoaders;
  const uint32_t dst0 = SmemAddr(&sm.kv[s][0][0]);
  const int c = ltid & 7;
#pragma unroll
  for (int pass = 0; pass < T::kN / kKeysPerPass; ++pass) {
    const int key = pass * kKeysPerPass + (ltid >> 3);
    const bool valid = key0 + key < cta.cta_end;
    const uint16_t* src = valid ? cta.kv + int64_t(page) * p.kv_page_stride + cta.kv_head_off +
                                      int64_t(page_key0 + key) * p.kv_row_stride + c * 8
                                : cta.kv;
    const uint32_t dst = dst0 + Swizzle(key, c) * 2;
#pragma unroll
    for (int j = 0; j < kHeadDimQK / 64; ++j) CpAsync16(dst + j * 128, src + j * 64, valid);
  }
}

// KV tile t into stage s, as the instantiation's cache format and FP8 pipeline lay it out.
template <class T>
__device__ inline void CopyKvTile(const Cta<T>& cta, typename T::SharedMemoryPlan& sm, int t, int s,
                                           int page) {
  if constexpr (T::kFp8Pipeline == Fp8Pipeline::kInPlace) {
    Fp8InPlace<T>::CopyTile(cta, sm, t, s, page);
  } else if constexpr (T::kFp8Pipeline == Fp8Pipeline::kRegisters) {
    Fp8InRegisters<T>::CopyTile(cta, sm, t, s, page);
  } else if constexpr (T::kFp8Pipeline == Fp8Pipeline::kDequantAhead) {
    Fp8DequantAhead<T>::CopyTile(cta, sm, t, s, page);
  } else {
    CopyKv16Tile(cta, sm, t, s, page);
  }
}

// Q in shared memory (the 32- and 64-row tiles): every k-step not held in registers,
// copied by cp.async. A row holds, warp slice after warp slice, those k-steps.
template <class T>
__device__ __forceinline__ void CopyQ(const Cta<T>& cta, typename T::SharedMemoryPlan& sm) {
  using Plan = typename T::SharedMemoryPlan;
  constexpr int kQC = Plan::kQChunks, kSliceChunks = kQC / kWarps;
  const uint32_t dst0 = SmemAddr(&sm.q[0][0]);
  for (int id = cta.tid; id < T::kRows * kQC; id += T::kCta) {
    const int r = id / kQC, chunk = id % kQC;
    const int w = chunk / kSliceChunks, c = chunk % kSliceChunks;
    const int dim = w * kDimsPerWarp + (T::kQRegSteps + c / 2) * 16 + (c & 1) * 8;
    const bool valid = cta.row0 + r < cta.rows_kv;
    const uint16_t* src = valid ? cta.QRow(r) + dim : static_cast<const uint16_t*>(cta.p->q);
    CpAsync16(dst0 + SwizzleRow<kQC>(r, chunk) * 2, src, valid);
  }
}

// Q in registers: this warp's first kRegSteps k-steps in A-fragment order (the 16-row
// tile: all of them; the 64-row tile: kQRegSteps).
template <class T>
__device__ __forceinline__ void LoadQRegisters(const Cta<T>& cta, uint32_t (&qf)[T::kQFragSteps][T::kMT][4]) {
  const int lane = cta.lane, warp = cta.warp;
#pragma unroll
  for (int mt = 0; mt < T::kMT; ++mt) {
    const int r = cta.grow0 + mt * 16 + (lane >> 2), c = (lane & 3) * 2;
    const bool v0 = cta.row0 + r < cta.rows_kv, v1 = cta.row0 + r + 8 < cta.rows_kv;
    const uint16_t* q0 = v0 ? cta.QRow(r) : nullptr;
    const uint16_t* q1 = v1 ? cta.QRow(r + 8) : nullptr;
    if constexpr (T::kRegs) {
      Fp8InRegisters<T>::LoadQ(cta, q0, q1, v0, v1, c, qf, mt);
    } else {
#pragma unroll
      for (int ks = 0; ks < T::kRegSteps; ++ks) {
        const int d = warp * kDimsPerWarp + ks * 16 + c;
        qf[ks][mt][0] = v0 ? *reinterpret_cast<const uint32_t*>(q0 + d) : 0u;
        qf[ks][mt][1] = v1 ? *reinterpret_cast<const uint32_t*>(q1 + d) : 0u;
        qf[ks][mt][2] = v0 ? *reinterpret_cast<const uint32_t*>(q0 + d + 8) : 0u;
        qf[ks][mt][3] = v1 ? *reinterpret_cast<const uint32_t*>(q1 + d + 8) : 0u;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// QK: this warp's partial scores S = Q[:, my dims] K[:, my dims]^T of a 16-bit tile at
// kv_base, accumulated into s (zeroed). Q's k-steps from registers (the first kRegSteps)
// or shared memory. (FP8 converted in registers: Fp8InRegisters::Qk.)
template <class T>
__device__ __forceinline__ void Qk(const Cta<T>& cta, const typename T::SharedMemoryPlan& sm, uint32_t kv_base,
                                   const uint32_t (&qf)[T::kQFragSteps][T::kMT][4], float (&s)[T::kMT][T::kNT][4],
                                   uint32_t (&a)[T::kMT][4]) {
  constexpr int kMT = T::kMT, kKSteps = T::kKSteps, kRegSteps = T::kRegSteps, kQRegSteps = T::kQRegSteps;
  const int lane = cta.lane, warp = cta.warp;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    const int chunk0 = (warp * kDimsPerWarp + ks * 16) / 8;
    if (ks < kRegSteps) {  // unrolled: decided at compile time
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[mt][e] = qf[ks < kRegSteps ? ks : 0][mt][e];
    } else if constexpr (!T::Cfg::kQInRegisters) {
      constexpr int kQC = T::SharedMemoryPlan::kQChunks;
      const int qchunk0 = (warp * (kKSteps - kQRegSteps) + ks - kQRegSteps) * 2;
      const uint32_t q_base = SmemAddr(&sm.q[0][0]);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const int r = cta.grow0 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        Ldmatrix4(a[mt], q_base + SwizzleRow<kQC>(r, qchunk0 + (lane >> 4)) * 2);
      }
    }
#pragma unroll
    for (int np = 0; np < T::kNT / 2; ++np) {
      uint32_t kb[4];
      const int key = np * 16 + (lane & 7) + ((lane >> 4) & 1) * 8;
      Ldmatrix4(kb, kv_base + Swizzle(key, chunk0 + ((lane >> 3) & 1)) * 2);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        Mma<T::kDType>(s[mt][2 * np], a[mt], kb[0], kb[1]);
        Mma<T::kDType>(s[mt][2 * np + 1], a[mt], kb[2], kb[3]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Reduce: the 4 warps' partial scores of a group summed across warps, through shared
// memory, in one fixed order, so that every warp that holds a sum holds the same bits.

// Every warp sums all of the tile's scores (the 32-row tile): all warps then hold
// bit-identical scores and run identical softmax arithmetic; a warp's own partial comes
// from its registers (the same bits it stored), so each warp reads 3 of the 4. In
// kExchangePasses passes through one buffer. own, v, u: scratch of the kernel.
template <class T>
__device__ __forceinline__ void ReduceAll(const Cta<T>& cta, typename T::SharedMemoryPlan& sm,
                                          float (&s)[T::kMT][T::kNT][4], float4& own, float4& v, float4& u) {
  constexpr int kMT = T::kMT;
  constexpr int kPasses = T::Cfg::kExchangePasses, kPassNT = T::kNT / kPasses;
  const int lane = cta.lane, warp = cta.warp, grp = cta.grp;
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
        own = make_float4(s[mt][j][0], s[mt][j][1], s[mt][j][2], s[mt][j][3]);
        v = own;
        if (warp != 0) v = *reinterpret_cast<const float4*>(&sm.s_part[grp][0][mt][jj][lane][0]);
#pragma unroll
        for (int w = 1; w < kWarps; ++w) {
          u = own;
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
}

// ---------------------------------------------------------------------------------------
// Softmax: online, one rescale of O per KV tile, skipped by warp vote when no row
// maximum moved. A quad of lanes holds one row (m-tile mt, half h -> tile row grow0 +
// mt*16 + lane/4 + 8h).

// Every warp's softmax on the whole tile's summed scores s (the 32-row tile): masks,
// then turns s into P in place.
template <class T>
__device__ __forceinline__ void SoftmaxTile(const Cta<T>& cta, int t, float (&s)[T::kMT][T::kNT][4],
                                            const int (&row_limit)[T::kMT][2], float (&m_run)[T::kMT][2],
                                            float (&l_run)[T::kMT][2], float (&acc)[T::kMT][T::kVT][4],
                                            float scale_log2, float (&alpha)[T::kMT][2]) {
  constexpr int kMT = T::kMT, kNT = T::kNT;
  const int lane = cta.lane;
  // Mask keys past each row's limit (past seqlen, or causal), only on tiles that need it.
  const int key0 = cta.key_begin + t * T::kN;
  if (key0 + T::kN > cta.lim_min) {
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
  bool rescale = false;
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
      for (int j = 0; j < T::kVT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][j][e] *= alpha[mt][e >> 1];
  }
}

// PV from P in registers (the 32-row tile): O[:, my 128 columns] += P V, P's
// accumulator layout being the A-fragment layout. pa, pl: the kernel's P fragments of one
// k-step (pl the low part of a split bf16 P); pv_step(kk, pa, pl) runs the k-step.
template <class T, class PvStepFn>
__device__ __forceinline__ void PvRegisterP(const float (&s)[T::kMT][T::kNT][4], uint32_t (&pa)[T::kMT][4],
                                            uint32_t (&pl)[T::kSplitP ? T::kMT : 1][4], PvStepFn&& pv_step) {
  constexpr DType kD = T::kDType;
#pragma unroll
  for (int kk = 0; kk < T::kNT / 2; ++kk) {
#pragma unroll
    for (int mt = 0; mt < T::kMT; ++mt) {
      const float* x0 = s[mt][2 * kk];
      const float* x1 = s[mt][2 * kk + 1];
      pa[mt][0] = Pack2<kD>(x0[0], x0[1]);
      pa[mt][1] = Pack2<kD>(x0[2], x0[3]);
      pa[mt][2] = Pack2<kD>(x1[0], x1[1]);
      pa[mt][3] = Pack2<kD>(x1[2], x1[3]);
      if constexpr (T::kSplitP) {
        pl[mt][0] = PackLowBf16(x0[0], x0[1], pa[mt][0]);
        pl[mt][1] = PackLowBf16(x0[2], x0[3], pa[mt][1]);
        pl[mt][2] = PackLowBf16(x1[0], x1[1], pa[mt][2]);
        pl[mt][3] = PackLowBf16(x1[2], x1[3], pa[mt][3]);
      }
    }
    pv_step(kk, pa, pl);
  }
}

// PV with the cooperative reduction: every slice's P, from the reducing warps' slots
// (Plan::kPInSlots) or from the array p at p_tile, by ldmatrix as the A operand. pa, pl:
// the kernel's P fragments of one k-step; pv_step(kk, pa, pl) runs the k-step.
template <class T, class PvStepFn>
__device__ __forceinline__ void PvSharedP(const Cta<T>& cta, typename T::SharedMemoryPlan& sm, const uint16_t* p_tile,
                                          uint32_t (&pa)[T::kMT][4], uint32_t (&pl)[T::kSplitP ? T::kMT : 1][4],
                                          PvStepFn&& pv_step) {
  constexpr bool kPInSlots = T::SharedMemoryPlan::kPInSlots;
  constexpr int kPPlane = kPInSlots ? T::kGroupRows * 8 : T::kGroupRows * T::kN;  // elements per P plane
  const int lane = cta.lane;
  // Slots: slice c's P at slot [c][c], (kWarps + 1) slots after slice 0's.
  constexpr uint32_t kSlotStride = sizeof(sm.s_part[0][0]) + sizeof(sm.s_part[0][0][0]);
  const uint32_t p_base = kPInSlots ? SmemAddr(&sm.s_part[cta.grp][0][0][0][0][0]) : SmemAddr(p_tile);
#pragma unroll
  for (int kk = 0; kk < T::kNT / 2; ++kk) {
#pragma unroll
    for (int mt = 0; mt < T::kMT; ++mt) {
      // (row / 2) % 4 is (lane / 2) % 4 for every m-tile.
      const int row = mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, chunk = kk * 2 + (lane >> 4);
      const uint32_t addr = kPInSlots ? p_base + chunk * kSlotStride + row * 16
                                      : p_base + (row * T::kN + ((chunk ^ ((lane >> 1) & 3)) << 3)) * 2;
      Ldmatrix4(pa[mt], addr);
      if constexpr (T::kSplitP) Ldmatrix4(pl[mt], addr + kPPlane * 2);
    }
    pv_step(kk, pa, pl);
  }
}

// Row sums: a quad of lanes holds a row's keys (of the warp's slice, with the
// cooperative reduction, whose slices' sums then go through shared memory and are added
// in one order by every warp of the group). l4: the kernel's scratch.
template <class T>
__device__ __forceinline__ void ReduceRowSums(const Cta<T>& cta, typename T::SharedMemoryPlan& sm,
                                              float (&l_run)[T::kMT][2], float4& l4) {
  const int lane = cta.lane, warp = cta.warp, grp = cta.grp;
#pragma unroll
  for (int mt = 0; mt < T::kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l_run[mt][h] += __shfl_xor_sync(0xffffffffu, l_run[mt][h], 1);
      l_run[mt][h] += __shfl_xor_sync(0xffffffffu, l_run[mt][h], 2);
    }
  if constexpr (T::Cfg::kCoopReduce) {
    if ((lane & 3) == 0)
#pragma unroll
      for (int mt = 0; mt < T::kMT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) sm.row_sum[grp][mt * 16 + (lane >> 2) + 8 * h][warp] = l_run[mt][h];
    GroupSync(1 + grp);
#pragma unroll
    for (int mt = 0; mt < T::kMT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        l4 = *reinterpret_cast<const float4*>(&sm.row_sum[grp][mt * 16 + (lane >> 2) + 8 * h][0]);
        l_run[mt][h] = ((l4.x + l4.y) + l4.z) + l4.w;
      }
  }
}

}  // namespace detail

// Warps come in groups of 4 (Cfg::kGroups of them): a group owns kRows / kGroups rows
// of the tile, and its warp gw takes dims 144 gw .. 144 gw + 143 of QK^T and output
// columns 128 gw .. 128 gw + 127 of PV. The groups share the KV stages.
//
// Per KV tile t, in this order: wait for tile t and issue the copy of tile t + kAhead
// (first, so the copies stay in flight behind the compute); FP8 in place: convert the
// landed raw rows; QK over the warp's dims; the cross-warp reduction of the partial
// scores; the online softmax; PV. With an FP8 cache the pipeline (T::kFp8Pipeline)
// decides how a tile lands and becomes 16-bit values (fp8_*.cuh).
// kRegsPipe: FP8 converted in registers (Fp8Pipeline::kRegisters); kSm80Plan: the 64-row
// tile's A100 plan; kPRounding: how bf16 P is rounded for the PV mma (params.h).
template <DType kDType, int kRows, KvDType kKv, bool kRegsPipe, bool kSm80Plan, PRounding kPRounding>
__global__ void __launch_bounds__(DecodeTraits<kDType, kRows, kKv, kRegsPipe, kSm80Plan, kPRounding>::kCta,
                                  DecodeTraits<kDType, kRows, kKv, kRegsPipe, kSm80Plan, kPRounding>::kMinCtasPerSm)
    MlaDecodeKernel(const DecodeArgs args) {
  using namespace detail;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A combine kernel launched after this one as a programmatic dependent may start now:
  // it waits (griddepcontrol.wait) for this grid's completion before reading anything.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  // The instantiation's constants (traits.h): tile shape, plan, pipeline.
  using T = DecodeTraits<kDType, kRows, kKv, kRegsPipe, kSm80Plan, kPRounding>;
  using Cfg = typename T::Cfg;
  using Plan = typename T::SharedMemoryPlan;
  constexpr bool kFp8Ahead = T::kFp8Ahead, kRegs = T::kRegs, kPingPong = T::kPingPong, kSplitP = T::kSplitP;
  constexpr int kCta = T::kCta, kN = T::kN, kStages = T::kStages, kAhead = T::kAhead;
  constexpr int kGroupRows = T::kGroupRows, kMT = T::kMT, kNT = T::kNT, kVT = T::kVT;

  extern __shared__ __align__(128) uint8_t smem_raw[];
  Plan& sm = *reinterpret_cast<Plan*>(smem_raw);

  Cta<T> cta;
  cta.Locate(args);
  if (cta.Empty()) return;  // nothing here; combine ignores it
  cta.Init();
  const MlaDecodeParams& p = args.p;
  const int lane = cta.lane, grp = cta.grp, warp = cta.warp, grow0 = cta.grow0;
  const int split = cta.split, b = cta.b, kvh = cta.kvh;
  // The only partition writes out/lse itself (recomputed from seqlen, not read back from
  // cta.n_valid: the compiler then lays the epilogue out as it always has).
  const bool direct = (cta.seqlen + cta.kps - 1) / cta.kps <= 1;
  const int group = cta.group, rows_kv = cta.rows_kv, row0 = cta.row0;
  const int key_begin = cta.key_begin, lim_min = cta.lim_min, num_tiles = cta.num_tiles;

  // Q: registers (16-row tile: all of it; 64-row tile: each warp's first kQRegSteps
  // k-steps, loaded below) and shared memory (the rest, copied here). In shared memory
  // a row holds, warp slice after warp slice, the k-steps not in registers.
  uint32_t qf[T::kQFragSteps][kMT][4];
  if constexpr (!Cfg::kQInRegisters) CopyQ(cta, sm);

  // Pipeline prologue. Q's copies (shared-memory Q) join the first group; Q in registers
  // is loaded after the first KV copies are in flight.
#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (s < num_tiles && (!kPingPong || grp == 1)) CopyKvTile(cta, sm, s, s % kStages, cta.PageOf(s));
    CpAsyncCommit();
  }
  // Page of the next tile to copy, read one iteration ahead so the block-table load is
  // off the copy-issue path.
  int next_page = kAhead < num_tiles ? cta.PageOf(kAhead) : 0;

  if constexpr (kFp8Ahead) Fp8DequantAhead<T>::Prologue(cta, sm);
  int ahead_stage = 1;  // the 16-bit stage tile t+1 is dequantized into during tile t

  // Q in registers: this warp's first kRegSteps k-steps in A-fragment order.
  if constexpr (T::kRegSteps > 0) LoadQRegisters(cta, qf);

  // Per-thread rows: m-tile mt, half h -> tile row grow0 + mt*16 + lane/4 + 8h.
  int row_limit[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(row0 + grow0 + mt * 16 + (lane >> 2) + 8 * h, rows_kv - 1);
      row_limit[mt][h] = cta.LimitOf(row / group);
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

  // O[:, my 128 columns] += P[:, keys 16 kk .. 16 kk + 15] V[those keys, my columns],
  // P as A fragments (pa, and pl its low part for bf16).
  // Converted in registers (kRegs): the tile's V fragments, [8-key block][half of the
  // warp's 128 columns][k-step of the half][pair (d, d+2) or (d+1, d+3)], each the
  // movmatrix transpose of a K fragment; n8 output tile 8 H + 2 j + pair.
  uint32_t vfr[kRegs ? kNT : 1][2][4][2];
  auto pv_kstep = [&](int kk, const uint32_t(&pa)[kMT][4], const uint32_t(&pl)[kSplitP ? kMT : 1][4],
                      uint32_t kv_base) {
    if constexpr (kRegs) {
      Fp8InRegisters<T>::PvStep(kk, pa, pl, vfr, acc);
      return;
    }
    const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int np = 0; np < kVT / 2; ++np) {
      if constexpr (kFp8Ahead) Fp8DequantAhead<T>::DuringPv(cta, sm, kk * (kVT / 2) + np, ahead_stage);
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
    if (grp == 1 && 1 < num_tiles) CopyKvTile(cta, sm, 1, 1, next_page);
    CpAsyncCommit();
    if (2 < num_tiles) next_page = cta.PageOf(2);
  }
  // Ping-pong barriers (kPingPong), by tile parity: FULL (group 1 arrives once its
  // copies of the tile have landed; group 0 waits) and EMPTY (group 0 arrives when done
  // with the tile; group 1 waits before copying tile t+2 into its stage).
  constexpr int kFullBar = 3, kEmptyBar = 5;
  Fp8OwnRegs<T> own;  // FP8 in place, 16-row tile: this thread's raw chunks of the tile
  for (int t = 0; t < num_tiles; ++t) {
    if constexpr (kPingPong) {
      if (grp == 0 && t > 0) BarSync(kFullBar + (t & 1), kCta);
    } else {
      // Dequantizing ahead: tile t+1's raw rows must have landed (they are converted during
      // this tile); otherwise tile t's.
      CpAsyncWait<kFp8Ahead ? 0 : kStages - 2>();
      if constexpr (kFp8OwnChunks<T>) Fp8InPlace<T>::ReadOwn(cta, sm, t % kStages, own);
      __syncthreads();  // tile t visible to all; every warp is done with tile t-1's stage
      if (t + kAhead < num_tiles) CopyKvTile(cta, sm, t + kAhead, (t + kAhead) % kStages, next_page);
      CpAsyncCommit();
      if (t + kAhead + 1 < num_tiles) next_page = cta.PageOf(t + kAhead + 1);
    }
    // On the last tile the conversion runs on whatever raw stage (t+1) % 2 holds, into a
    // stage nobody reads again: it keeps the PV loop free of a branch.
    ahead_stage = (t + 1) % kStages;
    const int stage = t % kStages;
    const uint32_t kv_base = SmemAddr(&sm.kv[stage][0][0]);
    if constexpr (T::kFp8Pipeline == Fp8Pipeline::kInPlace) {
      uint4 raw[Fp8InPlace<T>::kPassItems];
      uint32_t scale_bits[Fp8InPlace<T>::kPassItems];
      Fp8InPlace<T>::Convert(cta, sm, stage, own, raw, scale_bits);
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
      Fp8InRegisters<T>::Qk(cta, sm, stage, qf, s, vfr);
    } else {
      uint32_t a[kMT][4];
      Qk(cta, sm, kv_base, qf, s, a);
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
      // PV: every slice's P from shared memory.
      uint32_t pa[kMT][4], pl[kSplitP ? kMT : 1][4];
      PvSharedP<T>(cta, sm, p_tile, pa, pl, [&](int kk, const uint32_t(&a)[kMT][4], const uint32_t(&l)[kSplitP ? kMT : 1][4]) {
        pv_kstep(kk, a, l, kv_base);
      });
      if constexpr (kPingPong) {
        // Stage t % 2 is free once both groups are done with tile t: group 1 copies tile
        // t+2 into it.
        if (t + 2 < num_tiles) {
          if (grp == 0) {
            BarArrive(kEmptyBar + (t & 1), kCta);
          } else {
            BarSync(kEmptyBar + (t & 1), kCta);
            CopyKvTile(cta, sm, t + 2, t & 1, next_page);
            CpAsyncCommit();
          }
          if (t + 3 < num_tiles) next_page = cta.PageOf(t + 3);
        }
      }
    } else {
      // Reduce: every warp sums the 4 partials of the whole tile.
      float4 own, v, u;
      ReduceAll(cta, sm, s, own, v, u);

      // Softmax: mask, then P in place of s.
      float alpha[kMT][2];
      SoftmaxTile(cta, t, s, row_limit, m_run, l_run, acc, scale_log2, alpha);

      // PV: P from registers.
      uint32_t pa[kMT][4], pl[kSplitP ? kMT : 1][4];
      PvRegisterP<T>(s, pa, pl, [&](int kk, const uint32_t(&a)[kMT][4], const uint32_t(&l)[kSplitP ? kMT : 1][4]) {
        pv_kstep(kk, a, l, kv_base);
      });
    }
  }
  CpAsyncWait<0>();

  // Reduce the rows' sums across the group's warps.
  float4 l4;
  ReduceRowSums(cta, sm, l_run, l4);

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
        Fp8InRegisters<T>::StoreRow(cta, args, direct, acc, mt, h, inv, lse, row, token, head, rows_total);
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
