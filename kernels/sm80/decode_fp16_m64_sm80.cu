// SM80 MLA decode, fp16, 64-row tile, A100 plan: explicit instantiation.
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kFP16, 64, latentd::kernels::KvDType::kModel, false, true, latentd::kernels::PRounding::kSplit>;
