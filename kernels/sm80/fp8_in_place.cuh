// FP8 KV cache, dequantized in place (Fp8Pipeline::kInPlace: the 16- and 32-row tiles,
// the 64-row tile's A100 plan). A tile's raw rows land in the KV stage that will hold its
// 16-bit values; once they have landed, the CTA converts them through registers into the
// swizzled 16-bit layout the mma loops read, so each value is dequantized once per CTA
// and the shared-memory plan is the 16-bit cache's.
#pragma once

#include <cstdint>

#include "kernels/kv_fp8.h"
#include "kernels/sm80/cta.cuh"
#include "kernels/sm80/fp8_common.cuh"
#include "kernels/sm80/primitives.cuh"
#include "kernels/sm80/traits.h"

namespace latentd::kernels::sm80::detail {

// The 16-row tile converts the chunks each thread copied itself ("own" chunks, f0bd541,
// 2ddcd90): it reads them as soon as its own copies have landed, before the tile's first
// barrier, which then also orders every read before any write: one barrier per tile
// fewer. The others convert in passes after a barrier.
template <class T>
inline constexpr bool kFp8OwnChunks = T::kFp8Pipeline == Fp8Pipeline::kInPlace && T::kRows == 16;

// The registers that carry a thread's own raw chunks across the tile's barrier.
template <class T>
struct Fp8OwnRegs {
  uint4 raw[kFp8OwnChunks<T> ? kHeadDimV / 16 / (T::kCta / T::kN) : 1];
  uint4 scales;
};

template <class T>
struct Fp8InPlace {
  using Plan = typename T::SharedMemoryPlan;
  static constexpr int kN = T::kN, kCta = T::kCta;
  static constexpr int kRawChunks = kFp8RowBytes / 16;             // 41 per row
  static constexpr int kDequantItems = kN * (kHeadDimV / 16 + 8);  // 32 latent + 8 rope chunks per row
  static_assert(kDequantItems % kCta == 0, "dequantization must divide evenly");
  // Raw rows at the end of their stage. Key k's values (bytes [1152 k, 1152 k + 1152))
  // overlap no raw row of a key >= k while k <= kN - 3, which the first dequantization
  // pass (the first half of the keys) relies on.
  static constexpr int kRawOffset = kN * (kHeadDimQK * 2 - kFp8RowBytes);
  static_assert(kRawOffset % 16 == 0, "raw rows stay 16-byte aligned");
  // Items per thread per pass: 2 on the 32-row tile (one pass spills there),
  // kTile64Sm80Fp8Passes on the 64-row tile (its A100 plan).
  static constexpr int kInPlacePasses = T::kRows == 64 ? kTile64Sm80Fp8Passes : 2;
  static constexpr int kPassItems = (kDequantItems / kCta + kInPlacePasses - 1) / kInPlacePasses;
  static_assert((kDequantItems / kCta - 1) / kPassItems * kPassItems * kCta / (kHeadDimV / 16 + 8) <= kN - 3,
                "every pass but the last clear of later passes' raw rows");

  // Own chunks (16-row tile). Where key k's pieces land in its 16-bit row of the stage
  // ([1152 k, 1152 k + 1152)): its rope values (16-bit already) straight in their final,
  // swizzled place (bytes 1024-1151); its 512 raw latent codes in bytes 512-1023; the
  // scale slots of its four threads in bytes 0-63. The latent values written after the
  // barrier cover bytes 0-1023, raw codes and slots alike, once every thread has read
  // its own. Each of a key's kCta / kN threads copies the key's scale chunk into a slot
  // of its own.
  static constexpr bool kOwn = kFp8OwnChunks<T>;
  static constexpr int kOwnT = kCta / kN;                   // threads per raw row
  static constexpr int kOwnItems = kHeadDimV / 16 / kOwnT;  // latent chunks per thread
  static constexpr int kOwnRawAt = kHeadDimV;               // raw latent codes: byte 512 of the 16-bit row
  static_assert(!kOwn || (kOwnT == 4 && kOwnItems == 8), "own chunks: 4 threads per row, 8 latent chunks each");
  static_assert(kOwnT * 16 <= kOwnRawAt && kOwnRawAt + kHeadDimV <= kHeadDimV * 2,
                "scale slots, raw codes and rope apart within a 16-bit row");

