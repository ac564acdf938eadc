// Host side of the SM80 MLA decode: the device query that fills the planner's
// DeviceInfo, and the launches, which dispatch on the DecodePlan to one kernel
// instantiation. Host code only (compiled by nvcc so that it links with the kernel objects).
#include "kernels/mla_decode_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/sm80/config.h"
#include "kernels/sm80/launch.h"

namespace latentd::kernels {
namespace {

using sm80::DecodeArgs;
using sm80::Decoder;

constexpr KvDType kModel = KvDType::kModel;
constexpr KvDType kFp8 = KvDType::kFp8E4M3;

Status CudaStatus(cudaError_t e, const char* what) {
  return {Code::kCudaError, std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")"};
}

// What dispatch needs of one instantiation.
struct KernelHandle {
  const void* fn = nullptr;
  cudaError_t (*prepare)() = nullptr;
  cudaError_t (*launch)(const DecodeArgs&, cudaStream_t) = nullptr;
  int smem_bytes = 0;
};
template <typename D>
KernelHandle HandleOf() {
  return {D::Kernel(), &D::Prepare, &D::Launch, D::SmemBytes()};
}

// The P rounding of a bf16 instantiation; fp16 has one kernel per plan (P rounded once
// to fp16 whatever the option says).
template <DType kD, int kRows, KvDType kKv, bool kRegs, bool kSm80>
KernelHandle ByRounding(PRounding r) {
  if constexpr (kD == DType::kBF16) {
    if (r == PRounding::kOnce) return HandleOf<Decoder<kD, kRows, kKv, kRegs, kSm80, PRounding::kOnce>>();
  }
  return HandleOf<Decoder<kD, kRows, kKv, kRegs, kSm80, PRounding::kSplit>>();
}

// The instantiation a (dtype, tile, cache, FP8 pipeline, shared-memory plan, P rounding)
// names; fn == nullptr where none does (every branch that has no kernel).
template <DType kD>
KernelHandle Select(int tile_rows, KvDType kv, Fp8Pipeline pipe, SmemPlan smem, PRounding r) {
  const bool fp8 = kv == kFp8;
  if (kv != kModel && kv != kFp8) return {};
  if (r != PRounding::kSplit && r != PRounding::kOnce) return {};
  if (fp8 != (pipe != Fp8Pipeline::kNone)) return {};
  switch (tile_rows) {
    case 16:
      if (smem != SmemPlan::kSm90) return {};
      switch (pipe) {
        case Fp8Pipeline::kNone:
          return ByRounding<kD, 16, kModel, false, false>(r);
        case Fp8Pipeline::kInPlace:
          return ByRounding<kD, 16, kFp8, false, false>(r);
        case Fp8Pipeline::kRegisters:
          return ByRounding<kD, 16, kFp8, true, false>(r);
        case Fp8Pipeline::kDequantAhead:
          return {};
      }
      return {};
    case 32:
      if (smem != SmemPlan::kSm90) return {};
      switch (pipe) {
        case Fp8Pipeline::kNone:
          return ByRounding<kD, 32, kModel, false, false>(r);
        case Fp8Pipeline::kInPlace:
          return ByRounding<kD, 32, kFp8, false, false>(r);
        case Fp8Pipeline::kRegisters:
        case Fp8Pipeline::kDequantAhead:
          return {};
      }
      return {};
    case 64:
      switch (smem) {
        case SmemPlan::kSm90:
          if (pipe == Fp8Pipeline::kNone) return ByRounding<kD, 64, kModel, false, false>(r);
          if (pipe == Fp8Pipeline::kDequantAhead) return ByRounding<kD, 64, kFp8, false, false>(r);
          return {};
        case SmemPlan::kA100:
          if (pipe == Fp8Pipeline::kNone) return ByRounding<kD, 64, kModel, false, true>(r);
          if (pipe == Fp8Pipeline::kInPlace) return ByRounding<kD, 64, kFp8, false, true>(r);
          return {};
      }
      return {};
    default:
      return {};
  }
}

KernelHandle SelectFor(DType dtype, int tile_rows, KvDType kv, Fp8Pipeline pipe, SmemPlan smem, PRounding r) {
  switch (dtype) {
    case DType::kBF16:
      return Select<DType::kBF16>(tile_rows, kv, pipe, smem, r);
    case DType::kFP16:
      return Select<DType::kFP16>(tile_rows, kv, pipe, smem, r);
  }
  return {};
}

// Switches to `device` for the duration of a scope when it is not already current.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != device) {
      err_ = cudaSetDevice(device);
      switched_ = err_ == cudaSuccess;
    }
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(prev_);
  }
  cudaError_t error() const { return err_; }

 private:
  int prev_ = 0;
  bool switched_ = false;
  cudaError_t err_ = cudaSuccess;
};

