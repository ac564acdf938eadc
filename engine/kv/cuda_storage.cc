// KvStorage over device memory through the CUDA runtime API (compiled by the host
// compiler; no kernels needed: rows are written with copies, fp8 rows quantized on the
// host first by the same function the host storage uses).
#include "engine/kv/cuda_storage.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace latentd::engine::kv {
namespace {

absl::Status CudaError(cudaError_t err, absl::string_view what) {
  const absl::StatusCode code = err == cudaErrorMemoryAllocation
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat("kv cache: ", what, ": ", cudaGetErrorName(err),
                                         ": ", cudaGetErrorString(err)));
}

#define LATENTD_KV_CUDA(call, what)                      \
  do {                                                   \
    if (cudaError_t err_ = (call); err_ != cudaSuccess) { \
      return CudaError(err_, what);                      \
    }                                                    \
  } while (0)

class CudaKvStorage final : public KvStorage {
 public:
  CudaKvStorage(const KvCacheConfig& config, int device, cudaStream_t stream, char* data)
      : config_(config), device_(device), stream_(stream), data_(data) {
    // One page of quantized rows: the most one WriteRows carries.
    if (config_.kv_dtype == kernels::KvDType::kFp8E4M3) {
      scratch_.resize(static_cast<size_t>(config_.layer_page_bytes()));
    }
  }
  ~CudaKvStorage() override {
    cudaSetDevice(device_);
    if (read_stream_ != nullptr) {
      cudaStreamSynchronize(read_stream_);
      cudaStreamDestroy(read_stream_);
    }
    if (issued_ != nullptr) cudaEventDestroy(issued_);
    cudaFree(data_);
  }

  const KvCacheConfig& config() const override { return config_; }
  void* base() override { return data_; }

  absl::Status WriteRows(int layer, int32_t page, int row, int n, const void* src) override {
    if (absl::Status s = CheckRowRange(config_, layer, page, row, n, src); !s.ok()) return s;
    if (n == 0) return absl::OkStatus();
    LATENTD_KV_CUDA(cudaSetDevice(device_), "cudaSetDevice");
    if (config_.kv_dtype == kernels::KvDType::kFp8E4M3) {
      // Quantized into pageable scratch: cudaMemcpyAsync has staged a pageable source
      // when it returns, so the scratch is free again for the next call. The lock is
      // uncontended in the engine (the manager writes under its own lock).
      absl::MutexLock lock(&scratch_mu_);
      QuantizeRowsFp8(config_, n, src, scratch_.data());
      LATENTD_KV_CUDA(cudaMemcpyAsync(RowPtr(layer, page, row), scratch_.data(),
                                      n * config_.row_bytes(), cudaMemcpyHostToDevice, stream_),
                      "write rows");
      return absl::OkStatus();
    }
    LATENTD_KV_CUDA(cudaMemcpyAsync(RowPtr(layer, page, row), src, n * config_.row_bytes(),
                                    cudaMemcpyHostToDevice, stream_),
                    "write rows");
    return absl::OkStatus();
  }

  absl::Status ReadRows(int layer, int32_t page, int row, int n, void* dst) override {
    if (absl::Status s = CheckRowRange(config_, layer, page, row, n, dst); !s.ok()) return s;
    if (n == 0) return absl::OkStatus();
    LATENTD_KV_CUDA(cudaSetDevice(device_), "cudaSetDevice");
    LATENTD_KV_CUDA(cudaMemcpyAsync(dst, RowPtr(layer, page, row), n * config_.row_bytes(),
                                    cudaMemcpyDeviceToHost, stream_),
                    "read rows");
    LATENTD_KV_CUDA(cudaStreamSynchronize(stream_), "read rows");
    return absl::OkStatus();
  }

  // On a stream of its own, after everything issued so far on the pool's stream (an
  // event orders it), so bulk reads (exports, offloads) run beside later kernels instead
  // of holding them up.
  absl::Status ReadRowsAsync(int layer, int32_t page, int row, int n, void* dst) override {
    if (absl::Status s = CheckRowRange(config_, layer, page, row, n, dst); !s.ok()) return s;
    if (n == 0) return absl::OkStatus();
    LATENTD_KV_CUDA(cudaSetDevice(device_), "cudaSetDevice");
    if (read_stream_ == nullptr) {
      LATENTD_KV_CUDA(cudaStreamCreateWithFlags(&read_stream_, cudaStreamNonBlocking), "read stream");
      LATENTD_KV_CUDA(cudaEventCreateWithFlags(&issued_, cudaEventDisableTiming), "read event");
    }
    LATENTD_KV_CUDA(cudaEventRecord(issued_, stream_), "read rows");
    LATENTD_KV_CUDA(cudaStreamWaitEvent(read_stream_, issued_, 0), "read rows");
    LATENTD_KV_CUDA(cudaMemcpyAsync(dst, RowPtr(layer, page, row), n * config_.row_bytes(),
                                    cudaMemcpyDeviceToHost, read_stream_),
                    "read rows");
    return absl::OkStatus();
  }

