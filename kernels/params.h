// The MLA decode problem as plain data: shapes, dtype, pointers and strides, shared by
// the CPU implementation and the SM80 CUDA kernel. Layouts follow FlashMLA's.
// Plain C++ on purpose: no CUDA, absl or spdlog types.
#pragma once

#include <cstdint>
#include <string>

namespace latentd::kernels {

inline constexpr int kHeadDimQK = 576;  // 512 latent ("nope") + 64 rope values per KV row.
inline constexpr int kHeadDimV = 512;   // Values are the first 512 values of the same row.
inline constexpr int kPageSize = 64;    // Tokens per KV cache page.
inline constexpr int kMaxHeadsPerKvHead = 128;

enum class DType : int { kBF16 = 0, kFP16 = 1 };

const char* DTypeName(DType dtype);
inline int DTypeBytes(DType) { return 2; }

// How the KV cache stores rows: in the model dtype, or in the FP8 format of
// kernels/kv_fp8.h (e4m3 latent values with per-128 scales, rope in the model dtype).
enum class KvDType : int { kModel = 0, kFp8E4M3 = 1 };

// "bf16" / "fp16" for kModel (the model dtype's name), "fp8_e4m3".
const char* KvDTypeName(KvDType kv_dtype, DType dtype);

// How the CUDA kernel rounds the softmax probabilities P of a bf16 model to 16 bits for
// the PV mma (docs/p-rounding.md). kSplit: a high and a low bf16 part, multiplied
// twice (~16 significant bits; the default and the tighter accuracy contract). kOnce:
// one bf16 rounding (8 bits), the accuracy class of FlashMLA and FlashInfer, faster on
// compute-bound calls. fp16 models round P once to fp16 (11 bits) either way, and the
// CPU implementation keeps P in fp32 (exact) under both.
enum class PRounding : int { kSplit = 0, kOnce = 1 };

// "split" / "once".
const char* PRoundingName(PRounding rounding);

// Which shared-memory plan of the 64-row tile a kernel uses (kernels/sm80/traits.h, DecodeTraits):
// SM90's (up to 227 KB per CTA) or the A100 plan (within A100's 163 KB). The 16- and
// 32-row tiles have one plan; their DecodePlans carry kSm90.
enum class SmemPlan : int { kSm90 = 0, kA100 = 1 };

// How a tile reads an FP8 cache (docs/fp8-kv-cache.md): kNone for 16-bit caches;
// kInPlace dequantizes each landed tile in its own stage (16- and 32-row tiles, the
// 64-row tile's A100 plan); kRegisters converts the codes in registers straight into
// mma fragments (16-row tile); kDequantAhead dequantizes tile t+1 during tile t's PV
// loop from a raw-row ring (the 64-row tile's SM90 plan).
enum class Fp8Pipeline : int { kNone = 0, kInPlace, kRegisters, kDequantAhead };

enum class Code : int {
  kOk = 0,
  kInvalidArgument,
  kUnsupported,
  kWorkspaceTooSmall,
  kCudaError,
};

// Errors are returned, never raised: kernels/ never exits or aborts.
struct Status {
  Code code = Code::kOk;
  std::string message;

  bool ok() const { return code == Code::kOk; }
  static Status Ok() { return {}; }
  static Status Invalid(std::string msg) { return {Code::kInvalidArgument, std::move(msg)}; }
};

// One decode call over a batch. All strides are in elements, not bytes: the kv strides
// in the cache's elements (16-bit values for KvDType::kModel, bytes for kFp8E4M3, whose
// rows are kFp8RowBytes long). The pointers are device pointers for the CUDA path and
// host pointers for the CPU path.
struct MlaDecodeParams {
  DType dtype = DType::kBF16;
  int batch = 0;              // b
  int s_q = 1;                // query tokens per sequence
  int h_q = 0;                // query heads
  int h_kv = 1;               // KV heads; h_q % h_kv == 0
  int num_pages = 0;          // pages in the kv tensor; block table entries must be below it
  int max_pages_per_seq = 0;  // block table width
  float softmax_scale = 0.f;
  bool causal = false;        // query i sees keys [0, seqlen - s_q + i]

  const void* q = nullptr;  // [b, s_q, h_q, 576]
  int64_t q_batch_stride = 0, q_seq_stride = 0, q_head_stride = 0;

  const void* kv = nullptr;  // [num_pages, 64, h_kv, 576] (fp8: [num_pages, 64, h_kv, 656 bytes])
  int64_t kv_page_stride = 0, kv_row_stride = 0, kv_head_stride = 0;

  const int32_t* block_table = nullptr;  // [b, max_pages_per_seq] page ids
  int64_t block_table_batch_stride = 0;

  const int32_t* seqlens = nullptr;  // [b] keys per sequence, 0 allowed

  void* out = nullptr;  // [b, s_q, h_q, 512]
  int64_t out_batch_stride = 0, out_seq_stride = 0, out_head_stride = 0;

  float* lse = nullptr;  // [b, h_q, s_q], natural log; -inf where a row sees no keys
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  KvDType kv_dtype = KvDType::kModel;  // how kv stores rows (kernels/kv_fp8.h for fp8)
  PRounding p_rounding = PRounding::kSplit;  // bf16 models on the GPU only (above)
};

// Fills every stride for densely packed tensors in the layouts above.
void SetContiguousStrides(MlaDecodeParams* p);

// Checks shapes, strides and pointers (not the contents of device memory). The message
// names the field and what was expected.
Status ValidateParams(const MlaDecodeParams& p);

}  // namespace latentd::kernels