  // Copies tile t's raw rows (on `page`) into stage s.
  static __device__ __forceinline__ void CopyTile(const Cta<T>& cta, Plan& sm, int t, int s, int page) {
    // Packed raw rows at the stage's end (kRawOffset), but for own chunks.
    const uint32_t dst0 = kOwn ? 0u : SmemAddr(&sm.kv[s][0][0]) + kRawOffset;
    const Fp8RowCopy<T> rc(cta, t, page);
    constexpr int kT = Fp8RowCopy<T>::kT;
    if constexpr (kOwn) {
      // Latent chunks c, c + 4, ..., c + 28 (raw), rope chunks c and c + 4 (in place),
      // and the row's scales into this thread's slot (layout above).
      const int key = rc.key, c = rc.c;
      const uint8_t* row_src = rc.src - c * 16;
      const uint32_t row16 = SmemAddr(&sm.kv[s][0][0]) + key * (kHeadDimQK * 2);
#pragma unroll
      for (int i = 0; i < kOwnItems; ++i)
        CpAsync16(row16 + kOwnRawAt + (c + 4 * i) * 16, row_src + (c + 4 * i) * 16, rc.valid);
#pragma unroll
      for (int r = c; r < 8; r += 4)
        CpAsync16(SmemAddr(&sm.kv[s][0][0]) + Swizzle(key, kHeadDimV / 8 + r) * 2, row_src + kFp8RopeOffset + r * 16,
                  rc.valid);
      CpAsync16(row16 + c * 16, row_src + kFp8ScaleOffset, rc.valid);
    } else {
      const uint32_t dst = dst0 + rc.key * kFp8RowBytes + rc.c * 16;
#pragma unroll
      for (int j = 0; j < (kRawChunks + kT - 1) / kT; ++j) {
        if ((kRawChunks % kT) != 0 && j == kRawChunks / kT && rc.c >= kRawChunks % kT) break;
        CpAsync16(dst + j * kT * 16, rc.src + j * kT * 16, rc.valid);
      }
    }
  }

  // Own chunks: this thread's copies of the tile in `stage` have landed; read them before
  // the tile's barrier.
  static __device__ __forceinline__ void ReadOwn(const Cta<T>& cta, const Plan& sm, int stage, Fp8OwnRegs<T>& own) {
    const int key = cta.tid / kOwnT, c = cta.tid % kOwnT;
    const uint8_t* row16 = reinterpret_cast<const uint8_t*>(&sm.kv[stage][key][0]);
#pragma unroll
    for (int i = 0; i < kOwnItems; ++i)
      own.raw[i] = *reinterpret_cast<const uint4*>(row16 + kOwnRawAt + (c + 4 * i) * 16);
    own.scales = *reinterpret_cast<const uint4*>(row16 + c * 16);
  }

  // After the tile's barrier: the tile in `stage` becomes 16-bit values, published by a
  // barrier of its own.
  // raw, scale_bits: the registers of one pass, declared by the kernel (see kernel.cuh on
  // register arrays).
  static __device__ __forceinline__ void Convert(const Cta<T>& cta, Plan& sm, int stage, const Fp8OwnRegs<T>& own,
                                                 uint4 (&raw)[kPassItems], uint32_t (&scale_bits)[kPassItems]) {
    const int tid = cta.tid;
    if constexpr (kOwn) {
      // This thread's latent chunks c + 4 i of row key (scale block i / 2); the rope
      // values landed in place.
      uint16_t* tile_elems = &sm.kv[stage][0][0];
      const int key = tid / kOwnT, c = tid % kOwnT;
      const uint32_t scale_word[4] = {own.scales.x, own.scales.y, own.scales.z, own.scales.w};
#pragma unroll
      for (int i = 0; i < kOwnItems; ++i) {
        const int j = c + 4 * i;
        uint4 lo, hi;
        DequantChunk<T::kDType>(own.raw[i], Fp8ScalePair<T::kDType>(scale_word[i / 2]), lo, hi);
        *reinterpret_cast<uint4*>(tile_elems + Swizzle(key, 2 * j)) = lo;
        *reinterpret_cast<uint4*>(tile_elems + Swizzle(key, 2 * j + 1)) = hi;
      }
      __syncthreads();
    } else {
      // Raw rows -> registers, sync, dequantized values -> the same stage; in passes of
      // kPassItems items per thread, to bound the registers it takes. The raw rows sit at
      // the stage's end (kRawOffset), so a pass's values never land on a later pass's
      // raw rows (static_assert above).
      constexpr int kPer = kDequantItems / kCta, kItemsPerRow = kHeadDimV / 16 + 8;
      const uint8_t* raw_rows = reinterpret_cast<const uint8_t*>(&sm.kv[stage][0][0]) + kRawOffset;
      uint16_t* tile_elems = &sm.kv[stage][0][0];
#pragma unroll 1
      for (int first = 0; first < kPer; first += kPassItems) {
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
            DequantChunk<T::kDType>(raw[i], Fp8ScalePair<T::kDType>(scale_bits[i]), lo, hi);
            *reinterpret_cast<uint4*>(tile_elems + Swizzle(key, 2 * c)) = lo;
            *reinterpret_cast<uint4*>(tile_elems + Swizzle(key, 2 * c + 1)) = hi;
          } else {
            *reinterpret_cast<uint4*>(tile_elems + Swizzle(key, kHeadDimV / 8 + c - 32)) = raw[i];
          }
        }
      }
      __syncthreads();
    }
  }
};

}  // namespace latentd::kernels::sm80::detail