  absl::Status WriteStoredRows(int layer, int32_t page, int row, int n, const void* src) override {
    if (absl::Status s = CheckRowRange(config_, layer, page, row, n, src); !s.ok()) return s;
    if (n == 0) return absl::OkStatus();
    LATENTD_KV_CUDA(cudaSetDevice(device_), "cudaSetDevice");
    // The import's buffer is pageable and reused at once: staged by CUDA before the
    // call returns, like WriteRows' sources.
    LATENTD_KV_CUDA(cudaMemcpyAsync(RowPtr(layer, page, row), src, n * config_.row_bytes(),
                                    cudaMemcpyHostToDevice, stream_),
                    "write stored rows");
    return absl::OkStatus();
  }

  absl::Status CopyPage(int32_t src_page, int32_t dst_page) override {
    if (absl::Status s = CheckPagePair(config_, src_page, dst_page); !s.ok()) return s;
    if (src_page == dst_page) return absl::OkStatus();
    LATENTD_KV_CUDA(cudaSetDevice(device_), "cudaSetDevice");
    // Layer l of a logical page sits l * num_pages storage pages further on: one strided
    // 2D copy moves the page in every layer.
    const size_t pitch = static_cast<size_t>(config_.num_pages * config_.layer_page_bytes());
    LATENTD_KV_CUDA(cudaMemcpy2DAsync(RowPtr(0, dst_page, 0), pitch, RowPtr(0, src_page, 0),
                                      pitch, static_cast<size_t>(config_.layer_page_bytes()),
                                      static_cast<size_t>(config_.num_layers),
                                      cudaMemcpyDeviceToDevice, stream_),
                    "copy page");
    return absl::OkStatus();
  }

  absl::Status SynchronizeReads() override {
    if (read_stream_ == nullptr) return absl::OkStatus();
    LATENTD_KV_CUDA(cudaSetDevice(device_), "cudaSetDevice");
    LATENTD_KV_CUDA(cudaStreamSynchronize(read_stream_), "synchronize reads");
    return absl::OkStatus();
  }

  absl::Status Synchronize() override {
    LATENTD_KV_CUDA(cudaSetDevice(device_), "cudaSetDevice");
    if (read_stream_ != nullptr) LATENTD_KV_CUDA(cudaStreamSynchronize(read_stream_), "synchronize reads");
    LATENTD_KV_CUDA(cudaStreamSynchronize(stream_), "synchronize");
    return absl::OkStatus();
  }

 private:
  char* RowPtr(int layer, int32_t page, int row) { return data_ + config_.RowOffset(layer, page, row); }

  const KvCacheConfig config_;
  const int device_;
  const cudaStream_t stream_;
  char* const data_;
  // ReadRowsAsync's stream and the event that orders it after stream_ (made on first
  // use; the manager's callers serialise, as for every other call here).
  cudaStream_t read_stream_ = nullptr;
  cudaEvent_t issued_ = nullptr;
  absl::Mutex scratch_mu_;
  std::vector<uint8_t> scratch_ ABSL_GUARDED_BY(scratch_mu_);
};

absl::Status UseDevice(int device) {
  int count = 0;
  if (cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("kv cache: no usable CUDA device: ",
                                               cudaGetErrorString(err)));
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: ", device, " is out of range [0, ", count, ")"));
  }
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("kv cache: cannot use device ", device, ": ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvStorage>> MakeCudaKvStorage(const KvCacheConfig& config,
                                                             int device, cudaStream_t stream) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  if (absl::Status s = UseDevice(device); !s.ok()) return s;
  void* data = nullptr;
  const size_t bytes = static_cast<size_t>(config.total_bytes());
  if (cudaError_t err = cudaMalloc(&data, bytes); err != cudaSuccess) {
    cudaGetLastError();  // not sticky, but leave no error behind for the next call
    return absl::ResourceExhaustedError(
        absl::StrCat("kv cache: cannot allocate ", bytes, " bytes on device ", device,
                     " for ", config.num_pages, " pages: ", cudaGetErrorString(err)));
  }
  // Zeroed so unwritten rows read back deterministically (or poisoned, or left unwritten
  // for compute-sanitizer's initcheck: PoolFillByte).
  cudaError_t err = cudaSuccess;
  if (const std::optional<uint8_t> fill = PoolFillByte(); fill.has_value()) {
    err = cudaMemsetAsync(data, *fill, bytes, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  }
  if (err != cudaSuccess) {
    cudaFree(data);
    return CudaError(err, "zero the pool");
  }
  return std::unique_ptr<KvStorage>(
      new CudaKvStorage(config, device, stream, static_cast<char*>(data)));
}

absl::StatusOr<int64_t> CudaFreeMemoryBytes(int device) {
  if (absl::Status s = UseDevice(device); !s.ok()) return s;
  size_t free_bytes = 0, total_bytes = 0;
  LATENTD_KV_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return static_cast<int64_t>(free_bytes);
}

absl::StatusOr<KvCacheConfig> KvCacheConfigFromFreeGpuMemory(int num_layers,
                                                             int num_heads_kv,
                                                             double fraction, int device,
                                                             int bytes_per_value,
                                                             kernels::KvDType kv_dtype,
                                                             kernels::DType dtype) {
  absl::StatusOr<int64_t> free_bytes = CudaFreeMemoryBytes(device);
  if (!free_bytes.ok()) return free_bytes.status();
  return KvCacheConfig::FromMemoryFraction(num_layers, num_heads_kv, *free_bytes, fraction,
                                           bytes_per_value, kv_dtype, dtype);
}

}  // namespace latentd::engine::kv
