// FP8 cache, 16-row tile, 8 warps (TileConfig<16>::kFp8Wide; docs/kernel-tuning.md, round
// 29): round 23's register pipeline with each warp owning half a scale block, so that two
// CTAs of 8 warps fit an SM and each scheduler has 4 warps to hide the conversion chain.
// Included by kernels/sm80/kernel.cuh after its helpers.
#pragma once

namespace latentd::kernels::sm80 {

inline constexpr int kWideWarps = 8;
inline constexpr int kWideThreads = 32 * kWideWarps;
inline constexpr int kWideCols = kHeadDimV / kWideWarps;                 // 64: latent dims and output columns per warp
inline constexpr int kWideRope = (kHeadDimQK - kHeadDimV) / kWideWarps;  // 8: rope dims per warp
inline constexpr int kWideStages = 3;                                    // raw stages: 2 tiles in flight

// Shared memory of the 8-warp FP8 tile; sizeof is the launch size. The stages hold raw
// rows apart as in Fp8RegsSharedMemoryPlan (latent codes, 16-bit rope, scales); slice
// 2 i + h of a tile's scores (keys 8 i .. 8 i + 7 of rows 8 h .. 8 h + 7) is reduced by
// warp 2 i + h.
struct Fp8WideSharedMemoryPlan {
  static constexpr int kKeys = 32;
  // Latent codes [stage][key][512]: 16-byte chunk q of key k at chunk q ^ 4 (k % 2), so a
  // quarter-warp's loads (keys 2m and 2m+1, 4 chunks each) hit 8 bank groups.
  uint8_t kv[kWideStages][kKeys][kHeadDimV];
  // Rope values [stage][key][64] in 16 bits, chunk r at r ^ (k % 8).
  uint16_t rope[kWideStages][kKeys][kHeadDimQK - kHeadDimV];
  float scales[kWideStages][kKeys][kFp8Blocks];
  // Partial scores [slice][source warp][lane] x 2 floats (the pair of one row a lane holds);
  // the reducer's own slot stays unused.
  float s_part[kWideWarps][kWideWarps][32][2];
  // P planes (high, low part for bf16) [row][key], 16-byte chunks swizzled by (row / 2) % 4.
  uint16_t p[2][16][kKeys];
  float row_max[16][4];  // per row, each 8-key slice's maximum of the tile
  float row_sum[16][4];  // per row, each slice's sum of P (epilogue)
};
static_assert(2 * (sizeof(Fp8WideSharedMemoryPlan) + 1024) <= 164 * 1024, "8-warp FP8 tile: 2 CTAs on A100");
static_assert(sizeof(float) * kMaxFusedPartialRows <= sizeof(Fp8WideSharedMemoryPlan::kv),
              "fused combine weights fit the stages");

namespace detail {
// m16n8k8: A = 2 registers (rows g, g + 8; k 2t, 2t+1), B = 1 (k 2t, 2t+1; column g).
template <DType kDType>
__device__ __forceinline__ void Mma8(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  if constexpr (kDType == DType::kBF16) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
  } else {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
  }
}
// Barrier 1 over the whole 8-warp CTA, returning whether `v` was true in any thread.
__device__ __forceinline__ bool WideAny(bool v) {
  int r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n bar.red.or.pred q, 1, %2, p;\n selp.s32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(int(v)), "n"(kWideThreads)
      : "memory");
  return r != 0;
}
}  // namespace detail

