// Helper kernels for the decode benchmark: a read-bandwidth ceiling (16-byte loads,
// grid-stride) and a hash-based random fill (never zeros: zeros can run faster).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "tools/bench/bench_kernels.h"

namespace latentd::bench {
namespace {

__global__ void ReadKernel(const uint4* __restrict__ data, size_t n, uint32_t* sink) {
  uint32_t x = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // Four independent loads in flight per thread.
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = data[i], b = data[i + stride], c = data[i + 2 * stride], d = data[i + 3 * stride];
    x ^= a.x ^ a.w ^ b.y ^ b.z ^ c.x ^ c.w ^ d.y ^ d.z;
  }
  for (; i < n; i += stride) x ^= data[i].x;
  if (x == 0x12345678u) sink[blockIdx.x] = x;  // practically never; keeps the loads
}

__device__ __forceinline__ uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// u as a bf16 or fp16 bit pattern.
__device__ __forceinline__ uint16_t ToHalfBits(float u, bool is_bf16) {
  if (is_bf16) {
    __nv_bfloat16 h = __float2bfloat16(u);
    return *reinterpret_cast<uint16_t*>(&h);
  }
  __half h = __float2half(u);
  return *reinterpret_cast<uint16_t*>(&h);
}

__global__ void FillKernel(uint16_t* data, size_t n, uint64_t seed, bool is_bf16) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u = float(Mix(seed + i) >> 40) * (4.0f / 16777216.0f) - 2.0f;
    data[i] = ToHalfBits(u, is_bf16);
  }
}

// FP8 cache rows (kernels/kv_fp8.h): random e4m3 codes, scale 2^-7 for every block
// (values up to +-3.5), random 16-bit rope values; one thread per 16-byte chunk.
__global__ void Fp8FillKernel(uint4* rows, size_t n_chunks, uint64_t seed, bool is_bf16) {
  constexpr int kChunks = 41;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_chunks; i += size_t(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(i % kChunks);
    uint32_t w[4];
    for (int j = 0; j < 4; ++j) {
      const uint64_t r = Mix(seed + i * 4 + j);
      if (c < 32) {
        w[j] = static_cast<uint32_t>(r) & 0xf7f7f7f7u;  // no e4m3 NaN codes
      } else if (c == 32) {
        w[j] = 0x3c000000u;  // 2^-7
      } else {
        uint16_t h[2];
        for (int k = 0; k < 2; ++k)
          h[k] = ToHalfBits(float((r >> (20 * k)) & 0xfffff) * (4.0f / 1048576.0f) - 2.0f, is_bf16);
        w[j] = h[0] | (uint32_t(h[1]) << 16);
      }
    }
    rows[i] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace

int LaunchFp8RowFill(void* rows, size_t n_rows, uint64_t seed, bool is_bf16, cudaStream_t stream) {
  Fp8FillKernel<<<4096, 256, 0, stream>>>(static_cast<uint4*>(rows), n_rows * 41, seed, is_bf16);
  return static_cast<int>(cudaGetLastError());
}

int LaunchReadKernel(const void* data, size_t bytes, uint32_t* sink, cudaStream_t stream) {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  ReadKernel<<<sms * 8, 256, 0, stream>>>(static_cast<const uint4*>(data), bytes / 16, sink);
  return static_cast<int>(cudaGetLastError());
}

int LaunchRandomFill(uint16_t* data, size_t n, uint64_t seed, bool is_bf16, cudaStream_t stream) {
  FillKernel<<<4096, 256, 0, stream>>>(data, n, seed, is_bf16);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace latentd::bench
