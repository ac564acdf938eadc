// The SM80 MLA decode planner's rules: tile choice, the 64-row tile's shared-memory plan,
// the FP8 pipeline, split-K partitions and workspace bounds, from a DeviceInfo. Host
// code only; the figures behind each rule are cited where it is defined.
#include "kernels/planner.h"

#include <algorithm>
#include <string>

#include "kernels/sm80/config.h"
#include "kernels/sm80/traits.h"

namespace latentd::kernels {
namespace {

int TileIndex(int tile_rows) { return tile_rows == 16 ? 0 : tile_rows == 32 ? 1 : tile_rows == 64 ? 2 : -1; }
bool KnownDType(DType dtype) { return dtype == DType::kBF16 || dtype == DType::kFP16; }

// Tile choice by the rows sharing one KV head (heads per KV head x query tokens): the
// memory-bound 16-row tile up to 16, the 64-row compute tile from 64 (one KV stage
// serves 64 rows), the 32-row tile between.
int TileRowsFor(int rows) { return rows <= 16 ? 16 : rows < 64 ? 32 : 64; }

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

template <DType kDType>
int SmemOf(KvDType kv_dtype, int tile_rows, Fp8Pipeline pipeline, SmemPlan smem_plan) {
  using sm80::PlanOf;
  constexpr KvDType kModel = KvDType::kModel, kFp8 = KvDType::kFp8E4M3;
  const bool fp8 = kv_dtype == kFp8;
  if (fp8 != (pipeline != Fp8Pipeline::kNone)) return 0;
  switch (tile_rows) {
    case 16:
      if (smem_plan != SmemPlan::kSm90) return 0;
      if (pipeline == Fp8Pipeline::kRegisters) return sizeof(PlanOf<16, kFp8, true, false, kDType>);
      if (pipeline == Fp8Pipeline::kDequantAhead) return 0;
      return fp8 ? sizeof(PlanOf<16, kFp8, false, false, kDType>) : sizeof(PlanOf<16, kModel, false, false, kDType>);
    case 32:
      if (smem_plan != SmemPlan::kSm90 || (fp8 && pipeline != Fp8Pipeline::kInPlace)) return 0;
      return fp8 ? sizeof(PlanOf<32, kFp8, false, false, kDType>) : sizeof(PlanOf<32, kModel, false, false, kDType>);
    case 64:
      if (smem_plan == SmemPlan::kA100) {
        if (fp8 && pipeline != Fp8Pipeline::kInPlace) return 0;
        return fp8 ? sizeof(PlanOf<64, kFp8, false, true, kDType>) : sizeof(PlanOf<64, kModel, false, true, kDType>);
      }
      if (smem_plan != SmemPlan::kSm90 || (fp8 && pipeline != Fp8Pipeline::kDequantAhead)) return 0;
      return fp8 ? sizeof(PlanOf<64, kFp8, false, false, kDType>) : sizeof(PlanOf<64, kModel, false, false, kDType>);
    default:
      return 0;
  }
}

// The FP8 pipeline of a tile's default plan (the 16-row tile may convert in registers
// instead: PlanDecode).
Fp8Pipeline DefaultFp8Pipeline(KvDType kv_dtype, int tile_rows, SmemPlan smem_plan) {
  if (kv_dtype != KvDType::kFp8E4M3) return Fp8Pipeline::kNone;
  return tile_rows == 64 && smem_plan == SmemPlan::kSm90 ? Fp8Pipeline::kDequantAhead : Fp8Pipeline::kInPlace;
}

bool Has64(const DeviceInfo& dev, KvDType kv_dtype) {
  SmemPlan plan;
  return Tile64SmemPlan(dev, kv_dtype, &plan) && dev.kernels[0][2].present && dev.kernels[1][2].present;
}

// Calls with at most this many query-row keys in all (batch x KV heads x rows per KV
// head x longest sequence) run the 16-row tile whatever their rows per KV head: they
// are latency-bound, and it is the tile with the shortest path per KV tile (Q in
// registers, 2 CTAs per SM on A100 too); its extra reads of each KV tile, one per 16
// rows, are L2 hits, since a partition's row tiles are neighbours in the grid. Measured
// on the H200 (ae81cab): up to 2^21 it wins or ties against the 32- and 64-row tiles
// ((1,64,4096) 1.29x, (8,64,4096) 1.04x, (4,128,4096) 1.0x); at 2^22 and beyond the
// 64-row tile is 7-21% faster ((4,128,8192), (1,128,65536)).
constexpr int64_t kSmallCallRowKeys = int64_t{1} << 21;

// The planner's tile: the 16-row tile for up to 63 rows per KV head and for small
// calls; otherwise the 64-row tile where it has a plan (SM90 and A100 parts), else the
// 32-row tile. The 16-row tile measured 2-12% faster than the 32-row tile on every shape
// tried on the H200, 32 to 1024 rows per KV head, s_q 2 included (ae81cab). At 32-63 rows
// it reads each KV tile twice from L2 where the 32-row tile reads it once; at 64+ rows
// 4-8 times, which the H200's L2 carried but an A100's smaller L2 bandwidth may not.
// The 64-row tile reads each KV tile once per 64 rows; its A100 plan, run on an H100, is
// 1.47x the 32-row tile at (64,128,4096) bf16, 1.5x with an FP8 cache (27c1ff2; no A100
// was at hand to measure it there).
int ChooseTileRows(const DeviceInfo& dev, const MlaDecodeParams& p, int max_len) {
  const int rows = (p.h_q / p.h_kv) * p.s_q;
  const bool small = int64_t(p.batch) * p.h_kv * rows * max_len <= kSmallCallRowKeys;
  if (TileRowsFor(rows) != 64 || small) return 16;
  return Has64(dev, p.kv_dtype) ? 64 : 32;
}

// Fewest keys worth a partition of its own: below this the prologue (Q load, pipeline
// fill) and the combine row cost more than the keys' streaming time.
constexpr int kMinKeysPerSplit = 128;

int RoundUp(int x, int m) { return (x + m - 1) / m * m; }

// Partition boundaries are multiples of this many keys: a multiple of every tile
// configuration's KV tile, so no tile straddles two partitions (or two pages).
constexpr int kSplitGranularity = 32;
static_assert(kSplitGranularity % sm80::TileConfig<16>::kKeys == 0 &&
                  kSplitGranularity % sm80::TileConfig<32>::kKeys == 0 &&
                  kSplitGranularity % sm80::TileConfig<64>::kKeys == 0 && kPageSize % kSplitGranularity == 0,
              "partition granularity must be whole KV tiles within a page");

// Calls with at most this many keys over all (sequence, KV head, row tile) streams are
// latency-bound: short partitions then beat fewer, longer ones (25fdb2d, d608533).
constexpr int64_t kSmallCallKeys = 8192;

// The longest partitions the half-wave plan may take (ChooseSplits, e61db1d).
constexpr int kHalfWaveMaxKeys = 512;

// Partitions per sequence: fill the device's resident CTA slots once, never more than
// one wave, and never below kMinKeysPerSplit keys each (fewer for small calls).
// half_wave: a 16-bit cache on a tile with 2+ CTAs per SM. There, where filling half
// the slots still gives partitions of at most kHalfWaveMaxKeys, and fewer of them, the
// half-wave plan is faster: the decode kernel takes the same time with one CTA per SM on
// twice the keys (short partitions are latency-bound, not bandwidth-bound), and the
// combine merges half the partials (e61db1d: 5-7% on (1,16,65536) and (16,16,4096), 1-3%
// on (64,16,1024); FP8 caches and longer partitions lose, so they keep the full wave).
void ChooseSplits(int slots, int streams, int max_len, bool half_wave, int* num_splits, int* keys_per_split) {
  // Small calls: one-page partitions; 32-key ones only while that makes at most 8
  // partitions, since each partition adds combine work (d608533).
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

}  // namespace

const char* SmemPlanName(SmemPlan plan) {
  switch (plan) {
    case SmemPlan::kSm90:
      return "sm90";
    case SmemPlan::kA100:
      return "a100";
  }
  return "unknown";
}

const char* Fp8PipelineName(Fp8Pipeline pipeline) {
  switch (pipeline) {
    case Fp8Pipeline::kNone:
      return "none";
    case Fp8Pipeline::kInPlace:
      return "in place";
    case Fp8Pipeline::kRegisters:
      return "in registers";
    case Fp8Pipeline::kDequantAhead:
      return "dequantized ahead";
  }
  return "unknown";
}

int PlanSmemBytes(DType dtype, KvDType kv_dtype, int tile_rows, Fp8Pipeline pipeline, SmemPlan smem_plan) {
  if (dtype == DType::kBF16) return SmemOf<DType::kBF16>(kv_dtype, tile_rows, pipeline, smem_plan);
  if (dtype == DType::kFP16) return SmemOf<DType::kFP16>(kv_dtype, tile_rows, pipeline, smem_plan);
  return 0;
}

bool Tile64SmemPlan(const DeviceInfo& dev, KvDType kv_dtype, SmemPlan* plan) {
  SmemPlan p;
  if (dev.cc_major == 9) {
    p = SmemPlan::kSm90;
  } else if (dev.cc_major == 8) {
    p = SmemPlan::kA100;
  } else {
    return false;
  }
  const Fp8Pipeline pipe = DefaultFp8Pipeline(kv_dtype, 64, p);
  const int need = std::max(PlanSmemBytes(DType::kBF16, kv_dtype, 64, pipe, p),
                            PlanSmemBytes(DType::kFP16, kv_dtype, 64, pipe, p));
  if (need == 0 || dev.max_smem_per_block_optin < need) return false;
  *plan = p;
  return true;
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
  if (r.tile_rows == 64 && !Tile64SmemPlan(dev, p.kv_dtype, &r.smem_plan))
    return {Code::kUnsupported, "tile_rows 64: no plan of the 64-row tile fits this device"};
  const KernelResources& k = dev.kernels[static_cast<int>(p.dtype)][TileIndex(r.tile_rows)];
  if (!k.present || k.ctas_per_sm < 1) return {Code::kUnsupported, "decode kernel does not fit on this device"};
  const int rows = (p.h_q / p.h_kv) * p.s_q;
  r.row_tiles = (rows + r.tile_rows - 1) / r.tile_rows;
  r.threads = ThreadsOf(r.tile_rows);
  // The 16-bit cache's occupancy for both caches: the FP8 pipelines of each tile fit as
  // many CTAs per SM (the 16-row tile's two: 238-247 registers, 80 and 71 KB).
  r.ctas_per_sm = k.ctas_per_sm;
  const int streams = p.batch * p.h_kv * r.row_tiles;
  ChooseSplits(r.ctas_per_sm * dev.sm_count, streams, max_len,
               p.kv_dtype == KvDType::kModel && r.ctas_per_sm >= 2, &r.num_splits, &r.keys_per_split);
  r.fp8_pipeline = DefaultFp8Pipeline(p.kv_dtype, r.tile_rows, r.smem_plan);
  if (r.fp8_pipeline == Fp8Pipeline::kInPlace && r.tile_rows == 16 &&
      r.keys_per_split >= sm80::kFp8RegsMinTiles * sm80::TileConfig<16>::kKeys)
    r.fp8_pipeline = Fp8Pipeline::kRegisters;
  r.p_rounding = p.p_rounding;
  r.smem_bytes = PlanSmemBytes(p.dtype, p.kv_dtype, r.tile_rows, r.fp8_pipeline, r.smem_plan);
  *plan = r;
  return Status::Ok();
}

Status ValidatePlan(const MlaDecodeParams& p, const DecodePlan& plan, size_t workspace_bytes, const void* workspace) {
  if (TileIndex(plan.tile_rows) < 0) return Status::Invalid("plan.tile_rows: expected 16, 32 or 64 (use PlanDecode)");
  if (plan.num_splits < 1 || plan.num_splits > 65535) return Status::Invalid("plan.num_splits: expected 1..65535");
  if (plan.keys_per_split < kSplitGranularity || plan.keys_per_split % kSplitGranularity != 0)
    return Status::Invalid("plan.keys_per_split: expected a positive multiple of " + std::to_string(kSplitGranularity));
  const int rows = (p.h_q / p.h_kv) * p.s_q;
  if (plan.row_tiles != (rows + plan.tile_rows - 1) / plan.tile_rows)
    return Status::Invalid("plan.row_tiles does not match the params' head counts and s_q");
  if (int64_t(p.batch) * p.h_kv > 65535) return {Code::kUnsupported, "batch * h_kv above 65535"};
  if (plan.p_rounding != p.p_rounding) return Status::Invalid("plan.p_rounding does not match the params'");
  const int smem = PlanSmemBytes(p.dtype, p.kv_dtype, plan.tile_rows, plan.fp8_pipeline, plan.smem_plan);
  if (smem == 0)
    return Status::Invalid(std::string("plan: no ") + DTypeName(p.dtype) + " kernel of tile_rows " +
                           std::to_string(plan.tile_rows) + " with smem_plan " + SmemPlanName(plan.smem_plan) +
                           " and fp8_pipeline " + Fp8PipelineName(plan.fp8_pipeline) + " for a " +
                           KvDTypeName(p.kv_dtype, p.dtype) + " cache");
  if (plan.smem_bytes != smem)
    return Status::Invalid("plan.smem_bytes: expected " + std::to_string(smem) + " for its tile and plans");
  if (plan.num_splits > 1) {
    const size_t need = DecodeWorkspaceBytes(p, plan);
    if (workspace_bytes < need || (need > 0 && workspace == nullptr))
      return {Code::kWorkspaceTooSmall, "workspace: need " + std::to_string(need) + " bytes, got " +
                                            std::to_string(workspace_bytes)};
  }
  return Status::Ok();
}

size_t DecodeWorkspaceBytes(const MlaDecodeParams& p, const DecodePlan& plan) {
  if (plan.num_splits <= 1) return 0;
  return PartialFloats(p, plan.num_splits) * sizeof(float);
}

size_t MaxDecodeWorkspaceBytes(const DeviceInfo& dev, int max_batch, int s_q, int h_q, int h_kv) {
  if (max_batch < 1 || s_q < 1 || h_kv < 1 || h_q < h_kv || h_q % h_kv) return 0;
  // ChooseSplits gives at most max(1, slots / (batch * h_kv * row_tiles)) partitions,
  // so batch * num_splits <= batch + slots / (h_kv * row_tiles) over every batch size.
  // The slot count uses the largest occupancy any tile can have (registers cap it at 16
  // CTAs of 128 threads on SM80+) where the device description has none.
  // Every tile the planner may pick for these rows: 16 (small calls), and 32 and 64
  // where the rows ask for them.
  const int rows = (h_q / h_kv) * s_q;
  size_t most = 0;
  for (int tile : {16, TileRowsFor(rows) >= 32 ? 32 : 0, TileRowsFor(rows) == 64 ? 64 : 0}) {
    if (tile == 0) continue;
    const int row_tiles = (rows + tile - 1) / tile;
    int ctas = 0;
    for (int di = 0; di < 2; ++di) {
      const KernelResources& k = dev.kernels[di][TileIndex(tile)];
      if (k.present) ctas = std::max(ctas, k.ctas_per_sm);
    }
    if (ctas < 1) ctas = 16;
    const int64_t slots = int64_t(ctas) * std::max(1, dev.sm_count);
    const int64_t best = int64_t(max_batch) + slots / (int64_t(h_kv) * row_tiles);
    most = std::max(most, size_t(best) * h_q * s_q * (kHeadDimV + 1) * sizeof(float));
  }
  return most;
}

Status DescribeTiles(const DeviceInfo& dev, DType dtype, TileOccupancy* configs, int max_configs, int* num_configs) {
  if (!num_configs) return Status::Invalid("num_configs: expected a pointer");
  *num_configs = 0;
  if (!KnownDType(dtype)) return {Code::kUnsupported, "dtype: no kernel"};
  for (int ti = 0; ti < sm80::kNumTileConfigs; ++ti) {
    const int tile = sm80::kTileRowOptions[ti];
    if (*num_configs >= max_configs) break;
    SmemPlan plan = SmemPlan::kSm90;
    if (tile == 64 && !(Has64(dev, KvDType::kModel) && Tile64SmemPlan(dev, KvDType::kModel, &plan)))
      continue;  // no plan of the 64-row tile on this device
    const KernelResources& k = dev.kernels[dtype == DType::kBF16 ? 0 : 1][ti];
    if (!k.present) return {Code::kUnsupported, "no kernel of tile_rows " + std::to_string(tile) + " on this device"};
    TileOccupancy t;
    t.tile_rows = tile;
    t.threads = ThreadsOf(tile);
    t.regs_per_thread = k.regs_per_thread;
    t.smem_bytes = PlanSmemBytes(dtype, KvDType::kModel, tile, Fp8Pipeline::kNone, plan) + k.static_smem_bytes;
    t.ctas_per_sm = k.ctas_per_sm;
    // A100 (SM80): 64K registers per SM allocated per warp in units of 256, 164 KB of
    // shared memory per SM with 1 KB reserved per CTA, 2048 threads, 32 CTAs.
    const int warps = t.threads / 32;
    const int regs_per_warp = (t.regs_per_thread * 32 + 255) / 256 * 256;
    const int by_regs = regs_per_warp > 0 ? 65536 / (regs_per_warp * warps) : 32;
    // The 64-row tile: its A100 plan, whatever this device runs.
    const int a100_smem =
        tile == 64 ? PlanSmemBytes(DType::kBF16, KvDType::kModel, 64, Fp8Pipeline::kNone, SmemPlan::kA100) +
                         k.static_smem_bytes
                   : t.smem_bytes;
    const int by_smem = (164 * 1024) / (a100_smem + 1024);
    const int by_threads = 2048 / t.threads;
    t.ctas_per_sm_a100 = std::min({by_regs, by_smem, by_threads, 32});
    configs[(*num_configs)++] = t;
  }
  return Status::Ok();
}

}  // namespace latentd::kernels