// Warp w takes latent dims 64 w .. 64 w + 63 (half of scale block w / 2) and rope dims
// 8 w .. 8 w + 7 of QK^T, and output columns 64 w .. 64 w + 63 of PV. As in round 23, a
// lane's 16-byte load gives four 4-code words; word j's codes (dims d .. d+3) become the
// pairs (d, d+2) and (d+1, d+3), one k-step's B fragment, and their movmatrix transposes
// are the V fragments, whose n8 output tiles hold columns (d, d+2) and (d+1, d+3).
template <DType kDType>
__global__ void __launch_bounds__(kWideThreads, 2) MlaDecodeFp8WideKernel(const DecodeArgs args) {
  using namespace detail;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  using Plan = Fp8WideSharedMemoryPlan;
  constexpr int kN = Plan::kKeys, kNT = kN / 8;  // 4 n8 score tiles per KV tile
  constexpr int kStages = kWideStages;
  constexpr int kT = kWideThreads / kN;  // threads per raw row
  constexpr int kRawChunks = kFp8RowBytes / 16;
  constexpr bool kSplitP = kDType == DType::kBF16;  // as the 4-warp tile: bf16 P in two planes
  static_assert(kT * kN == kWideThreads && kWideCols * 2 == kFp8BlockValues && kWideRope == 8, "the tile's shape");
  static_assert(kFp8ScaleOffset == 32 * 16 && kFp8RopeOffset == 33 * 16, "raw row: 32 latent chunks, scales, rope");

  extern __shared__ __align__(128) uint8_t smem_raw[];
  Plan& sm = *reinterpret_cast<Plan*>(smem_raw);

  const MlaDecodeParams& p = args.p;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int my_nt = warp >> 1, my_h = warp & 1;  // this warp's slice: n8 tile, row half
  const int tile = blockIdx.x, split = blockIdx.y;
  const int b = blockIdx.z / p.h_kv, kvh = blockIdx.z % p.h_kv;
  const int seqlen = p.seqlens[b];
  const int kps = args.keys_per_split;
  const int n_valid = (seqlen + kps - 1) / kps;
  if (split > 0 && split >= n_valid) return;  // nothing here; combine ignores it
  const bool direct = n_valid <= 1;

  const int group = p.h_q / p.h_kv;
  const int rows_kv = group * p.s_q;
  const int row0 = tile * 16;
  const int last_row = min(rows_kv, row0 + 16) - 1;
  const int key_begin = split * kps;
  const int key_end = min(seqlen, key_begin + kps);
  auto limit_of = [&](int token) { return p.causal ? seqlen - p.s_q + token + 1 : seqlen; };
  const int lim_min = limit_of(row0 / group);
  const int cta_end = min(key_end, limit_of(last_row / group));
  const int num_tiles = cta_end > key_begin ? (cta_end - key_begin + kN - 1) / kN : 0;

  const auto* kv8 = static_cast<const uint8_t*>(p.kv);
  const int32_t* table = p.block_table + int64_t(b) * p.block_table_batch_stride;
  const int64_t kv_head_off = int64_t(kvh) * p.kv_head_stride;
  auto page_of = [&](int t) { return table[(key_begin + t * kN) / kPageSize]; };
  // Raw rows of KV tile t into stage s: thread c of a key's kT copies chunks c, c + kT, ...
  // to their pieces. Keys past cta_end copy nothing (zero fill), never an unowned row.
  auto load_tile = [&](int t, int s, int page) {
    const int key0 = key_begin + t * kN;
    const int key = tid / kT, c = tid % kT;
    const bool valid = key0 + key < cta_end;
    const uint8_t* row_src =
        valid ? kv8 + int64_t(page) * p.kv_page_stride + kv_head_off + int64_t((key0 & (kPageSize - 1)) + key) * p.kv_row_stride
              : kv8;
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
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) load_tile(s, s, page_of(s));
    CpAsyncCommit();
  }
  int next_page = kStages - 1 < num_tiles ? page_of(kStages - 1) : 0;

  // Q, rows g and g + 8 of the tile: k-step j's A fragment holds dims (d, d+2) and
  // (d+1, d+3), d = 64 warp + 16 (lane % 4) + 4 j, the order of the K fragments; the rope
  // k-step (m16n8k8) dims 512 + 8 warp + 2 (lane % 4) and +1.
  uint32_t qf[4][4], qr[2];
  {
    auto q_row_ptr = [&](int r) -> const uint16_t* {
      const int row = row0 + r;
      const int token = row / group, head = kvh * group + row % group;
      return static_cast<const uint16_t*>(p.q) + int64_t(b) * p.q_batch_stride + int64_t(token) * p.q_seq_stride +
             int64_t(head) * p.q_head_stride;
    };
    const bool v0 = row0 + g < rows_kv, v1 = row0 + g + 8 < rows_kv;
    const uint16_t* q0 = v0 ? q_row_ptr(g) : nullptr;
    const uint16_t* q1 = v1 ? q_row_ptr(g + 8) : nullptr;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int d = warp * kWideCols + t4 * 16 + j * 4;
      const uint32_t u00 = v0 ? *reinterpret_cast<const uint32_t*>(q0 + d) : 0u;
      const uint32_t u01 = v0 ? *reinterpret_cast<const uint32_t*>(q0 + d + 2) : 0u;
      const uint32_t u10 = v1 ? *reinterpret_cast<const uint32_t*>(q1 + d) : 0u;
      const uint32_t u11 = v1 ? *reinterpret_cast<const uint32_t*>(q1 + d + 2) : 0u;
      qf[j][0] = __byte_perm(u00, u01, 0x5410);
      qf[j][1] = __byte_perm(u10, u11, 0x5410);
      qf[j][2] = __byte_perm(u00, u01, 0x7632);
      qf[j][3] = __byte_perm(u10, u11, 0x7632);
    }
    const int d = kHeadDimV + warp * kWideRope + t4 * 2;
    qr[0] = v0 ? *reinterpret_cast<const uint32_t*>(q0 + d) : 0u;
    qr[1] = v1 ? *reinterpret_cast<const uint32_t*>(q1 + d) : 0u;
  }

  int row_limit[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) row_limit[h] = limit_of(min(row0 + g + 8 * h, rows_kv - 1) / group);
  const int my_limit = my_h ? row_limit[1] : row_limit[0];

  float acc[8][4];  // n8 output tile 2 j + pair: columns (d, d+2) or (d+1, d+3) of k-step j's d
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // rows g, g + 8: running max (log2 domain, scaled)
  float l_own = 0.f;                        // this lane's share of its slice row's sum of P
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  uint32_t vfr[kNT][4][2];  // V fragments: [8-key block][k-step j][pair]

  for (int t = 0; t < num_tiles; ++t) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();  // tile t visible to all; every warp is done with tile t-1 (stage, P, partials)
    if (t + kStages - 1 < num_tiles) load_tile(t + kStages - 1, (t + kStages - 1) % kStages, next_page);
    CpAsyncCommit();
    if (t + kStages < num_tiles) next_page = page_of(t + kStages);
    const int stage = t % kStages;

    // Partial scores of the warp's dims: latent (converted here, exactly as DequantChunk),
    // then rope.
    float s[kNT][4];
