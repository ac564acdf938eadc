// SM80 MLA decode, fp16, 16-row tile, FP8 KV cache converted in registers, A100-sized stages (DecodePlan::fp8_regs).
#include "kernels/sm80/kernel.cuh"
template struct latentd::kernels::sm80::Decoder<latentd::kernels::DType::kFP16, 16, latentd::kernels::KvDType::kFp8E4M3, false, latentd::kernels::sm80::TileConfig<16>::kFp8RegStages>;
