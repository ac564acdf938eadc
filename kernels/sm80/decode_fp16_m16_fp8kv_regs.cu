// SM80 MLA decode, fp16, 16-row tile, FP8 KV cache converted in registers: explicit instantiation.
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kFP16, 16, latentd::kernels::KvDType::kFp8E4M3, true, false, latentd::kernels::PRounding::kSplit>;
