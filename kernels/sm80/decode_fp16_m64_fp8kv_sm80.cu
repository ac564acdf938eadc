// SM80 MLA decode, fp16, 64-row tile, FP8 KV cache dequantized in place, A100 plan: explicit instantiation.
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kFP16, 64, latentd::kernels::KvDType::kFp8E4M3, false, true, latentd::kernels::PRounding::kSplit>;
