// Validation and sizing of the KV cache pool.
#include "engine/kv/config.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace latentd::engine::kv {
namespace {

// Block table entries and the kernel's page count are int32.
constexpr int64_t kMaxPhysicalPages = std::numeric_limits<int32_t>::max();

absl::Status ValidateShape(int num_layers, int num_heads_kv, int bytes_per_value,
                           kernels::KvDType kv_dtype, kernels::DType dtype) {
  if (num_layers <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers: must be positive, got ", num_layers));
  }
  if (num_heads_kv <= 0 || num_heads_kv > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_heads_kv: must be in [1, 1024], got ", num_heads_kv));
  }
  if (bytes_per_value != 1 && bytes_per_value != 2 && bytes_per_value != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes_per_value: must be 1, 2 or 4, got ", bytes_per_value));
  }
  if (kv_dtype != kernels::KvDType::kModel && kv_dtype != kernels::KvDType::kFp8E4M3) {
    return absl::InvalidArgumentError(absl::StrCat("kv_dtype: must be the model dtype or fp8_e4m3, got ",
                                                   static_cast<int>(kv_dtype)));
  }
  if (dtype != kernels::DType::kBF16 && dtype != kernels::DType::kFP16) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype: must be bf16 or fp16, got ", static_cast<int>(dtype)));
  }
  // The fp8 format quantizes rows of 16-bit values (kernels/kv_fp8.h).
  if (kv_dtype == kernels::KvDType::kFp8E4M3 && bytes_per_value != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bytes_per_value: an fp8_e4m3 cache takes 2-byte input values, got ", bytes_per_value));
  }
  return absl::OkStatus();
}

absl::StatusOr<KvCacheConfig> FromBytes(int num_layers, int num_heads_kv, int64_t bytes,
                                        int bytes_per_value, kernels::KvDType kv_dtype,
                                        kernels::DType dtype, const char* what) {
  if (absl::Status s = ValidateShape(num_layers, num_heads_kv, bytes_per_value, kv_dtype, dtype);
      !s.ok()) {
    return s;
  }
  KvCacheConfig c{num_layers, num_heads_kv, 0, bytes_per_value, kv_dtype, dtype};
  int64_t pages = bytes > 0 ? bytes / c.page_bytes() : 0;
  if (pages <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", bytes, " bytes hold no page; one page (", num_layers, " layers x 64 x ",
        num_heads_kv, " heads x ", c.row_bytes() / num_heads_kv, " bytes, ",
        kernels::KvDTypeName(kv_dtype, dtype), ") needs ", c.page_bytes()));
  }
  c.num_pages = std::min(pages, kMaxPhysicalPages / num_layers);
  return c;
}

}  // namespace

bool SamePool(const KvCacheConfig& a, const KvCacheConfig& b) {
  return a.num_layers == b.num_layers && a.num_heads_kv == b.num_heads_kv &&
         a.num_pages == b.num_pages && a.bytes_per_value == b.bytes_per_value &&
         a.kv_dtype == b.kv_dtype && a.dtype == b.dtype;
}

absl::Status KvCacheConfig::Validate() const {
  if (absl::Status s = ValidateShape(num_layers, num_heads_kv, bytes_per_value, kv_dtype, dtype);
      !s.ok()) {
    return s;
  }
  if (num_pages <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages: must be positive, got ", num_pages));
  }
  if (num_pages > kMaxPhysicalPages / num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_pages: ", num_pages, " x ", num_layers,
        " layers exceeds the 2^31-1 pages an int32 block table addresses"));
  }
  return absl::OkStatus();
}

absl::StatusOr<KvCacheConfig> KvCacheConfig::FromPages(int num_layers, int num_heads_kv,
                                                       int64_t num_pages,
                                                       int bytes_per_value,
                                                       kernels::KvDType kv_dtype,
                                                       kernels::DType dtype) {
  KvCacheConfig c{num_layers, num_heads_kv, num_pages, bytes_per_value, kv_dtype, dtype};
  if (absl::Status s = c.Validate(); !s.ok()) return s;
  return c;
}

absl::StatusOr<KvCacheConfig> KvCacheConfig::FromBudget(int num_layers, int num_heads_kv,
                                                        int64_t byte_budget,
                                                        int bytes_per_value,
                                                        kernels::KvDType kv_dtype,
                                                        kernels::DType dtype) {
  return FromBytes(num_layers, num_heads_kv, byte_budget, bytes_per_value, kv_dtype, dtype,
                   "kv_bytes");
}

absl::StatusOr<KvCacheConfig> KvCacheConfig::FromMemoryFraction(int num_layers,
                                                                int num_heads_kv,
                                                                int64_t available_bytes,
                                                                double fraction,
                                                                int bytes_per_value,
                                                                kernels::KvDType kv_dtype,
                                                                kernels::DType dtype) {
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_memory_fraction: must be in (0, 1], got ", fraction));
  }
  if (available_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("available memory: must not be negative, got ", available_bytes));
  }
  auto bytes = static_cast<int64_t>(static_cast<double>(available_bytes) * fraction);
  return FromBytes(num_layers, num_heads_kv, bytes, bytes_per_value, kv_dtype, dtype,
                   "kv_memory_fraction");
}

}  // namespace latentd::engine::kv
