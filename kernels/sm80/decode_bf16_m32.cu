// SM80 MLA decode, bf16, 32-row tile: explicit instantiation.
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kBF16, 32, latentd::kernels::KvDType::kModel, false, false, latentd::kernels::PRounding::kSplit>;
