// SM80 MLA decode, fp16, 64-row tile, FP8 KV cache: explicit instantiation (in place; no ring).
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kFP16, 64, latentd::kernels::KvDType::kFp8E4M3>;
