// Writes a batch's new KV rows from device staging into their pool slots, so one
// host-to-device copy per batch carries every step's rows. Plain C++ header.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace latentd::engine {

// Copies n rows of row_bytes bytes: src row i (contiguous) goes to pool row dst_rows[i],
// where a pool row index is physical_page * 64 + row_in_page. row_bytes % 16 == 0.
// Returns a cudaError_t value (0 = success).
int LaunchScatterRows(const void* src, const int64_t* dst_rows, int n, int row_bytes, void* pool,
                      cudaStream_t stream);

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