// One 16-bit-cache kernel's resources on the current device. A kernel with no machine
// code for it (the 64-row tile past SM90) is left absent, with no error left behind.
Status Describe(const KernelHandle& k, int threads, bool required, KernelResources* r) {
  *r = KernelResources{};
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, k.fn);
  if (e != cudaSuccess) {
    cudaGetLastError();  // a missing image is not sticky
    return required ? CudaStatus(e, "cudaFuncGetAttributes") : Status::Ok();
  }
  e = k.prepare();
  if (e != cudaSuccess) {
    cudaGetLastError();
    return required ? CudaStatus(e, "cudaFuncSetAttribute(max dynamic shared memory)") : Status::Ok();
  }
  int n = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k.fn, threads, k.smem_bytes);
  if (e != cudaSuccess) return CudaStatus(e, "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  r->present = true;
  r->threads = threads;
  r->regs_per_thread = attr.numRegs;
  r->static_smem_bytes = static_cast<int>(attr.sharedSizeBytes);
  r->ctas_per_sm = n;
  return Status::Ok();
}

DecodeArgs MakeArgs(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace) {
  DecodeArgs a;
  a.p = p;
  a.keys_per_split = plan.keys_per_split;
  a.num_splits = plan.num_splits;
  a.row_tiles = plan.row_tiles;
  if (plan.num_splits > 1) {
    a.o_part = static_cast<float*>(workspace);
    a.lse_part = a.o_part + size_t(p.batch) * plan.num_splits * p.h_q * p.s_q * kHeadDimV;
  }
  return a;
}

}  // namespace

Status QueryDevice(int device, DeviceInfo* info) {
  if (!info) return Status::Invalid("info: expected a pointer");
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return CudaStatus(e, "cudaGetDeviceProperties");
  *info = DeviceInfo{};
  info->device = device;
  info->cc_major = prop.major;
  info->cc_minor = prop.minor;
  info->sm_count = prop.multiProcessorCount;
  info->max_smem_per_sm = static_cast<int>(prop.sharedMemPerMultiprocessor);
  info->max_smem_per_block_optin = static_cast<int>(prop.sharedMemPerBlockOptin);
  info->regs_per_sm = prop.regsPerMultiprocessor;
  info->max_threads_per_sm = prop.maxThreadsPerMultiProcessor;
  std::memcpy(info->name, prop.name, std::min(sizeof(info->name) - 1, std::strlen(prop.name)));
  if (prop.major < 8) return {Code::kUnsupported, std::string("compute capability 8.0 or newer needed, ") + prop.name};
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return CudaStatus(scope.error(), "cudaSetDevice");
  SmemPlan plan64 = SmemPlan::kSm90;
  const bool has64 = Tile64SmemPlan(*info, kModel, &plan64);
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    const int di = static_cast<int>(dtype);
    const int tiles[] = {16, 32, 64};
    for (int ti = 0; ti < 3; ++ti) {
      if (tiles[ti] == 64 && !has64) continue;  // no plan of the 64-row tile fits this device
      const KernelHandle k = SelectFor(dtype, tiles[ti], kModel, Fp8Pipeline::kNone,
                                       tiles[ti] == 64 ? plan64 : SmemPlan::kSm90, PRounding::kSplit);
      const int threads = tiles[ti] == 64 ? sm80::kCtaThreads<64> : tiles[ti] == 32 ? sm80::kCtaThreads<32>
                                                                                     : sm80::kCtaThreads<16>;
      Status s = Describe(k, threads, tiles[ti] != 64, &info->kernels[di][ti]);
      if (!s.ok()) return s;
    }
  }
  return Status::Ok();
}

Status LaunchDecodeKernel(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  Status s = ValidateParams(p);
  if (!s.ok()) return s;
  if (p.batch == 0) return Status::Ok();
  s = ValidatePlan(p, plan, workspace_bytes, workspace);
  if (!s.ok()) return s;
  const KernelHandle k = SelectFor(p.dtype, plan.tile_rows, p.kv_dtype, plan.fp8_pipeline, plan.smem_plan,
                                   plan.p_rounding);
  if (k.fn == nullptr)
    return {Code::kUnsupported, std::string("no ") + DTypeName(p.dtype) + " kernel for tile_rows " +
                                    std::to_string(plan.tile_rows) + ", smem_plan " + SmemPlanName(plan.smem_plan) +
                                    ", fp8_pipeline " + Fp8PipelineName(plan.fp8_pipeline)};
  if (k.smem_bytes != plan.smem_bytes) return Status::Invalid("plan.smem_bytes does not match its kernel's plan");
  const cudaError_t e = k.launch(MakeArgs(p, plan, workspace), stream);
  if (e != cudaSuccess) return CudaStatus(e, "decode kernel launch");
  return Status::Ok();
}

Status LaunchCombine(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  Status s = ValidateParams(p);
  if (!s.ok()) return s;
  if (p.batch == 0 || plan.num_splits <= 1) return Status::Ok();
  s = ValidatePlan(p, plan, workspace_bytes, workspace);
  if (!s.ok()) return s;
  const DecodeArgs a = MakeArgs(p, plan, workspace);
  sm80::CombineArgs c;
  c.p = p;
  c.keys_per_split = plan.keys_per_split;
  c.num_splits = plan.num_splits;
  c.o_part = a.o_part;
  c.lse_part = a.lse_part;
  const cudaError_t e = sm80::LaunchCombineKernel(c, stream);
  if (e != cudaSuccess) return CudaStatus(e, "combine kernel launch");
  return Status::Ok();
}

Status LaunchDecode(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream) {
  Status s = LaunchDecodeKernel(p, plan, workspace, workspace_bytes, stream);
  if (!s.ok()) return s;
  return LaunchCombine(p, plan, workspace, workspace_bytes, stream);
}

}  // namespace latentd::kernels
