// SM80 MLA decode, bf16, 64-row tile, FP8 KV cache: explicit instantiation (in place; no ring).
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kBF16, 64, latentd::kernels::KvDType::kFp8E4M3>;
