// Where the KV cache's bytes live, apart from the bookkeeping that decides which page
// a row goes to. One tensor [L * num_pages, 64, h_kv, 576] (fp8: 656 bytes per head)
// allocated once; the host implementation here backs the CPU engine and the tests
// (device memory: cuda_storage.h).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/kv/config.h"

namespace latentd::engine::kv {

class KvStorage {
 public:
  virtual ~KvStorage() = default;

  virtual const KvCacheConfig& config() const = 0;
  // The tensor [L * num_pages, 64, h_kv, 576]: host or device memory, per implementation.
  virtual void* base() = 0;
  // Copies n rows from host memory `src` (contiguous, n * input_row_bytes: 16-bit
  // values as clients send them) into rows [row, row + n) of `layer` in logical page
  // `page`; the rows must stay inside the page. An fp8 cache stores each head's row as
  // QuantizeKvRowFp8 makes it.
  virtual absl::Status WriteRows(int layer, int32_t page, int row, int n,
                                 const void* src) = 0;
  // The stored bytes (n * row_bytes: fp8 rows stay quantized) into host memory `dst`;
  // complete when it returns. For tests and debugging.
  virtual absl::Status ReadRows(int layer, int32_t page, int row, int n, void* dst) = 0;
  // The same, complete only after Synchronize (device memory: the copy is queued behind
  // everything issued before it), so that many pages' reads cost one wait.
  virtual absl::Status ReadRowsAsync(int layer, int32_t page, int row, int n, void* dst) {
    return ReadRows(layer, page, row, n, dst);
  }
  // Waits for the ReadRowsAsync copies issued so far only (not for other work).
  virtual absl::Status SynchronizeReads() { return Synchronize(); }
  // Copies n rows already in the storage format (n * row_bytes: fp8 rows as
  // ReadRows returns them) from host memory `src` into rows [row, row + n) of `layer`
  // in logical page `page`, unchanged: an import writes another pool's rows with it.
  // `src` may be reused once it returns.
  virtual absl::Status WriteStoredRows(int layer, int32_t page, int row, int n, const void* src) = 0;
  // Copies logical page `src_page` onto `dst_page` in every layer (copy-on-write).
  virtual absl::Status CopyPage(int32_t src_page, int32_t dst_page) = 0;
  // Waits until every write and copy issued so far has landed (no-op on the host).
  virtual absl::Status Synchronize() { return absl::OkStatus(); }
};

// Checks the arguments of WriteRows / ReadRows against `config`; the message names the
// argument. Shared by the implementations so they reject the same things.
absl::Status CheckRowRange(const KvCacheConfig& config, int layer, int32_t page, int row,
                           int n, const void* buffer);
absl::Status CheckPagePair(const KvCacheConfig& config, int32_t src_page, int32_t dst_page);

// Quantizes n tokens' rows (n * h_kv rows of 576 16-bit values, contiguous) into
// n * row_bytes bytes of the fp8 format, one QuantizeKvRowFp8 per head row.
void QuantizeRowsFp8(const KvCacheConfig& config, int n, const void* src, void* dst);

// The byte a new pool is filled with: 0, or 0xff when the environment sets
// LATENTD_KV_POISON=1 (NaN in bf16, fp16 and e4m3 and in the fp8 scales), so that a
// decode reading a row nobody wrote returns NaN instead of a plausible number; nullopt
// for LATENTD_KV_POISON=uninit, which leaves a device pool unwritten so that
// compute-sanitizer's initcheck names any kernel reading a row nobody wrote (a host
// pool is zeroed then). Testing aids (docs/testing.md); the default pool reads
// unwritten rows as zeros.
std::optional<uint8_t> PoolFillByte();

// Host memory, allocated and zeroed once (so the pool is committed up front rather than
// failing on first touch). RESOURCE_EXHAUSTED when the allocation fails.
absl::StatusOr<std::unique_ptr<KvStorage>> MakeHostKvStorage(const KvCacheConfig& config);

// Physical RAM in bytes, for sizing the host pool from a fraction.
absl::StatusOr<int64_t> PhysicalMemoryBytes();

}  // namespace latentd::engine::kv
