// SM80 MLA decode, bf16, 16-row tile, FP8 KV cache dequantized in place, P rounded once: explicit instantiation.
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kBF16, 16, latentd::kernels::KvDType::kFp8E4M3, false, false, latentd::kernels::PRounding::kOnce>;
