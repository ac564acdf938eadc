// Host side of the SM80 MLA decode: device query, tile choice, split-K planner from
// host seqlens and measured occupancy, workspace sizing, launches and dispatch.
// Host code only (compiled by nvcc so that it links with the kernel objects).
#include "kernels/mla_decode_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "kernels/sm80/config.h"
#include "kernels/sm80/launch.h"
#include "kernels/sm80/traits.h"

namespace latentd::kernels {
namespace {

using sm80::DecodeArgs;
using sm80::Decoder;

Status CudaStatus(cudaError_t e, const char* what) {
  return {Code::kCudaError, std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")"};
}

int TileIndex(int tile_rows) { return tile_rows == 16 ? 0 : tile_rows == 32 ? 1 : tile_rows == 64 ? 2 : -1; }

// Tile choice by the rows sharing one KV head (heads per KV head x query tokens): the
// memory-bound 16-row tile up to 16, the 64-row compute tile from 64 (one KV stage
// serves 64 rows), the 32-row tile between.
int TileRowsFor(int rows) { return rows <= 16 ? 16 : rows < 64 ? 32 : 64; }

// One tile's kernels. kSm80Plan: the 64-row tile's A100 plans (sm_80 machine code only).
template <int kRows, bool kSm80Plan = false>
struct TileKernels {
  template <DType kD, KvDType kKv = KvDType::kModel, bool kRing = false, bool kRegs = false>
  using D = Decoder<kD, kRows, kKv, kRing, kRegs, kSm80Plan>;
  static const void* Kernel(DType dtype, KvDType kv_dtype = KvDType::kModel) {
    constexpr KvDType kFp8 = KvDType::kFp8E4M3;
    if (kv_dtype == kFp8) return dtype == DType::kBF16 ? D<DType::kBF16, kFp8>::Kernel() : D<DType::kFP16, kFp8>::Kernel();
    return dtype == DType::kBF16 ? D<DType::kBF16>::Kernel() : D<DType::kFP16>::Kernel();
  }
  static cudaError_t Prepare(DType dtype) {
    return dtype == DType::kBF16 ? D<DType::kBF16>::Prepare() : D<DType::kFP16>::Prepare();
  }
  static cudaError_t Launch(DType dtype, KvDType kv_dtype, bool ring, bool regs, const DecodeArgs& args,
                            cudaStream_t stream) {
    constexpr KvDType kFp8 = KvDType::kFp8E4M3;
    if constexpr (kRows != 64) {  // the 64-row tile has no raw-row ring (DecodePlan::fp8_ring)
      if (kv_dtype == kFp8 && ring)
        return dtype == DType::kBF16 ? D<DType::kBF16, kFp8, true>::Launch(args, stream)
                                     : D<DType::kFP16, kFp8, true>::Launch(args, stream);
    }
    if constexpr (kRows == 16) {  // conversion in registers: the 16-row tile only (DecodePlan::fp8_regs)
      if (kv_dtype == kFp8 && regs)
        return dtype == DType::kBF16 ? D<DType::kBF16, kFp8, false, true>::Launch(args, stream)
                                     : D<DType::kFP16, kFp8, false, true>::Launch(args, stream);
    }
    if (kv_dtype == kFp8)
      return dtype == DType::kBF16 ? D<DType::kBF16, kFp8>::Launch(args, stream)
                                   : D<DType::kFP16, kFp8>::Launch(args, stream);
    return dtype == DType::kBF16 ? D<DType::kBF16>::Launch(args, stream) : D<DType::kFP16>::Launch(args, stream);
  }
};

int ThreadsOf(int tile_rows) {
  switch (tile_rows) {
    case 16:
      return sm80::kCtaThreads<16>;
    case 32:
      return sm80::kCtaThreads<32>;
    case 64:
      return sm80::kCtaThreads<64>;
    default:
      return 0;
  }
}

bool KnownDType(DType dtype) { return dtype == DType::kBF16 || dtype == DType::kFP16; }

// sm80_plan: the 64-row tile's A100 plan (Tile64Plan).
const void* KernelOf(DType dtype, int tile_rows, bool sm80_plan) {
  if (!KnownDType(dtype)) return nullptr;
  switch (tile_rows) {
    case 16:
      return TileKernels<16>::Kernel(dtype);
    case 32:
      return TileKernels<32>::Kernel(dtype);
    case 64:
      return sm80_plan ? TileKernels<64, true>::Kernel(dtype) : TileKernels<64>::Kernel(dtype);
    default:
      return nullptr;
  }
}

cudaError_t PrepareKernel(DType dtype, int tile_rows, bool sm80_plan) {
  if (!KnownDType(dtype)) return cudaErrorInvalidValue;
  switch (tile_rows) {
    case 16:
      return TileKernels<16>::Prepare(dtype);
    case 32:
      return TileKernels<32>::Prepare(dtype);
    case 64:
      return sm80_plan ? TileKernels<64, true>::Prepare(dtype) : TileKernels<64>::Prepare(dtype);
    default:
      return cudaErrorInvalidValue;
  }
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

// Which plan of the 64-row tile a device runs: the SM90 plan's kernels are SM90 machine
// code only, the A100 plan's sm_80 machine code only (kernels/BUILD.bazel), so it is the
// one the runtime has an image of; none on SM86/SM89 parts (sm_80 code runs there, but
// their 99 KB per CTA hold no plan of this tile) and on GPUs past SM90. Per cache dtype,
// cached per device; asking costs a few driver calls once.
enum class Tile64Plan { kNone = 1, kSm90, kSm80 };
constexpr int kMaxCachedDevicesForTile = 64;
std::atomic<int> g_tile64_plan[kMaxCachedDevicesForTile][2];  // a Tile64Plan; 0 unknown

// Shared memory of the 64-row tile's plan (sm80::kQRegStepsOf, kFp8AheadOf).
template <DType kDType>
size_t SmemOf64(bool sm80_plan, KvDType kv_dtype) {
  constexpr KvDType kModel = KvDType::kModel, kFp8 = KvDType::kFp8E4M3;
  if (kv_dtype == kFp8)
    return sm80_plan ? Decoder<kDType, 64, kFp8, false, false, true>::SmemBytes() : Decoder<kDType, 64, kFp8>::SmemBytes();
  return sm80_plan ? Decoder<kDType, 64, kModel, false, false, true>::SmemBytes() : Decoder<kDType, 64>::SmemBytes();
}

Tile64Plan PlanOf64(int device, KvDType kv_dtype) {
  const int ki = kv_dtype == KvDType::kFp8E4M3 ? 1 : 0;
  const bool cacheable = device >= 0 && device < kMaxCachedDevicesForTile;
  if (cacheable) {
    const int v = g_tile64_plan[device][ki].load(std::memory_order_relaxed);
    if (v != 0) return static_cast<Tile64Plan>(v);
  }
  Tile64Plan plan = Tile64Plan::kNone;
  {
    DeviceScope scope(device);
    cudaFuncAttributes attr;
    if (scope.error() == cudaSuccess) {
      if (cudaFuncGetAttributes(&attr, TileKernels<64>::Kernel(DType::kBF16, kv_dtype)) == cudaSuccess) {
        plan = Tile64Plan::kSm90;
      } else if (cudaFuncGetAttributes(&attr, TileKernels<64, true>::Kernel(DType::kBF16, kv_dtype)) == cudaSuccess) {
        plan = Tile64Plan::kSm80;
      }
    }
    cudaGetLastError();  // a missing image is not sticky; leave no error behind
    const bool sm80 = plan == Tile64Plan::kSm80;
    const size_t need = std::max(SmemOf64<DType::kBF16>(sm80, kv_dtype), SmemOf64<DType::kFP16>(sm80, kv_dtype));
    int optin = 0;
    if (plan != Tile64Plan::kNone &&
        (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
         size_t(optin) < need))
      plan = Tile64Plan::kNone;
    cudaGetLastError();
  }
  if (cacheable) g_tile64_plan[device][ki].store(static_cast<int>(plan), std::memory_order_relaxed);
  return plan;
}

bool Has64(int device, KvDType kv_dtype) { return PlanOf64(device, kv_dtype) != Tile64Plan::kNone; }
bool Sm80Plan64(int device, KvDType kv_dtype = KvDType::kModel) {
  return PlanOf64(device, kv_dtype) == Tile64Plan::kSm80;
}

// Dynamic shared memory of a (dtype, tile) kernel on a device for a 16-bit cache, or for
// an FP8 cache's default pipeline (the 64-row tile's SM90 plan adds a raw-row ring:
// TileConfig::kFp8DequantAhead). The 64-row tile's plan depends on the device and on the
// dtype (sm80::kQRegStepsOf).
template <DType kDType>
int SmemOfDType(int device, int tile_rows, KvDType kv_dtype) {
  constexpr KvDType kFp8 = KvDType::kFp8E4M3;
  const bool fp8 = kv_dtype == kFp8;
  switch (tile_rows) {
    case 16:
      return fp8 ? Decoder<kDType, 16, kFp8>::SmemBytes() : Decoder<kDType, 16>::SmemBytes();
    case 32:
      return fp8 ? Decoder<kDType, 32, kFp8>::SmemBytes() : Decoder<kDType, 32>::SmemBytes();
    case 64:
      return static_cast<int>(SmemOf64<kDType>(Sm80Plan64(device, kv_dtype), kv_dtype));
    default:
      return 0;
  }
}
int SmemOf(int device, DType dtype, int tile_rows, KvDType kv_dtype = KvDType::kModel) {
  return dtype == DType::kBF16 ? SmemOfDType<DType::kBF16>(device, tile_rows, kv_dtype)
                               : SmemOfDType<DType::kFP16>(device, tile_rows, kv_dtype);
}

// Calls with at most this many query-row keys in all (batch x KV heads x rows per KV
// head x longest sequence) run the 16-row tile whatever their rows per KV head: they
// are latency-bound, and it is the tile with the shortest path per KV tile (Q in
// registers, 2 CTAs per SM on A100 too); its extra reads of each KV tile, one per 16
// rows, are L2 hits, since a partition's row tiles are neighbours in the grid. Measured
// on the H200 (docs/kernel-tuning.md, round 16): up to 2^21 it wins or ties against the
// 32- and 64-row tiles ((1,64,4096) 1.29x, (8,64,4096) 1.04x, (4,128,4096) 1.0x); at
// 2^22 and beyond the 64-row tile is 7-21% faster ((4,128,8192), (1,128,65536)).
constexpr int64_t kSmallCallRowKeys = int64_t{1} << 21;

// The planner's tile: the 16-row tile for up to 63 rows per KV head and for small
// calls; otherwise the 64-row tile where it has a plan (SM90 and A100 parts), else the
// 32-row tile. Round 16 measured the 16-row tile 2-12% faster than the 32-row tile on
// every shape tried on the H200, 32 to 1024 rows per KV head, s_q 2 included. At 32-63 rows
// it reads each KV tile twice from L2 where the 32-row tile reads it once; at 64+ rows
// 4-8 times, which the H200's L2 carried but an A100's smaller L2 bandwidth may not.
// The 64-row tile reads each KV tile once per 64 rows; its A100 plan, run on an H100
// (LATENTD_FORCE_SM80_PLANS), is 1.47x the 32-row tile at (64,128,4096) bf16, 1.5x with
// an FP8 cache (round 28; no A100 was at hand to measure it there).
int ChooseTileRows(const DeviceInfo& dev, const MlaDecodeParams& p, int max_len) {
  const int rows = (p.h_q / p.h_kv) * p.s_q;
  const bool small = int64_t(p.batch) * p.h_kv * rows * max_len <= kSmallCallRowKeys;
  if (TileRowsFor(rows) != 64 || small) return 16;
  return Has64(dev.device, p.kv_dtype) ? 64 : 32;
}

// Resident CTAs per SM of a (dtype, tile) kernel on a device, from the occupancy
// calculator; cached so that planning costs no driver call after the first.
constexpr int kMaxCachedDevices = 64;
std::atomic<int> g_occupancy[kMaxCachedDevices][2][sm80::kNumTileConfigs];

Status Occupancy(int device, DType dtype, int tile_rows, int* ctas) {
  const int ti = TileIndex(tile_rows);
  const int di = static_cast<int>(dtype);
  if (ti < 0 || (di != 0 && di != 1)) return {Code::kUnsupported, "no kernel for this tile/dtype"};
  const bool cacheable = device >= 0 && device < kMaxCachedDevices;
  if (cacheable) {
    const int v = g_occupancy[device][di][ti].load(std::memory_order_relaxed);
    if (v > 0) {
      *ctas = v;
      return Status::Ok();
    }
  }
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return CudaStatus(scope.error(), "cudaSetDevice");
  const bool sm80 = tile_rows == 64 && Sm80Plan64(device);
  cudaError_t e = PrepareKernel(dtype, tile_rows, sm80);
  if (e != cudaSuccess) return CudaStatus(e, "cudaFuncSetAttribute(max dynamic shared memory)");
  int n = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, KernelOf(dtype, tile_rows, sm80), ThreadsOf(tile_rows),
                                                    SmemOf(device, dtype, tile_rows));
  if (e != cudaSuccess) return CudaStatus(e, "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  if (n < 1) return {Code::kUnsupported, "decode kernel does not fit on this device"};
  if (cacheable) g_occupancy[device][di][ti].store(n, std::memory_order_relaxed);
  *ctas = n;
  return Status::Ok();
}

// Fewest keys worth a partition of its own: below this the prologue (Q load, pipeline
// fill) and the combine row cost more than the keys' streaming time.
#ifndef LATENTD_MIN_KEYS_PER_SPLIT  // overridable only to build tuning variants
#define LATENTD_MIN_KEYS_PER_SPLIT 128
#endif
constexpr int kMinKeysPerSplit = LATENTD_MIN_KEYS_PER_SPLIT;

int RoundUp(int x, int m) { return (x + m - 1) / m * m; }

// Partition boundaries are multiples of this many keys: a multiple of every tile
// configuration's KV tile, so no tile straddles two partitions (or two pages).
constexpr int kSplitGranularity = 32;
static_assert(kSplitGranularity % sm80::TileConfig<16>::kKeys == 0 &&
                  kSplitGranularity % sm80::TileConfig<32>::kKeys == 0 &&
                  kSplitGranularity % sm80::TileConfig<64>::kKeys == 0 && kPageSize % kSplitGranularity == 0,
              "partition granularity must be whole KV tiles within a page");

// Calls with at most this many keys over all (sequence, KV head, row tile) streams are
// latency-bound: short partitions then beat fewer, longer ones (docs/kernel-tuning.md,
// rounds 2 and 5).
constexpr int64_t kSmallCallKeys = 8192;

// The longest partitions the half-wave plan may take (ChooseSplits, round 32).
constexpr int kHalfWaveMaxKeys = 512;

// Partitions per sequence: fill the device's resident CTA slots once, never more than
// one wave, and never below kMinKeysPerSplit keys each (fewer for small calls).
// half_wave: a 16-bit cache on a tile with 2+ CTAs per SM. There, where filling half
// the slots still gives partitions of at most kHalfWaveMaxKeys, and fewer of them, the
// half-wave plan is faster: the decode kernel takes the same time with one CTA per SM on
// twice the keys (short partitions are latency-bound, not bandwidth-bound), and the
// combine merges half the partials (docs/kernel-tuning.md, round 32: 5-7% on
// (1,16,65536) and (16,16,4096), 1-3% on (64,16,1024); FP8 caches and longer partitions
// lose, so they keep the full wave).
void ChooseSplits(int slots, int streams, int max_len, bool half_wave, int* num_splits, int* keys_per_split) {
  // Small calls: one-page partitions; 32-key ones only while that makes at most 8
  // partitions, since each partition adds combine work (both measured in round 5).
  const bool small = int64_t(streams) * max_len <= kSmallCallKeys;
  const int min_keys = !small ? kMinKeysPerSplit : max_len <= 8 * kSplitGranularity ? kSplitGranularity : kPageSize;
  const int by_len = std::max(1, (max_len + min_keys - 1) / min_keys);
  auto fill = [&](int fill_slots, int* splits_out, int* kps_out) {
    const int target = std::max(1, fill_slots / std::max(1, streams));
    int splits = std::min(target, by_len);
    const int kps = RoundUp(std::max(1, (max_len + splits - 1) / splits), kSplitGranularity);
    splits = std::max(1, (max_len + kps - 1) / kps);
    *splits_out = splits;
    *kps_out = kps;
  };
  fill(slots, num_splits, keys_per_split);
  if (half_wave && !small) {
    int splits = 0, kps = 0;
    fill(slots / 2, &splits, &kps);
    if (splits < *num_splits && kps <= kHalfWaveMaxKeys) {
      *num_splits = splits;
      *keys_per_split = kps;
    }
  }
}

size_t PartialFloats(const MlaDecodeParams& p, int num_splits) {
  return size_t(p.batch) * num_splits * p.h_q * p.s_q * (kHeadDimV + 1);
}

// Workspace layout of every split plan: the fused combine's arrival counters first, at
// a fixed place and size so that no call's partials ever overlap another call's counters,
// then the partial outputs and LSEs. 16 KB keeps the partials 16-byte aligned.
constexpr size_t kCounterBytes = size_t(sm80::kMaxFusedStreams) * sizeof(unsigned int);
static_assert(kCounterBytes % 16 == 0, "partials must stay 16-byte aligned");

// Whether the decode kernel merges the partitions itself (docs/kernel-tuning.md, round 6):
// asked for by the plan, few partitions and partition rows per stream, and a counter
// for every stream.
bool FusesCombine(const MlaDecodeParams& p, const DecodePlan& plan) {
  return plan.fused_combine && plan.num_splits > 1 && plan.num_splits <= sm80::kMaxFusedSplits &&
         int64_t(plan.num_splits) * plan.tile_rows <= sm80::kMaxFusedPartialRows &&
         int64_t(p.batch) * p.h_kv * plan.row_tiles <= sm80::kMaxFusedStreams;
}

Status CheckPlan(const MlaDecodeParams& p, const DecodePlan& plan, size_t workspace_bytes, const void* workspace) {
  if (TileIndex(plan.tile_rows) < 0) return Status::Invalid("plan.tile_rows: expected 16, 32 or 64 (use PlanDecode)");
  if (plan.num_splits < 1 || plan.num_splits > 65535) return Status::Invalid("plan.num_splits: expected 1..65535");
  if (plan.keys_per_split < kSplitGranularity || plan.keys_per_split % kSplitGranularity != 0)
    return Status::Invalid("plan.keys_per_split: expected a positive multiple of " + std::to_string(kSplitGranularity));
  const int rows = (p.h_q / p.h_kv) * p.s_q;
  if (plan.row_tiles != (rows + plan.tile_rows - 1) / plan.tile_rows)
    return Status::Invalid("plan.row_tiles does not match the params' head counts and s_q");
  if (int64_t(p.batch) * p.h_kv > 65535) return {Code::kUnsupported, "batch * h_kv above 65535"};
  if (plan.num_splits > 1) {
    const size_t need = DecodeWorkspaceBytes(p, plan);
    if (workspace_bytes < need || (need > 0 && workspace == nullptr))
      return {Code::kWorkspaceTooSmall, "workspace: need " + std::to_string(need) + " bytes, got " +
                                            std::to_string(workspace_bytes)};
  }
  return Status::Ok();
}

DecodeArgs MakeArgs(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace) {
  DecodeArgs a;
  a.p = p;
  a.keys_per_split = plan.keys_per_split;
  a.num_splits = plan.num_splits;
  a.row_tiles = plan.row_tiles;
  if (plan.num_splits > 1) {
    a.o_part = reinterpret_cast<float*>(static_cast<char*>(workspace) + kCounterBytes);
    a.lse_part = a.o_part + size_t(p.batch) * plan.num_splits * p.h_q * p.s_q * kHeadDimV;
    if (FusesCombine(p, plan)) a.counters = static_cast<unsigned int*>(workspace);
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
  return Status::Ok();
}

Status PlanDecode(const DeviceInfo& dev, const MlaDecodeParams& p, const int32_t* seqlens_host, DecodePlan* plan,
                  int tile_rows) {
  if (!plan) return Status::Invalid("plan: expected a pointer");
  Status s = ValidateParams(p);
  if (!s.ok()) return s;
  if (p.batch > 0 && !seqlens_host) return Status::Invalid("seqlens_host: expected a host copy of seqlens [b]");
  if (dev.sm_count < 1) return Status::Invalid("dev: expected a DeviceInfo filled by QueryDevice");
  DecodePlan r;
  if (tile_rows != 0 && TileIndex(tile_rows) < 0) return Status::Invalid("tile_rows: expected 0, 16, 32 or 64");
  int max_len = 0;
  for (int i = 0; i < p.batch; ++i) {
    if (seqlens_host[i] < 0) return Status::Invalid("seqlens_host[" + std::to_string(i) + "] is negative");
    if (seqlens_host[i] > int64_t(p.max_pages_per_seq) * kPageSize)
      return Status::Invalid("seqlens_host[" + std::to_string(i) + "] exceeds max_pages_per_seq * 64");
    max_len = std::max(max_len, seqlens_host[i]);
  }
  r.tile_rows = tile_rows != 0 ? tile_rows : ChooseTileRows(dev, p, max_len);
  const int rows = (p.h_q / p.h_kv) * p.s_q;
  r.row_tiles = (rows + r.tile_rows - 1) / r.tile_rows;
  r.threads = ThreadsOf(r.tile_rows);
  r.smem_bytes = SmemOf(dev.device, p.dtype, r.tile_rows, p.kv_dtype);
  s = Occupancy(dev.device, p.dtype, r.tile_rows, &r.ctas_per_sm);
  if (!s.ok()) return s;
  const int streams = p.batch * p.h_kv * r.row_tiles;
  ChooseSplits(r.ctas_per_sm * dev.sm_count, streams, max_len,
               p.kv_dtype == KvDType::kModel && r.ctas_per_sm >= 2, &r.num_splits, &r.keys_per_split);
  // Both FP8 pipelines of the 16-row tile fit as many CTAs per SM (ptxas: 238-247
  // registers; 80 and 71 KB), so the occupancy above holds for either.
  if (p.kv_dtype == KvDType::kFp8E4M3 && r.tile_rows == 16 && sm80::TileConfig<16>::kFp8Regs &&
      r.keys_per_split >= sm80::kFp8RegsMinTiles * sm80::TileConfig<16>::kKeys) {
    r.fp8_regs = true;
    r.smem_bytes = Decoder<DType::kBF16, 16, KvDType::kFp8E4M3, false, true>::SmemBytes();
  }
  *plan = r;
  return Status::Ok();
}

size_t DecodeWorkspaceBytes(const MlaDecodeParams& p, const DecodePlan& plan) {
  if (plan.num_splits <= 1) return 0;
  return kCounterBytes + PartialFloats(p, plan.num_splits) * sizeof(float);
}

size_t MaxDecodeWorkspaceBytes(const DeviceInfo& dev, int max_batch, int s_q, int h_q, int h_kv) {
  if (max_batch < 1 || s_q < 1 || h_kv < 1 || h_q < h_kv || h_q % h_kv) return 0;
  // ChooseSplits gives at most max(1, slots / (batch * h_kv * row_tiles)) partitions,
  // so batch * num_splits <= batch + slots / (h_kv * row_tiles) over every batch size.
  // The slot count uses the largest occupancy any tile can have (registers cap it at 16
  // CTAs of 128 threads on SM80+).
  // Every tile the planner may pick for these rows: 16 (small calls), and 32 and 64
  // where the rows ask for them.
  const int rows = (h_q / h_kv) * s_q;
  size_t most = 0;
  for (int tile : {16, TileRowsFor(rows) >= 32 ? 32 : 0, TileRowsFor(rows) == 64 ? 64 : 0}) {
    if (tile == 0) continue;
    const int row_tiles = (rows + tile - 1) / tile;
    int ctas = 0;
    if (!Occupancy(dev.device, DType::kBF16, tile, &ctas).ok()) ctas = 16;
    int ctas16 = 0;
    if (Occupancy(dev.device, DType::kFP16, tile, &ctas16).ok()) ctas = std::max(ctas, ctas16);
    const int64_t slots = int64_t(ctas) * std::max(1, dev.sm_count);
    const int64_t best = int64_t(max_batch) + slots / (int64_t(h_kv) * row_tiles);
    most = std::max(most, kCounterBytes + size_t(best) * h_q * s_q * (kHeadDimV + 1) * sizeof(float));
  }
  return most;
}

Status InitDecodeWorkspace(void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (workspace_bytes == 0) return Status::Ok();
  if (!workspace) return Status::Invalid("workspace: expected a device pointer for " +
                                         std::to_string(workspace_bytes) + " bytes");
  const cudaError_t e = cudaMemsetAsync(workspace, 0, std::min(workspace_bytes, kCounterBytes), stream);
  if (e != cudaSuccess) return CudaStatus(e, "cudaMemsetAsync(workspace counters)");
  return Status::Ok();
}

Status LaunchDecodeKernel(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  Status s = ValidateParams(p);
  if (!s.ok()) return s;
  if (p.batch == 0) return Status::Ok();
  s = CheckPlan(p, plan, workspace_bytes, workspace);
  if (!s.ok()) return s;
  const DecodeArgs args = MakeArgs(p, plan, workspace);
  if (!KnownDType(p.dtype)) return {Code::kUnsupported, "dtype: no kernel"};
  if (p.kv_dtype != KvDType::kModel && p.kv_dtype != KvDType::kFp8E4M3)
    return {Code::kUnsupported, "kv_dtype: no kernel"};
  cudaError_t e = cudaErrorInvalidValue;
  switch (plan.tile_rows) {
    case 16:
      e = TileKernels<16>::Launch(p.dtype, p.kv_dtype, plan.fp8_ring, plan.fp8_regs, args, stream);
      break;
    case 32:
      e = TileKernels<32>::Launch(p.dtype, p.kv_dtype, plan.fp8_ring, false, args, stream);
      break;
    case 64: {
      // The device the launch goes to (the current one) picks the plan.
      int device = 0;
      e = cudaGetDevice(&device);
      if (e != cudaSuccess) break;
      e = Sm80Plan64(device, p.kv_dtype)
              ? TileKernels<64, true>::Launch(p.dtype, p.kv_dtype, plan.fp8_ring, false, args, stream)
              : TileKernels<64>::Launch(p.dtype, p.kv_dtype, plan.fp8_ring, false, args, stream);
      break;
    }
    default:
      return Status::Invalid(std::string("no ") + DTypeName(p.dtype) + " kernel for tile_rows " +
                             std::to_string(plan.tile_rows));
  }
  if (e != cudaSuccess) return CudaStatus(e, "decode kernel launch");
  return Status::Ok();
}

Status LaunchCombine(const MlaDecodeParams& p, const DecodePlan& plan, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  Status s = ValidateParams(p);
  if (!s.ok()) return s;
  if (p.batch == 0 || plan.num_splits <= 1) return Status::Ok();
  s = CheckPlan(p, plan, workspace_bytes, workspace);
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
  if (!s.ok() || FusesCombine(p, plan)) return s;
  return LaunchCombine(p, plan, workspace, workspace_bytes, stream);
}

Status DescribeTiles(const DeviceInfo& dev, DType dtype, TileOccupancy* configs, int max_configs, int* num_configs) {
  if (!num_configs) return Status::Invalid("num_configs: expected a pointer");
  *num_configs = 0;
  for (int tile : sm80::kTileRowOptions) {
    if (*num_configs >= max_configs) break;
    if (tile == 64 && !Has64(dev.device, KvDType::kModel)) continue;  // no machine code for this device
    const bool sm80 = tile == 64 && Sm80Plan64(dev.device);
    const void* fn = KernelOf(dtype, tile, sm80);
    if (!fn) return {Code::kUnsupported, "dtype: no kernel"};
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, fn);
    if (e != cudaSuccess) return CudaStatus(e, "cudaFuncGetAttributes");
    TileOccupancy t;
    t.tile_rows = tile;
    t.threads = ThreadsOf(tile);
    t.regs_per_thread = attr.numRegs;
    t.smem_bytes = SmemOf(dev.device, dtype, tile) + static_cast<int>(attr.sharedSizeBytes);
    Status s = Occupancy(dev.device, dtype, tile, &t.ctas_per_sm);
    if (!s.ok()) return s;
    // A100 (SM80): 64K registers per SM allocated per warp in units of 256, 164 KB of
    // shared memory per SM with 1 KB reserved per CTA, 2048 threads, 32 CTAs.
    const int warps = t.threads / 32;
    const int regs_per_warp = (t.regs_per_thread * 32 + 255) / 256 * 256;
    const int by_regs = 65536 / (regs_per_warp * warps);
    // The 64-row tile: its A100 plan, whatever this device runs.
    const int a100_smem = tile == 64 ? static_cast<int>(SmemOf64<DType::kBF16>(true, KvDType::kModel)) +
                                           static_cast<int>(attr.sharedSizeBytes)
                                     : t.smem_bytes;
    const int by_smem = (164 * 1024) / (a100_smem + 1024);
    const int by_threads = 2048 / t.threads;
    t.ctas_per_sm_a100 = std::min({by_regs, by_smem, by_threads, 32});
    configs[(*num_configs)++] = t;
  }
  return Status::Ok();
}

}  // namespace latentd::kernels
