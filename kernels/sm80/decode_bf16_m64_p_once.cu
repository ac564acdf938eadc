// SM80 MLA decode, bf16, 64-row tile, SM90 plan (sm_90 machine code only), P rounded once: explicit instantiation.
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kBF16, 64, latentd::kernels::KvDType::kModel, false, false, latentd::kernels::PRounding::kOnce>;
