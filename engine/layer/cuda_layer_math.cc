// CudaLayerMath: the MLA layer's projections as cuBLAS GEMMs in the model dtype (fp32
// accumulation, rounded in the epilogue) plus the RMSNorm and RoPE kernels of
// cuda/layer_kernels.cu, at CpuLayerMath's rounding points.
#include "engine/layer/cuda_layer_math.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/layer/rope.h"

namespace latentd::engine::layer {
namespace {

using kernels::DType;

absl::Status CudaError(cudaError_t e, const char* what) {
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::Status Cuda(cudaError_t e, const char* what) { return e == cudaSuccess ? absl::OkStatus() : CudaError(e, what); }

absl::Status Blas(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cublasGetStatusName(s), " (", cublasGetStatusString(s), ")");
  if (s == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::Status CheckDevice(int device) {
  int count = 0;
  if (absl::Status s = Cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount"); !s.ok()) return s;
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("device: expected [0, ", count, "), got ", device));
  }
  return absl::OkStatus();
}

// Makes `device` current for a scope and puts the caller's device back afterwards.
class DeviceScope {
 public:
  DeviceScope() = default;
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    if (changed_) cudaSetDevice(previous_);
  }

  absl::Status Enter(int device) {
    if (absl::Status s = Cuda(cudaGetDevice(&previous_), "cudaGetDevice"); !s.ok()) return s;
    if (previous_ == device) return absl::OkStatus();
    if (absl::Status s = Cuda(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
    changed_ = true;
    return absl::OkStatus();
  }

 private:
  int previous_ = 0;
  bool changed_ = false;
};

cudaDataType_t BlasType(DType dtype) { return dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F; }

absl::Status Kernel(int e, const char* what) { return Cuda(static_cast<cudaError_t>(e), what); }

constexpr int64_t kAlign = 256;

int64_t AlignUp(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

}  // namespace

// ---- CublasHandle ----

absl::StatusOr<std::shared_ptr<CublasHandle>> CublasHandle::Create(int device, int64_t workspace_bytes) {
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  if (workspace_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("workspace_bytes: expected >= 0, got ", workspace_bytes));
  }
  DeviceScope scope;
  if (absl::Status s = scope.Enter(device); !s.ok()) return s;
  std::shared_ptr<CublasHandle> h(new CublasHandle());
  h->device_ = device;
  if (absl::Status s = Blas(cublasCreate(&h->handle_), "cublasCreate"); !s.ok()) return s;
  // Split-K partial sums stay float32 (cuBLAS may otherwise reduce them in the output's
  // 16-bit type), so the GEMM's one rounding is the output's, as CpuLayerMath rounds.
  const cublasMath_t math =
      static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
  if (absl::Status s = Blas(cublasSetMathMode(h->handle_, math), "cublasSetMathMode"); !s.ok()) return s;
  if (workspace_bytes > 0) {
    if (absl::Status s = Cuda(cudaMalloc(&h->workspace_, static_cast<size_t>(workspace_bytes)), "cudaMalloc (cuBLAS workspace)");
        !s.ok()) {
      return s;
    }
  }
  h->workspace_bytes_ = workspace_bytes;
  if (absl::Status s = h->Bind(nullptr); !s.ok()) return s;
  return h;
}

CublasHandle::~CublasHandle() {
  DeviceScope scope;
  if (!scope.Enter(device_).ok()) return;
  if (handle_ != nullptr) cublasDestroy(handle_);
  if (workspace_ != nullptr) cudaFree(workspace_);
}

absl::Status CublasHandle::Bind(cudaStream_t stream) {
  if (bound_ && stream == stream_) return absl::OkStatus();
  bound_ = false;
  if (absl::Status s = Blas(cublasSetStream(handle_, stream), "cublasSetStream"); !s.ok()) return s;
  if (absl::Status s = Blas(cublasSetWorkspace(handle_, workspace_, static_cast<size_t>(workspace_bytes_)),
                            "cublasSetWorkspace");
      !s.ok()) {
    return s;
  }
  stream_ = stream;
  bound_ = true;
  return absl::OkStatus();
}

// ---- CudaRopeTable ----

absl::StatusOr<std::shared_ptr<const CudaRopeTable>> CudaRopeTable::Create(const RopeConfig& config,
                                                                           int max_positions, int device) {
  absl::StatusOr<Rope> rope = Rope::Create(config, max_positions);
  if (!rope.ok()) return rope.status();
  if (config.dim != kRopeDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("qk_rope_head_dim: expected ", kRopeDim, " (one pair per lane of a warp), got ", config.dim));
  }
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  DeviceScope scope;
  if (absl::Status s = scope.Enter(device); !s.ok()) return s;
  std::shared_ptr<CudaRopeTable> t(new CudaRopeTable());
  t->config_ = config;
  t->device_ = device;
  const int64_t half = static_cast<int64_t>(rope->cos_table().size() * sizeof(float));
  t->device_bytes_ = 2 * half;
  if (absl::Status s = Cuda(cudaMalloc(&t->memory_, static_cast<size_t>(t->device_bytes_)), "cudaMalloc (rope table)");
      !s.ok()) {
    return s;
  }
  float* cos = static_cast<float*>(t->memory_);
  float* sin = cos + rope->cos_table().size();
  for (auto [dst, src] : {std::pair{cos, rope->cos_table()}, std::pair{sin, rope->sin_table()}}) {
    if (absl::Status s = Cuda(cudaMemcpy(dst, src.data(), static_cast<size_t>(half), cudaMemcpyHostToDevice),
                              "cudaMemcpy (rope table)");
        !s.ok()) {
      return s;
    }
  }
  t->table_ = DeviceRopeTable{cos, sin, rope->max_positions(), rope->interleave()};
  return t;
}

CudaRopeTable::~CudaRopeTable() {
  if (memory_ == nullptr) return;
  DeviceScope scope;
  if (scope.Enter(device_).ok()) cudaFree(memory_);
}

bool CudaRopeTable::Matches(const RopeConfig& c, int max_positions) const {
  if (max_positions != table_.max_positions || c.dim != config_.dim || c.theta != config_.theta ||
      c.interleave != config_.interleave || c.yarn.has_value() != config_.yarn.has_value()) {
    return false;
  }
  if (!c.yarn.has_value()) return true;
  const model::YarnScaling &a = *c.yarn, &b = *config_.yarn;
  return a.factor == b.factor && a.original_max_position_embeddings == b.original_max_position_embeddings &&
         a.beta_fast == b.beta_fast && a.beta_slow == b.beta_slow && a.mscale == b.mscale &&
         a.mscale_all_dim == b.mscale_all_dim;
}

// ---- CudaLayerMath ----

absl::StatusOr<std::unique_ptr<CudaLayerMath>> CudaLayerMath::Create(const model::ModelConfig& config,
                                                                     const model::AttentionLayerWeights& weights,
                                                                     const LayerMathOptions& options, int max_tokens,
                                                                     int device, Shared shared) {
  // CpuLayerMath's checks, in its order: the config, the rotary table (Rope::Create, here
  // while making the device copy; a shared table was checked when it was made), the weights.
  if (absl::Status s = CheckLayerConfig(config, options); !s.ok()) return s;
  const RopeConfig rope_config = RopeConfig::FromModel(config);
  if (shared.rope == nullptr) {
    absl::StatusOr<std::shared_ptr<const CudaRopeTable>> own =
        CudaRopeTable::Create(rope_config, options.max_positions, device);
    if (!own.ok()) return own.status();
    shared.rope = *std::move(own);
  } else if (shared.rope->device() != device) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope: a table of device ", shared.rope->device(), ", not of device ", device));
  } else if (!shared.rope->Matches(rope_config, options.max_positions)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rope: the shared table is not this config's for max_positions = ", options.max_positions,
        " (it has ", shared.rope->max_positions(), " positions; theta, rope_scaling or rope_interleave may differ)"));
  }
  if (absl::Status s = CheckLayerWeights(config, weights, options); !s.ok()) return s;
  if (max_tokens < 1 || max_tokens > kMaxTokens) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: expected [1, ", kMaxTokens, "], got ", max_tokens));
  }
  if (absl::Status s = CheckDevice(device); !s.ok()) return s;
  if (shared.blas == nullptr) {
    absl::StatusOr<std::shared_ptr<CublasHandle>> own = CublasHandle::Create(device);
    if (!own.ok()) return own.status();
    shared.blas = *std::move(own);
  } else if (shared.blas->device() != device) {
    return absl::InvalidArgumentError(
        absl::StrCat("blas: a cuBLAS handle of device ", shared.blas->device(), ", not of device ", device));
  }

  std::unique_ptr<CudaLayerMath> m(new CudaLayerMath());
  const int64_t H = config.hidden_size, h = options.num_heads, nope = config.qk_nope_head_dim,
                v = config.v_head_dim, qk = nope + kRopeDim, T = max_tokens;
  m->dtype_ = config.dtype;
  m->device_ = device;
  m->hidden_ = config.hidden_size;
  m->heads_ = options.num_heads;
  m->nope_ = config.qk_nope_head_dim;
  m->v_dim_ = config.v_head_dim;
  m->max_tokens_ = max_tokens;
  m->eps_ = static_cast<float>(config.rms_norm_eps);
  m->has_q_lora_ = config.q_lora_rank.has_value();
  m->q_rank_ = config.q_lora_rank.value_or(0);
  m->blas_ = std::move(shared.blas);
  m->rope_ = std::move(shared.rope);

  // One allocation: each piece at a 256-byte offset. First the layout, then the copies.
  struct Piece {
    int64_t offset = 0;
    const void* host = nullptr;  // copied in at Create; null for scratch
    int64_t bytes = 0;
  };
  std::vector<Piece> pieces;
  int64_t total = 0;
  auto place = [&](const void* host, int64_t bytes) {
    pieces.push_back({total, host, bytes});
    total += AlignUp(bytes);
    return pieces.size() - 1;
  };
  auto place_weight = [&](const model::HostTensor& t) {
    m->weight_bytes_ += t.bytes();
    return place(t.values.data(), t.bytes());
  };
  const int64_t e = sizeof(uint16_t);
  size_t q_a = 0, q_a_norm = 0, q_b = 0, q_proj = 0;
  if (m->has_q_lora_) {
    q_a = place_weight(weights.q_a_proj);
    q_a_norm = place_weight(weights.q_a_layernorm);
    q_b = place_weight(weights.q_b_proj);
  } else {
    q_proj = place_weight(weights.q_proj);
  }
  const size_t kv_a = place_weight(weights.kv_a_proj_with_mqa);
  const size_t kv_a_norm = place_weight(weights.kv_a_layernorm);
  const size_t kv_b = place_weight(weights.kv_b_proj);
  const size_t o_proj = place_weight(weights.o_proj);
  const size_t q_a_out = place(nullptr, T * m->q_rank_ * e);
  const size_t q_full = place(nullptr, T * h * qk * e);
  const size_t o = place(nullptr, T * h * v * e);

  DeviceScope scope;
  if (absl::Status s = scope.Enter(device); !s.ok()) return s;
  if (absl::Status s = Cuda(cudaMalloc(&m->arena_, static_cast<size_t>(total)), "cudaMalloc (layer weights)"); !s.ok()) {
    return s;
  }
  m->arena_bytes_ = total;
  char* base = static_cast<char*>(m->arena_);
  for (const Piece& p : pieces) {
    if (p.host == nullptr || p.bytes == 0) continue;
    if (absl::Status s = Cuda(cudaMemcpy(base + p.offset, p.host, static_cast<size_t>(p.bytes), cudaMemcpyHostToDevice),
                              "cudaMemcpy (layer weights)");
        !s.ok()) {
      return s;
    }
  }
  auto at = [&](size_t i) { return reinterpret_cast<uint16_t*>(base + pieces[i].offset); };
  auto matrix = [&](size_t i, int64_t rows, int64_t cols) {
    return Matrix{at(i), static_cast<int>(rows), static_cast<int>(cols)};
  };
  if (m->has_q_lora_) {
    m->q_a_ = matrix(q_a, m->q_rank_, H);
    m->q_a_norm_ = at(q_a_norm);
    m->q_b_ = matrix(q_b, h * qk, m->q_rank_);
  } else {
    m->q_proj_ = matrix(q_proj, h * qk, H);
  }
  m->kv_a_ = matrix(kv_a, kLatentRank + kRopeDim, H);
  m->kv_a_norm_ = at(kv_a_norm);
  m->kv_b_ = at(kv_b);
  m->o_proj_ = matrix(o_proj, H, h * v);
  m->q_a_out_ = at(q_a_out);
  m->q_full_ = at(q_full);
  m->o_ = at(o);
  return m;
}