#pragma unroll
    for (int i = 0; i < kNT; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = 0.f;
#pragma unroll
    for (int i = 0; i < kNT; ++i) {
      const int key = 8 * i + g, q = warp * 4 + t4;
      const uint32_t sp = Fp8ScalePair<kDType>(__float_as_uint(sm.scales[stage][key][warp >> 1]));
      const uint4 raw = *reinterpret_cast<const uint4*>(&sm.kv[stage][key][(q ^ ((key & 1) << 2)) << 4]);
      const uint32_t wd[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t k02 = Fma2NegZero<kDType>(E4m3PairBits<kDType>(wd[j] << 8), sp);
        const uint32_t k13 = Fma2NegZero<kDType>(E4m3PairBits<kDType>(wd[j]), sp);
        Mma<kDType>(s[i], qf[j], k02, k13);
        vfr[i][j][0] = MovTrans(k02);
        vfr[i][j][1] = MovTrans(k13);
      }
    }
#pragma unroll
    for (int i = 0; i < kNT; ++i) {
      const int key = 8 * i + g;
      const uint32_t kb = *reinterpret_cast<const uint32_t*>(&sm.rope[stage][key][((warp ^ (key & 7)) << 3) + t4 * 2]);
      Mma8<kDType>(s[i], qr[0], qr[1], kb);
    }

    // Cooperative reduction: the other slices' pairs go to their reducers; this warp sums
    // its own slice over the 8 warps.
    float x0 = 0.f, x1 = 0.f;
#pragma unroll
    for (int i = 0; i < kNT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (2 * i + h == warp) {
          x0 = s[i][2 * h];
          x1 = s[i][2 * h + 1];
        } else {
          *reinterpret_cast<float2*>(&sm.s_part[2 * i + h][warp][lane][0]) = make_float2(s[i][2 * h], s[i][2 * h + 1]);
        }
      }
    __syncthreads();
#pragma unroll
    for (int src = 0; src < kWideWarps; ++src) {
      if (src == warp) continue;
      const float2 u = *reinterpret_cast<const float2*>(&sm.s_part[warp][src][lane][0]);
      x0 += u.x;
      x1 += u.y;
    }
    const int key0 = key_begin + t * kN;
    if (key0 + kN > lim_min) {
      const int key = key0 + my_nt * 8 + t4 * 2;
      if (key >= my_limit) x0 = -INFINITY;
      if (key + 1 >= my_limit) x1 = -INFINITY;
    }
    const int my_row = g + 8 * my_h;
    float mx = fmaxf(x0, x1);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    if (t4 == 0) sm.row_max[my_row][my_nt] = mx;
    // This slice's P against max m_use; returns the lane's sum of it.
    uint16_t* p_tile = &sm.p[0][0][0];
    const int p_off = my_row * kN + ((my_nt ^ ((my_row >> 1) & 3)) << 3) + t4 * 2;
    auto store_p = [&](float m_use) {
      const float p0 = Exp2(fmaf(x0, scale_log2, -m_use));
      const float p1 = Exp2(fmaf(x1, scale_log2, -m_use));
      const uint32_t hi = Pack2<kDType>(p0, p1);
      *reinterpret_cast<uint32_t*>(p_tile + p_off) = hi;
      if constexpr (kSplitP) *reinterpret_cast<uint32_t*>(p_tile + 16 * kN + p_off) = PackLowBf16(p0, p1, hi);
      return p0 + p1;
    };
    bool exchange = true;
    if constexpr (kLazyMaxLog2 > 0) {
      // As the 4-warp tile: P against the running max as it stands, kept when no slice's
      // max is above it by more than 2^kLazyMaxLog2; the vote's barrier completes P.
      const float m_own = my_h ? m_run[1] : m_run[0];
      const bool over = mx * scale_log2 > m_own + kLazyMaxLog2;
      const float sum = store_p(m_own == -INFINITY ? 0.f : m_own);
      exchange = WideAny(over);
      if (!exchange) l_own += sum;
    }
    if (exchange) {
      if constexpr (kLazyMaxLog2 <= 0) __syncthreads();
      bool rescale = false;
      float alpha[2], m_use[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4 m4 = *reinterpret_cast<const float4*>(&sm.row_max[g + 8 * h][0]);
        const float m_new = fmaxf(m_run[h], fmaxf(fmaxf(m4.x, m4.y), fmaxf(m4.z, m4.w)) * scale_log2);
        m_use[h] = m_new == -INFINITY ? 0.f : m_new;  // no (-inf) - (-inf)
        alpha[h] = Exp2(m_run[h] - m_use[h]);
        rescale |= m_new != m_run[h];
        m_run[h] = m_new;
      }
      l_own = fmaf(l_own, my_h ? alpha[1] : alpha[0], store_p(my_h ? m_use[1] : m_use[0]));
      if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] *= alpha[e >> 1];
      }
      __syncthreads();  // P complete
    }

    // O[:, my 64 columns] += P V, P's planes by ldmatrix (rows 0-15, keys 16 kk ..).
    const uint32_t p_base = SmemAddr(p_tile);
