// Shape checks and stride helpers for MlaDecodeParams.
#include "kernels/params.h"

#include "kernels/kv_fp8.h"

namespace latentd::kernels {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
  }
  return "unknown";
}

const char* KvDTypeName(KvDType kv_dtype, DType dtype) {
  switch (kv_dtype) {
    case KvDType::kModel:
      return DTypeName(dtype);
    case KvDType::kFp8E4M3:
      return "fp8_e4m3";
  }
  return "unknown";
}

const char* PRoundingName(PRounding rounding) {
  switch (rounding) {
    case PRounding::kSplit:
      return "split";
    case PRounding::kOnce:
      return "once";
  }
  return "unknown";
}

void SetContiguousStrides(MlaDecodeParams* p) {
  p->q_head_stride = kHeadDimQK;
  p->q_seq_stride = int64_t{p->h_q} * kHeadDimQK;
  p->q_batch_stride = int64_t{p->s_q} * p->q_seq_stride;
  p->kv_head_stride = p->kv_dtype == KvDType::kFp8E4M3 ? kFp8RowBytes : kHeadDimQK;
  p->kv_row_stride = int64_t{p->h_kv} * p->kv_head_stride;
  p->kv_page_stride = int64_t{kPageSize} * p->kv_row_stride;
  p->block_table_batch_stride = p->max_pages_per_seq;
  p->out_head_stride = kHeadDimV;
  p->out_seq_stride = int64_t{p->h_q} * kHeadDimV;
  p->out_batch_stride = int64_t{p->s_q} * p->out_seq_stride;
  p->lse_head_stride = p->s_q;
  p->lse_batch_stride = int64_t{p->h_q} * p->s_q;
}

Status ValidateParams(const MlaDecodeParams& p) {
  auto bad = [](const std::string& m) { return Status::Invalid(m); };
  if (p.dtype != DType::kBF16 && p.dtype != DType::kFP16) return bad("dtype: expected bf16 or fp16");
  if (p.kv_dtype != KvDType::kModel && p.kv_dtype != KvDType::kFp8E4M3)
    return bad("kv_dtype: expected the model dtype or fp8_e4m3");
  if (p.p_rounding != PRounding::kSplit && p.p_rounding != PRounding::kOnce)
    return bad("p_rounding: expected split or once");
  if (p.batch < 0) return bad("batch: expected >= 0, got " + std::to_string(p.batch));
  if (p.s_q < 1) return bad("s_q: expected >= 1, got " + std::to_string(p.s_q));
  if (p.h_kv < 1) return bad("h_kv: expected >= 1, got " + std::to_string(p.h_kv));
  if (p.h_q < 1 || p.h_q % p.h_kv != 0)
    return bad("h_q: expected a positive multiple of h_kv=" + std::to_string(p.h_kv) + ", got " +
               std::to_string(p.h_q));
  if (p.h_q / p.h_kv > kMaxHeadsPerKvHead)
    return bad("h_q / h_kv: expected <= " + std::to_string(kMaxHeadsPerKvHead) + ", got " +
               std::to_string(p.h_q / p.h_kv));
  if (p.max_pages_per_seq < 0) return bad("max_pages_per_seq: expected >= 0");
  if (p.num_pages < 0) return bad("num_pages: expected >= 0");
  if (!(p.softmax_scale > 0.f)) return bad("softmax_scale: expected > 0");
  if (p.batch == 0) return Status::Ok();
  if (!p.q) return bad("q: expected a pointer to [b, s_q, h_q, 576]");
  if (!p.kv && p.num_pages > 0) return bad("kv: expected a pointer to [num_pages, 64, h_kv, 576]");
  if (!p.block_table && p.max_pages_per_seq > 0) return bad("block_table: expected a pointer to [b, max_pages]");
  if (!p.seqlens) return bad("seqlens: expected a pointer to [b]");
  if (!p.out) return bad("out: expected a pointer to [b, s_q, h_q, 512]");
  if (!p.lse) return bad("lse: expected a pointer to [b, h_q, s_q]");
  // The kernels move 16-byte vectors along the head dimension: rows must stay aligned.
  auto aligned = [](int64_t stride) { return stride % 8 == 0; };
  if (!aligned(p.q_batch_stride) || !aligned(p.q_seq_stride) || !aligned(p.q_head_stride))
    return bad("q strides: expected multiples of 8 elements");
  if (p.kv_dtype == KvDType::kFp8E4M3) {
    auto aligned16 = [](int64_t stride) { return stride % 16 == 0; };
    if (!aligned16(p.kv_page_stride) || !aligned16(p.kv_row_stride) || !aligned16(p.kv_head_stride))
      return bad("kv strides: expected multiples of 16 bytes (fp8_e4m3 cache)");
    if (p.kv_head_stride < kFp8RowBytes) return bad("kv_head_stride: expected >= 656 bytes (fp8_e4m3 cache)");
  } else if (!aligned(p.kv_page_stride) || !aligned(p.kv_row_stride) || !aligned(p.kv_head_stride)) {
    return bad("kv strides: expected multiples of 8 elements");
  }
  if (!aligned(p.out_batch_stride) || !aligned(p.out_seq_stride) || !aligned(p.out_head_stride))
    return bad("out strides: expected multiples of 8 elements");
  return Status::Ok();
}

}  // namespace latentd::kernels
