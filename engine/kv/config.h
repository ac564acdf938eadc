// The shape and size of the paged KV cache: how many layers and KV heads one logical
// page holds, how many pages the pool has, and how page ids map to the storage tensor.
// Plain data with sizing helpers; no CUDA and no allocation.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kv_fp8.h"
#include "kernels/params.h"

namespace latentd::engine::kv {

inline constexpr int kPageSize = kernels::kPageSize;    // tokens per page
inline constexpr int kHeadDim = kernels::kHeadDimQK;    // values per head per row

struct KvCacheConfig {
  int num_layers = 0;       // L
  int num_heads_kv = 0;     // h_kv
  int64_t num_pages = 0;    // logical pages; each holds 64 tokens for every layer
  int bytes_per_value = 2;  // of the rows clients send: bf16 / fp16
  // How rows are stored: as sent, or quantized to the FP8 format of kernels/kv_fp8.h
  // (656 bytes per head instead of 1152), whose rope half stays in `dtype`.
  kernels::KvDType kv_dtype = kernels::KvDType::kModel;
  kernels::DType dtype = kernels::DType::kBF16;  // the model dtype (fp8 needs it to quantize)

  // Storage is one tensor [L * num_pages, 64, h_kv, 576] (fp8: [.., h_kv, 656 bytes]). The
  // kernel addresses it with an int32 block table and an int page count, so
  // L * num_pages must fit in int32.
  // Bytes one token of one layer takes in the pool (every KV head).
  int64_t row_bytes() const {
    return kv_dtype == kernels::KvDType::kFp8E4M3 ? int64_t{num_heads_kv} * kernels::kFp8RowBytes
                                                  : input_row_bytes();
  }
  // Bytes of one token of one layer as clients send it: h_kv x 576 16-bit values. What
  // WriteRows reads per row; equal to row_bytes() unless the cache is fp8.
  int64_t input_row_bytes() const { return int64_t{num_heads_kv} * kHeadDim * bytes_per_value; }
  // What one token costs in the pool across every layer.
  int64_t token_bytes() const { return num_layers * row_bytes(); }
  int64_t layer_page_bytes() const { return kPageSize * row_bytes(); }
  // One logical page across every layer: what one page of the pool costs.
  int64_t page_bytes() const { return num_layers * layer_page_bytes(); }
  int64_t total_bytes() const { return num_pages * page_bytes(); }
  // Pages of the storage tensor (the kernel's num_pages).
  int64_t physical_pages() const { return num_layers * num_pages; }
  // The storage page that holds `layer` of logical page `page`. A step's block table for
  // layer l is the sequence's block table plus PageOffset(l).
  int64_t PageOffset(int layer) const { return int64_t{layer} * num_pages; }
  int64_t PhysicalPage(int layer, int32_t page) const { return PageOffset(layer) + page; }
  // Byte offset of a row in the storage tensor.
  int64_t RowOffset(int layer, int32_t page, int row) const {
    return PhysicalPage(layer, page) * layer_page_bytes() + int64_t{row} * row_bytes();
  }

  // OK when every field is in range; the message names the field.
  absl::Status Validate() const;

  // Exactly `num_pages` pages.
  // The sizing helpers take the storage format last; pages follow from page_bytes(),
  // so an fp8 cache holds 1152 / 656 = 1.76x the tokens of a bf16 one in the same bytes.
  static absl::StatusOr<KvCacheConfig> FromPages(
      int num_layers, int num_heads_kv, int64_t num_pages, int bytes_per_value = 2,
      kernels::KvDType kv_dtype = kernels::KvDType::kModel,
      kernels::DType dtype = kernels::DType::kBF16);
  // As many pages as fit in `byte_budget` (at least one, at most what int32 page ids
  // address).
  static absl::StatusOr<KvCacheConfig> FromBudget(
      int num_layers, int num_heads_kv, int64_t byte_budget, int bytes_per_value = 2,
      kernels::KvDType kv_dtype = kernels::KvDType::kModel,
      kernels::DType dtype = kernels::DType::kBF16);
  // As many pages as fit in `fraction` (0, 1] of `available_bytes` (free GPU memory or
  // physical RAM, as the caller measured it).
  static absl::StatusOr<KvCacheConfig> FromMemoryFraction(
      int num_layers, int num_heads_kv, int64_t available_bytes, double fraction,
      int bytes_per_value = 2, kernels::KvDType kv_dtype = kernels::KvDType::kModel,
      kernels::DType dtype = kernels::DType::kBF16);
};

// Whether two configs describe the same pool (shape, size and storage format).
bool SamePool(const KvCacheConfig& a, const KvCacheConfig& b);

// Pages needed to hold `tokens` rows: ceil(tokens / 64).
inline int64_t PagesForTokens(int64_t tokens) { return (tokens + kPageSize - 1) / kPageSize; }

}  // namespace latentd::engine::kv