#pragma unroll
    for (int kk = 0; kk < kNT / 2; ++kk) {
      uint32_t pa[4], pl[4];
      const int row = (lane & 7) + ((lane >> 3) & 1) * 8, chunk = kk * 2 + (lane >> 4);
      const uint32_t addr = p_base + (row * kN + ((chunk ^ ((row >> 1) & 3)) << 3)) * 2;
      Ldmatrix4(pa, addr);
      if constexpr (kSplitP) Ldmatrix4(pl, addr + 16 * kN * 2);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int pp = 0; pp < 2; ++pp) {
          const uint32_t b0 = vfr[2 * kk][j][pp], b1 = vfr[2 * kk + 1][j][pp];
          Mma<kDType>(acc[2 * j + pp], pa, b0, b1);
          if constexpr (kSplitP) Mma<kDType>(acc[2 * j + pp], pl, b0, b1);
        }
    }
  }
  CpAsyncWait<0>();

  // Row sums: a quad's slice sum, then the 4 slices of each row, added in one order by
  // every warp.
  l_own += __shfl_xor_sync(0xffffffffu, l_own, 1);
  l_own += __shfl_xor_sync(0xffffffffu, l_own, 2);
  if (t4 == 0) sm.row_sum[g + 8 * my_h][my_nt] = l_own;
  __syncthreads();

  const int rows_total = p.h_q * p.s_q;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float4 l4 = *reinterpret_cast<const float4*>(&sm.row_sum[g + 8 * h][0]);
    const float l = ((l4.x + l4.y) + l4.z) + l4.w;
    const int row = row0 + g + 8 * h;
    if (row >= rows_kv) continue;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float lse = l > 0.f ? (m_run[h] + __log2f(l)) * 0.6931471805599453f : -INFINITY;
    const int token = row / group, head = kvh * group + row % group;
    uint16_t* o16 = static_cast<uint16_t*>(p.out) + int64_t(b) * p.out_batch_stride + int64_t(token) * p.out_seq_stride +
                    int64_t(head) * p.out_head_stride;
    const int64_t prow = (int64_t(b) * args.num_splits + split) * rows_total + kvh * rows_kv + row;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int d = warp * kWideCols + t4 * 16 + j * 4;
      const float* lo = acc[2 * j];
      const float* hi = acc[2 * j + 1];
      const float v0 = lo[2 * h] * inv, v1 = hi[2 * h] * inv, v2 = lo[2 * h + 1] * inv, v3 = hi[2 * h + 1] * inv;
      if (direct) {
        *reinterpret_cast<uint32_t*>(o16 + d) = Pack2<kDType>(v0, v1);
        *reinterpret_cast<uint32_t*>(o16 + d + 2) = Pack2<kDType>(v2, v3);
      } else {
        *reinterpret_cast<float4*>(args.o_part + prow * kHeadDimV + d) = make_float4(v0, v1, v2, v3);
      }
    }
    if (warp == 0 && t4 == 0) {
      if (direct) {
        p.lse[int64_t(b) * p.lse_batch_stride + int64_t(head) * p.lse_head_stride + token] = lse;
      } else {
        args.lse_part[prow] = lse;
      }
    }
  }

  // Fused split-K combine (as FusedCombineTail): the last CTA of the stream merges.
  if (!direct && args.counters != nullptr) {
    __threadfence();
    __syncthreads();  // every warp is past the main loop, shared memory is free
    int* last_flag = reinterpret_cast<int*>(&sm.s_part[0][0][0][0]);
    if (tid == 0) {
      const unsigned int arrived =
          atomicInc(args.counters + int64_t(blockIdx.z) * args.row_tiles + blockIdx.x, unsigned(n_valid - 1));
      *last_flag = arrived == unsigned(n_valid - 1);
    }
    __syncthreads();
    if (!*last_flag) return;
    __threadfence();
    CombineTile<kDType, 16, kWideThreads>(args, b, kvh, row0, min(rows_kv - row0, 16), n_valid,
                                          reinterpret_cast<float*>(smem_raw));
  }
}

}  // namespace latentd::kernels::sm80
