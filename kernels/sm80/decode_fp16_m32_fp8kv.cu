// SM80 MLA decode, fp16, 32-row tile, FP8 KV cache dequantized in place: explicit instantiation.
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kFP16, 32, latentd::kernels::KvDType::kFp8E4M3, false, false, latentd::kernels::PRounding::kSplit>;
