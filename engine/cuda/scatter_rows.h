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
