// Host API of the SM80 MLA decode: the device query, the decode launch (kernel +
// combine) and the combine alone; the planner and workspace sizing are in
// kernels/planner.h. Plain C++: the only CUDA type is cudaStream_t. The caller owns all
// device memory; nothing here allocates per call.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/params.h"
#include "kernels/planner.h"

typedef struct CUstream_st* cudaStream_t;

namespace latentd::kernels {

// Fills the planner's description of a device (kernels/planner.h): its properties, and
// per decode kernel the registers, static shared memory and resident CTAs per SM that
// the CUDA runtime reports (raising each kernel's dynamic shared-memory limit on the
// device). Once per device; planning then makes no CUDA call.
Status QueryDevice(int device, DeviceInfo* info);

// Runs the decode on stream: the kernel the plan names (tile, shared-memory plan, FP8
// pipeline, P rounding), then, with plan.num_splits > 1, the combine kernel that merges
// the partitions. p's pointers are device pointers; seqlens on the device must equal
// seqlens_host given to PlanDecode. Writes every element of out and lse.
Status LaunchDecode(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream);

// The decode kernel alone (out/lse when num_splits == 1; partials into the workspace
// otherwise), and the combine kernel alone (merges the partials of any plan again).
// LaunchDecode is the first, then the second. For benchmarks.
Status LaunchDecodeKernel(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);
Status LaunchCombine(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream);

}  // namespace latentd::kernels
