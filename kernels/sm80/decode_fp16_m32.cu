// SM80 MLA decode, fp16, 32-row tile: explicit instantiation.
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kFP16, 32, latentd::kernels::KvDType::kModel, false, false, latentd::kernels::PRounding::kSplit>;
