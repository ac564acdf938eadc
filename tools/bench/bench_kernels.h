// Helper kernels for the decode benchmark: a read-bandwidth ceiling and random fills.
// Plain C++ declarations; the definitions are in bench_kernels.cu.
#pragma once

#include <cstddef>
#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace latentd::bench {

// Reads `bytes` (a multiple of 16) with 16-byte loads; writes one word per CTA so the
// loads cannot be removed. Returns a cudaError_t value (0 = success).
int LaunchReadKernel(const void* data, size_t bytes, uint32_t* sink, cudaStream_t stream);

// Fills n 16-bit values with random bf16 (is_bf16) or fp16 numbers in [-2, 2).
int LaunchRandomFill(uint16_t* data, size_t n, uint64_t seed, bool is_bf16, cudaStream_t stream);

// Fills n_rows rows of the FP8 cache format (656 bytes each) with random codes, a valid
// power-of-two scale per block and random 16-bit rope values.
int LaunchFp8RowFill(void* rows, size_t n_rows, uint64_t seed, bool is_bf16, cudaStream_t stream);

}  // namespace latentd::bench
