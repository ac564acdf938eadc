// Argument checks shared by every KvStorage, and the host implementation.
#include "engine/kv/storage.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace latentd::engine::kv {

absl::Status CheckRowRange(const KvCacheConfig& config, int layer, int32_t page, int row,
                           int n, const void* buffer) {
  if (layer < 0 || layer >= config.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: ", layer, " is out of range [0, ", config.num_layers, ")"));
  }
  if (page < 0 || page >= config.num_pages) {
    return absl::InvalidArgumentError(
        absl::StrCat("page: ", page, " is out of range [0, ", config.num_pages, ")"));
  }
  if (row < 0 || row >= kPageSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("row: ", row, " is out of range [0, ", kPageSize, ")"));
  }
  if (n < 0 || row + n > kPageSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "n: rows [", row, ", ", int64_t{row} + n, ") do not fit in one page of ", kPageSize));
  }
  if (n > 0 && buffer == nullptr) {
    return absl::InvalidArgumentError("buffer: null");
  }
  return absl::OkStatus();
}

absl::Status CheckPagePair(const KvCacheConfig& config, int32_t src_page, int32_t dst_page) {
  if (src_page < 0 || src_page >= config.num_pages) {
    return absl::InvalidArgumentError(absl::StrCat("src_page: ", src_page,
                                                   " is out of range [0, ", config.num_pages,
                                                   ")"));
  }
  if (dst_page < 0 || dst_page >= config.num_pages) {
    return absl::InvalidArgumentError(absl::StrCat("dst_page: ", dst_page,
                                                   " is out of range [0, ", config.num_pages,
                                                   ")"));
  }
  return absl::OkStatus();
}

void QuantizeRowsFp8(const KvCacheConfig& config, int n, const void* src, void* dst) {
  const auto* s = static_cast<const uint16_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
  const int64_t heads = int64_t{n} * config.num_heads_kv;
  for (int64_t i = 0; i < heads; ++i) {
    kernels::QuantizeKvRowFp8(config.dtype, s + i * kHeadDim, d + i * kernels::kFp8RowBytes);
  }
}

namespace {

// Page-aligned so rows never straddle cache lines awkwardly and huge pages can back it.
constexpr size_t kAlignment = 4096;

class HostKvStorage final : public KvStorage {
 public:
  HostKvStorage(const KvCacheConfig& config, char* data) : config_(config), data_(data) {}
  ~HostKvStorage() override { std::free(data_); }

  const KvCacheConfig& config() const override { return config_; }
  void* base() override { return data_; }

  absl::Status WriteRows(int layer, int32_t page, int row, int n, const void* src) override {
    if (absl::Status s = CheckRowRange(config_, layer, page, row, n, src); !s.ok()) return s;
    if (n == 0) return absl::OkStatus();
    if (config_.kv_dtype == kernels::KvDType::kFp8E4M3) {
      QuantizeRowsFp8(config_, n, src, RowPtr(layer, page, row));  // rows of a page are contiguous
    } else {
      std::memcpy(RowPtr(layer, page, row), src, n * config_.row_bytes());
    }
    return absl::OkStatus();
  }

  absl::Status ReadRows(int layer, int32_t page, int row, int n, void* dst) override {
    if (absl::Status s = CheckRowRange(config_, layer, page, row, n, dst); !s.ok()) return s;
    if (n > 0) std::memcpy(dst, RowPtr(layer, page, row), n * config_.row_bytes());
    return absl::OkStatus();
  }

  absl::Status WriteStoredRows(int layer, int32_t page, int row, int n, const void* src) override {
    if (absl::Status s = CheckRowRange(config_, layer, page, row, n, src); !s.ok()) return s;
    if (n > 0) std::memcpy(RowPtr(layer, page, row), src, n * config_.row_bytes());
    return absl::OkStatus();
  }

  absl::Status CopyPage(int32_t src_page, int32_t dst_page) override {
    if (absl::Status s = CheckPagePair(config_, src_page, dst_page); !s.ok()) return s;
    if (src_page == dst_page) return absl::OkStatus();
    for (int layer = 0; layer < config_.num_layers; ++layer) {
      std::memcpy(RowPtr(layer, dst_page, 0), RowPtr(layer, src_page, 0),
                  config_.layer_page_bytes());
    }
    return absl::OkStatus();
  }

 private:
  char* RowPtr(int layer, int32_t page, int row) { return data_ + config_.RowOffset(layer, page, row); }

  const KvCacheConfig config_;
  char* const data_;
};

}  // namespace

std::optional<uint8_t> PoolFillByte() {
  const char* poison = std::getenv("LATENTD_KV_POISON");
  if (poison != nullptr && std::strcmp(poison, "1") == 0) return 0xff;
  if (poison != nullptr && std::strcmp(poison, "uninit") == 0) return std::nullopt;
  return 0;
}

absl::StatusOr<std::unique_ptr<KvStorage>> MakeHostKvStorage(const KvCacheConfig& config) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  const int64_t bytes = config.total_bytes();
  const size_t rounded = (static_cast<size_t>(bytes) + kAlignment - 1) / kAlignment * kAlignment;
  void* data = std::aligned_alloc(kAlignment, rounded);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kv cache: cannot allocate ", bytes, " bytes of host memory for ",
                     config.num_pages, " pages"));
  }
  std::memset(data, PoolFillByte().value_or(0), rounded);
  return std::unique_ptr<KvStorage>(new HostKvStorage(config, static_cast<char*>(data)));
}

absl::StatusOr<int64_t> PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) {
    return absl::UnavailableError("kv cache: cannot read the physical memory size");
  }
  return int64_t{pages} * page_size;
}

}  // namespace latentd::engine::kv