CudaLayerMath::~CudaLayerMath() {
  if (arena_ == nullptr) return;
  DeviceScope scope;
  if (scope.Enter(device_).ok()) cudaFree(arena_);
}

absl::Status CudaLayerMath::CheckCall(int n, const void* a, const char* a_name, const void* b, const char* b_name,
                                      const void* c, const char* c_name) const {
  if (n < 1 || n > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat("n: expected [1, max_tokens = ", max_tokens_, "], got ", n));
  }
  for (auto [p, name] : {std::pair{a, a_name}, std::pair{b, b_name}, std::pair{c, c_name}}) {
    if (name != nullptr && p == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, ": null"));
  }
  return absl::OkStatus();
}

absl::Status CudaLayerMath::Linear(const uint16_t* x, int n, const Matrix& w, void* y, bool float_out) const {
  // Row-major y [n, out] = x [n, in] . W^T is column-major y^T [out, n] = W^T [out, in] (W
  // read as column-major [in, out], transposed) . x^T [in, n]: TN, leading dimensions in, in, out.
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType_t t = BlasType(dtype_);
  return Blas(cublasGemmEx(blas_->get(), CUBLAS_OP_T, CUBLAS_OP_N, w.rows, n, w.cols, &one, w.data, t, w.cols, x, t,
                           w.cols, &zero, y, float_out ? CUDA_R_32F : t, w.rows, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx");
}

absl::Status CudaLayerMath::Queries(const uint16_t* x, const int32_t* positions, int n, uint16_t* q,
                                    cudaStream_t stream) {
  if (absl::Status s = CheckCall(n, x, "x", positions, "positions", q, "q"); !s.ok()) return s;
  DeviceScope scope;
  if (absl::Status s = scope.Enter(device_); !s.ok()) return s;
  if (absl::Status s = blas_->Bind(stream); !s.ok()) return s;
  const int qk = nope_ + kRopeDim;
  if (has_q_lora_) {
    if (absl::Status s = Linear(x, n, q_a_, q_a_out_, false); !s.ok()) return s;
    if (absl::Status s = Kernel(LaunchRmsNorm(dtype_, q_a_out_, n, q_rank_, q_rank_, q_a_norm_, eps_, stream),
                                "q_a_layernorm kernel");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Linear(q_a_out_, n, q_b_, q_full_, false); !s.ok()) return s;
  } else {
    if (absl::Status s = Linear(x, n, q_proj_, q_full_, false); !s.ok()) return s;
  }
  // Absorption, all heads in one batched GEMM written straight into q: per head
  // q_lat_h [n, 512] = q_nope_h [n, nope] . W_UK_h [nope, 512]. Column-major: q_lat_h^T
  // [512, n] = W_UK_h (row-major [nope, 512] = column-major [512, nope], ld 512) . q_nope_h^T
  // (ld h * qk); heads step by (nope + v) rows of kv_b_proj, qk values of q_full, 576 of q.
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType_t t = BlasType(dtype_);
  const int64_t kv_b_head = static_cast<int64_t>(nope_ + v_dim_) * kLatentRank;
  if (absl::Status s = Blas(cublasGemmStridedBatchedEx(
                                blas_->get(), CUBLAS_OP_N, CUBLAS_OP_N, kLatentRank, n, nope_, &one, kv_b_, t,
                                kLatentRank, kv_b_head, q_full_, t, heads_ * qk, qk, &zero, q, t,
                                heads_ * kernels::kHeadDimQK, kernels::kHeadDimQK, heads_, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT),
                            "cublasGemmStridedBatchedEx (W_UK)");
      !s.ok()) {
    return s;
  }
  // RoPE(q_pe) from q_full into the last 64 values of each head of q.
  return Kernel(LaunchRope(dtype_, q_full_ + nope_, int64_t{heads_} * qk, qk, q + kLatentRank,
                           int64_t{heads_} * kernels::kHeadDimQK, kernels::kHeadDimQK, n, heads_, positions, rope_->table(),
                           stream),
                "q rope kernel");
}

absl::Status CudaLayerMath::LatentRows(const uint16_t* x, const int32_t* positions, int n, uint16_t* rows,
                                       cudaStream_t stream) {
  if (absl::Status s = CheckCall(n, x, "x", positions, "positions", rows, "rows"); !s.ok()) return s;
  DeviceScope scope;
  if (absl::Status s = scope.Enter(device_); !s.ok()) return s;
  if (absl::Status s = blas_->Bind(stream); !s.ok()) return s;
  // kv_a_proj_with_mqa writes [c | k_pe] into the rows themselves, then one kernel normalises
  // c and rotates k_pe in place.
  if (absl::Status s = Linear(x, n, kv_a_, rows, false); !s.ok()) return s;
  return Kernel(LaunchLatentNormRope(dtype_, rows, n, kv_a_norm_, eps_, positions, rope_->table(), stream),
                "latent norm and rope kernel");
}

absl::Status CudaLayerMath::OutputInto(const uint16_t* latent_out, int n, void* out, bool float_out,
                                       cudaStream_t stream) {
  if (absl::Status s = CheckCall(n, latent_out, "latent_out", out, "out", nullptr, nullptr); !s.ok()) return s;
  DeviceScope scope;
  if (absl::Status s = scope.Enter(device_); !s.ok()) return s;
  if (absl::Status s = blas_->Bind(stream); !s.ok()) return s;
  // Per head o_h [n, v] = latent_out_h [n, 512] . W_UV_h^T, one batched GEMM. Column-major:
  // o_h^T [v, n] = W_UV_h^T (row-major [v, 512] = column-major [512, v], transposed)
  // . latent_out_h^T (ld h * 512); written into o [n, h * v] at column j * v, rounded.
  const float one = 1.0f, zero = 0.0f;
  const cudaDataType_t t = BlasType(dtype_);
  const int64_t kv_b_head = static_cast<int64_t>(nope_ + v_dim_) * kLatentRank;
  if (absl::Status s = Blas(cublasGemmStridedBatchedEx(
                                blas_->get(), CUBLAS_OP_T, CUBLAS_OP_N, v_dim_, n, kLatentRank, &one,
                                kv_b_ + static_cast<int64_t>(nope_) * kLatentRank, t, kLatentRank, kv_b_head,
                                latent_out, t, heads_ * kLatentRank, kLatentRank, &zero, o_, t, heads_ * v_dim_,
                                v_dim_, heads_, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                            "cublasGemmStridedBatchedEx (W_UV)");
      !s.ok()) {
    return s;
  }
  return Linear(o_, n, o_proj_, out, float_out);
}

absl::Status CudaLayerMath::Output(const uint16_t* latent_out, int n, uint16_t* out, cudaStream_t stream) {
  return OutputInto(latent_out, n, out, false, stream);
}

absl::Status CudaLayerMath::OutputFloat(const uint16_t* latent_out, int n, float* out, cudaStream_t stream) {
  return OutputInto(latent_out, n, out, true, stream);
}

}  // namespace latentd::engine::layer
