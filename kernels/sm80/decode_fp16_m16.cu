// SM80 MLA decode, fp16, 16-row tile: explicit instantiation.
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kFP16, 16, latentd::kernels::KvDType::kModel, false, false, latentd::kernels::PRounding::kSplit>;
