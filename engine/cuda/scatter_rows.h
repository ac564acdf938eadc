// Writes a batch's new KV rows from device staging into their pool slots, so one
// host-to-device copy per batch carries every step's rows; an fp8 pool gets them
// quantized on the way. Plain C++ header.
#pragma once

#include <cstdint>

#include "kernels/params.h"

typedef struct CUstream_st* cudaStream_t;

namespace latentd::engine {

// Copies n rows of row_bytes bytes: src row i (contiguous) goes to pool row dst_rows[i],
// where a pool row index is physical_page * 64 + row_in_page. row_bytes % 16 == 0.
// Returns a cudaError_t value (0 = success).
int LaunchScatterRows(const void* src, const int64_t* dst_rows, int n, int row_bytes, void* pool,
                      cudaStream_t stream);

// The same for an fp8_e4m3 pool (kernels/kv_fp8.h): src row i is h_kv x 576 values in
// `dtype`; pool row dst_rows[i] receives h_kv x 656 bytes, bit-identical to what
// QuantizeKvRowFp8 makes of each head's row. Returns a cudaError_t value.
int LaunchScatterRowsFp8(const void* src, const int64_t* dst_rows, int n, int h_kv, kernels::DType dtype,
                         void* pool, cudaStream_t stream);

}  // namespace latentd::engine

namespace latentd::engine {

// One copy of a list run by LaunchCopyList: device-visible addresses (device memory, or
// host memory registered as mapped), 2-byte aligned; 16-byte aligned ones move faster.
struct DeviceCopy {
  uint64_t src = 0, dst = 0;
  uint64_t bytes = 0;
};

// Runs n copies (the list itself in device memory) in one launch: each copy is split
// into chunks of 16 KiB over the CTAs of one grid column, so host-mapped transfers keep
// many PCIe reads in flight. max_bytes bounds every copy's size. Returns a cudaError_t.
int LaunchCopyList(const DeviceCopy* list, int n, uint64_t max_bytes, cudaStream_t stream);

}  // namespace latentd::engine
