// What one CTA of the decode kernel works on: its row tile, split-K partition, sequence
// and KV head, the keys it covers and where their pages are. Computed once at the start
// of the kernel and read by every phase (kernel.cuh, the FP8 pipeline headers).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/params.h"
#include "kernels/sm80/launch.h"

namespace latentd::kernels::sm80::detail {

template <class T>
struct Cta {
  const MlaDecodeParams* p;
  int tid, lane;
  int grp, warp;  // group, and warp within the group
  int grow0;      // the group's first row in the tile
  int tile, split;
  int b, kvh;
  int seqlen;
  int kps;      // keys per partition
  int n_valid;  // partitions of this sequence that hold keys; 1: it writes out/lse itself
  int group;    // query heads per KV head
  int rows_kv;  // rows sharing this KV head
  int row0, last_row;
  int key_begin, key_end;
  int lim_min;  // the lowest key limit of the tile's rows
  int cta_end;  // keys past this are not read (past the partition, or past every row's causal limit)
  int num_tiles;
  const uint16_t* kv;
  const int32_t* table;
  int64_t kv_head_off;

  // The coordinates from the grid position, in two steps: Locate, then, unless Empty
  // (this CTA's partition holds no keys; combine ignores it), Init.
  __device__ __forceinline__ void Locate(const DecodeArgs& args) {
    p = &args.p;
    tid = threadIdx.x;
    lane = tid & 31;
    grp = tid >> 7;
    warp = (tid >> 5) & 3;
    grow0 = grp * T::kGroupRows;
    tile = blockIdx.x;
    split = blockIdx.y;
    b = blockIdx.z / p->h_kv;
    kvh = blockIdx.z % p->h_kv;
    seqlen = p->seqlens[b];
    kps = args.keys_per_split;
    n_valid = (seqlen + kps - 1) / kps;
  }
  __device__ __forceinline__ bool Empty() const { return split > 0 && split >= n_valid; }
  __device__ __forceinline__ void Init() {
    group = p->h_q / p->h_kv;
    rows_kv = group * p->s_q;
    row0 = tile * T::kRows;
    last_row = min(rows_kv, row0 + T::kRows) - 1;
    key_begin = split * kps;
    key_end = min(seqlen, key_begin + kps);
    lim_min = LimitOf(row0 / group);
    cta_end = min(key_end, LimitOf(last_row / group));
    num_tiles = cta_end > key_begin ? (cta_end - key_begin + T::kN - 1) / T::kN : 0;
    kv = static_cast<const uint16_t*>(p->kv);
    table = p->block_table + int64_t(b) * p->block_table_batch_stride;
    kv_head_off = int64_t(kvh) * p->kv_head_stride;
  }

  // Query token i sees keys below seqlen - s_q + i + 1 when causal.
  __device__ inline int LimitOf(int token) const { return p->causal ? seqlen - p->s_q + token + 1 : seqlen; }
  // Page of KV tile t (a tile never straddles pages).
  __device__ inline int PageOf(int t) const { return table[(key_begin + t * T::kN) / kPageSize]; }
  // Query row r of this tile -> (token, head) -> element offset in q.
  __device__ inline const uint16_t* QRow(int r) const {
    const int row = row0 + r;
    const int token = row / group, head = kvh * group + row % group;
    return static_cast<const uint16_t*>(p->q) + int64_t(b) * p->q_batch_stride + int64_t(token) * p->q_seq_stride +
           int64_t(head) * p->q_head_stride;
  }
};

}  // namespace latentd::kernels::sm80::detail
