// SM80 MLA decode, bf16, 64-row tile, A100 plan, P rounded once: explicit instantiation.
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kBF16, 64, latentd::kernels::KvDType::kModel, false, true, latentd::kernels::PRounding::kOnce>;
