// The planner's rules on hand-built A100-, H100- and SM86-like device descriptions (no
// GPU needed): tile choice, the 64-row tile's shared-memory plan, the half-wave rule,
// the FP8 pipeline, P rounding, plan validation and its error branches.
#include "kernels/planner.h"

#include <gtest/gtest.h>

#include <vector>

#include "kernels/params.h"

namespace latentd::kernels {
namespace {

// Resident CTAs per SM as the occupancy calculator reports them for the 16-bit-cache
// kernels (16- and 32-row tiles: 2 of 128 threads; 64-row tile: 1 of 256).
DeviceInfo Device(int cc_major, int cc_minor, int sms, int optin_kb, int tile16_ctas, bool tile64) {
  DeviceInfo d;
  d.cc_major = cc_major;
  d.cc_minor = cc_minor;
  d.sm_count = sms;
  d.max_smem_per_block_optin = optin_kb * 1024;
  d.max_smem_per_sm = (optin_kb + 1) * 1024;
  d.regs_per_sm = 65536;
  d.max_threads_per_sm = 2048;
  for (auto& per_dtype : d.kernels) {
    per_dtype[0] = {true, 128, 194, 0, tile16_ctas};
    per_dtype[1] = {true, 128, 232, 0, tile16_ctas};
    if (tile64) per_dtype[2] = {true, 256, 253, 0, 1};
  }
  return d;
}
DeviceInfo H100() { return Device(9, 0, 132, 227, 2, true); }
DeviceInfo A100() { return Device(8, 0, 108, 163, 2, true); }
DeviceInfo Sm86() { return Device(8, 6, 84, 99, 1, false); }

// A call's params with placeholder pointers (the planner reads none of them).
struct Call {
  std::vector<int32_t> seqlens;
  MlaDecodeParams p;
  Call(int batch, int h_q, int len, KvDType kv = KvDType::kModel) : seqlens(batch, len) {
    static char buf[16];
    p.batch = batch;
    p.h_q = h_q;
    p.h_kv = 1;
    p.s_q = 1;
    p.softmax_scale = 0.1f;
    p.kv_dtype = kv;
    p.max_pages_per_seq = (len + kPageSize - 1) / kPageSize;
    p.num_pages = p.max_pages_per_seq * batch;
    p.q = p.kv = p.out = buf;
    p.block_table = p.seqlens = reinterpret_cast<const int32_t*>(buf);
    p.lse = reinterpret_cast<float*>(buf);
    SetContiguousStrides(&p);
  }
  DecodePlan Plan(const DeviceInfo& dev, int tile_rows = 0) {
    DecodePlan plan;
    const Status s = PlanDecode(dev, p, seqlens.data(), &plan, tile_rows);
    EXPECT_TRUE(s.ok()) << s.message;
    return plan;
  }
};

TEST(Planner, TileChoice) {
  for (const DeviceInfo& dev : {A100(), H100(), Sm86()}) {
    const bool has64 = dev.kernels[0][2].present;
    Call c(64, 16, 4096);
    DecodePlan plan = c.Plan(dev);
    EXPECT_EQ(plan.tile_rows, 16);
    EXPECT_EQ(plan.threads, 128);
    // One wave at most: partitions x sequences fit the resident CTA slots.
    EXPECT_LE(plan.num_splits * 64, plan.ctas_per_sm * dev.sm_count);
    c.p.h_q = 128;
    plan = c.Plan(dev);
    EXPECT_EQ(plan.tile_rows, has64 ? 64 : 32);
    EXPECT_EQ(plan.row_tiles, has64 ? 2 : 4);
    EXPECT_EQ(plan.threads, has64 ? 256 : 128);
    c.p.batch = 1;  // small calls (up to 2^21 query-row keys in all): the 16-row tile
    plan = c.Plan(dev);
    EXPECT_EQ(plan.tile_rows, 16);
    EXPECT_EQ(plan.row_tiles, 8);
    c.p.batch = 4;  // 512 rows x 4096 keys: still small
    EXPECT_EQ(c.Plan(dev).tile_rows, 16);
    c.p.batch = 5;  // 640 rows x 4096 keys: the compute tile where there is one
    EXPECT_EQ(c.Plan(dev).tile_rows, has64 ? 64 : 32);
    c.p.batch = 64;
    c.p.h_q = 32;  // 32 rows per KV head: two 16-row tiles, never the 32-row tile
    plan = c.Plan(dev);
    EXPECT_EQ(plan.tile_rows, 16);
    EXPECT_EQ(plan.row_tiles, 2);
    c.p.h_q = 128;
    plan = c.Plan(dev, 32);  // forced
    EXPECT_EQ(plan.tile_rows, 32);
    EXPECT_EQ(plan.row_tiles, 4);
    DecodePlan unused;
    EXPECT_EQ(PlanDecode(dev, c.p, c.seqlens.data(), &unused, 48).code, Code::kInvalidArgument);
    if (!has64) {
      EXPECT_EQ(PlanDecode(dev, c.p, c.seqlens.data(), &unused, 64).code, Code::kUnsupported);
    }
  }
}

TEST(Planner, SharedMemoryPlanOfTheComputeTile) {
  SmemPlan plan;
  ASSERT_TRUE(Tile64SmemPlan(H100(), KvDType::kModel, &plan));
  EXPECT_EQ(plan, SmemPlan::kSm90);
  ASSERT_TRUE(Tile64SmemPlan(A100(), KvDType::kFp8E4M3, &plan));
  EXPECT_EQ(plan, SmemPlan::kA100);
  EXPECT_FALSE(Tile64SmemPlan(Sm86(), KvDType::kModel, &plan));  // 99 KB per CTA
  DeviceInfo next = H100();
  next.cc_major = 10;  // no machine code past SM90
  EXPECT_FALSE(Tile64SmemPlan(next, KvDType::kModel, &plan));
  // A100's plan fits its 163 KB; SM90's needs more.
  const int a100 = PlanSmemBytes(DType::kBF16, KvDType::kModel, 64, Fp8Pipeline::kNone, SmemPlan::kA100);
  const int sm90 = PlanSmemBytes(DType::kBF16, KvDType::kModel, 64, Fp8Pipeline::kNone, SmemPlan::kSm90);
  EXPECT_LE(a100 + 1024, 164 * 1024);
  EXPECT_GT(sm90, a100);

  Call c(64, 128, 4096);
  DecodePlan p = c.Plan(A100());
  EXPECT_EQ(p.smem_plan, SmemPlan::kA100);
  EXPECT_EQ(p.smem_bytes, a100);
  p = c.Plan(H100());
  EXPECT_EQ(p.smem_plan, SmemPlan::kSm90);
  EXPECT_EQ(p.smem_bytes, sm90);
}

// One long sequence. Where the full wave would cut a 16-bit cache into partitions under
// 512 keys on a tile with 2+ CTAs per SM, the planner fills half the slots with
// partitions of at most 512 keys; an FP8 cache keeps the full wave (e61db1d).
TEST(Planner, HalfWaveRule) {
  Call c16(1, 16, 65536), c8(1, 16, 65536, KvDType::kFp8E4M3);
  // H100, 264 slots: the full wave is 256 x 256 keys, half a wave 128 x 512.
  DecodePlan p16 = c16.Plan(H100()), p8 = c8.Plan(H100());
  EXPECT_EQ(p16.num_splits, 128);
  EXPECT_EQ(p16.keys_per_split, 512);
  EXPECT_EQ(p8.num_splits, 256);
  EXPECT_EQ(p8.keys_per_split, 256);
  EXPECT_EQ(p8.ctas_per_sm, p16.ctas_per_sm);  // the 16-bit tile's occupancy, for both
  // A100, 216 slots: half a wave would take 608-key partitions, so both keep the full wave.
  p16 = c16.Plan(A100());
  p8 = c8.Plan(A100());
  EXPECT_EQ(p16.num_splits, 205);
  EXPECT_EQ(p16.keys_per_split, 320);
  EXPECT_EQ(p8.num_splits, p16.num_splits);
  EXPECT_EQ(p8.keys_per_split, p16.keys_per_split);
  // One CTA per SM (SM86's 16-row tile): no half wave.
  p16 = c16.Plan(Sm86());
  EXPECT_EQ(p16.num_splits, 82);
  EXPECT_EQ(p16.keys_per_split, 800);
}

TEST(Planner, Fp8Pipeline) {
  // 64 x 4096 keys on the 16-row tile: 1024-key partitions, converted in registers.
  Call c(64, 16, 4096, KvDType::kFp8E4M3);
  DecodePlan p = c.Plan(H100());
  EXPECT_EQ(p.tile_rows, 16);
  EXPECT_EQ(p.keys_per_split, 1024);
  EXPECT_EQ(p.fp8_pipeline, Fp8Pipeline::kRegisters);
  EXPECT_EQ(p.smem_bytes,
            PlanSmemBytes(DType::kBF16, KvDType::kFp8E4M3, 16, Fp8Pipeline::kRegisters, SmemPlan::kSm90));
  // Short partitions (256 keys): in place.
  Call one(1, 16, 65536, KvDType::kFp8E4M3);
  EXPECT_EQ(one.Plan(H100()).fp8_pipeline, Fp8Pipeline::kInPlace);
  // The compute tiles: dequantized ahead on SM90, in place on A100 and on the 32-row tile.
  c.p.h_q = 128;
  EXPECT_EQ(c.Plan(H100()).fp8_pipeline, Fp8Pipeline::kDequantAhead);
  p = c.Plan(A100());
  EXPECT_EQ(p.fp8_pipeline, Fp8Pipeline::kInPlace);
  EXPECT_EQ(p.smem_plan, SmemPlan::kA100);
  p = c.Plan(Sm86());
  EXPECT_EQ(p.tile_rows, 32);
  EXPECT_EQ(p.fp8_pipeline, Fp8Pipeline::kInPlace);
  // 16-bit caches: none.
  Call m(64, 128, 4096);
  EXPECT_EQ(m.Plan(H100()).fp8_pipeline, Fp8Pipeline::kNone);
}

TEST(Planner, PRoundingIsCarried) {
  Call c(64, 128, 4096);
  EXPECT_EQ(c.Plan(H100()).p_rounding, PRounding::kSplit);
  c.p.p_rounding = PRounding::kOnce;
  const DecodePlan p = c.Plan(H100());
  EXPECT_EQ(p.p_rounding, PRounding::kOnce);
  EXPECT_TRUE(ValidatePlan(c.p, p, 1 << 30, &c).ok());
  c.p.p_rounding = PRounding::kSplit;
  EXPECT_EQ(ValidatePlan(c.p, p, 1 << 30, &c).code, Code::kInvalidArgument);
  c.p.p_rounding = static_cast<PRounding>(7);
  DecodePlan unused;
  EXPECT_EQ(PlanDecode(H100(), c.p, c.seqlens.data(), &unused).code, Code::kInvalidArgument);
}

TEST(Planner, Errors) {
  Call c(64, 16, 4096);
  DecodePlan plan;
  EXPECT_EQ(PlanDecode(H100(), c.p, c.seqlens.data(), nullptr).code, Code::kInvalidArgument);
  EXPECT_EQ(PlanDecode(DeviceInfo{}, c.p, c.seqlens.data(), &plan).code, Code::kInvalidArgument);
  EXPECT_EQ(PlanDecode(H100(), c.p, nullptr, &plan).code, Code::kInvalidArgument);
  MlaDecodeParams bad = c.p;
  bad.h_q = 24;
  bad.h_kv = 5;
  EXPECT_EQ(PlanDecode(H100(), bad, c.seqlens.data(), &plan).code, Code::kInvalidArgument);
  c.seqlens[3] = -1;
  EXPECT_EQ(PlanDecode(H100(), c.p, c.seqlens.data(), &plan).code, Code::kInvalidArgument);
  c.seqlens[3] = 4096 + 64;  // past max_pages_per_seq
  EXPECT_EQ(PlanDecode(H100(), c.p, c.seqlens.data(), &plan).code, Code::kInvalidArgument);
  c.seqlens[3] = 4096;
  DeviceInfo none = H100();
  none.kernels[0][0].present = false;
  EXPECT_EQ(PlanDecode(none, c.p, c.seqlens.data(), &plan).code, Code::kUnsupported);

  plan = c.Plan(H100());
  EXPECT_TRUE(ValidatePlan(c.p, plan, DecodeWorkspaceBytes(c.p, plan), &c).ok());
  DecodePlan p = plan;
  p.num_splits = 4;
  p.keys_per_split = 1024;
  EXPECT_EQ(ValidatePlan(c.p, p, 0, nullptr).code, Code::kWorkspaceTooSmall);
  p.keys_per_split = 100;  // not whole KV tiles
  EXPECT_EQ(ValidatePlan(c.p, p, 1 << 30, &c).code, Code::kInvalidArgument);
  p = plan;
  p.tile_rows = 48;
  EXPECT_EQ(ValidatePlan(c.p, p, 1 << 30, &c).code, Code::kInvalidArgument);
  p = plan;
  p.row_tiles = 3;
  EXPECT_EQ(ValidatePlan(c.p, p, 1 << 30, &c).code, Code::kInvalidArgument);
  p = plan;
  p.fp8_pipeline = Fp8Pipeline::kInPlace;  // a 16-bit cache
  EXPECT_EQ(ValidatePlan(c.p, p, 1 << 30, &c).code, Code::kInvalidArgument);
  p = plan;
  p.smem_plan = SmemPlan::kA100;  // the 16-row tile has one plan
  EXPECT_EQ(ValidatePlan(c.p, p, 1 << 30, &c).code, Code::kInvalidArgument);
  p = plan;
  p.smem_bytes += 16;
  EXPECT_EQ(ValidatePlan(c.p, p, 1 << 30, &c).code, Code::kInvalidArgument);
  // No kernel dequantizes ahead on the 16-row tile, nor converts in registers on the 32-row one.
  EXPECT_EQ(PlanSmemBytes(DType::kBF16, KvDType::kFp8E4M3, 16, Fp8Pipeline::kDequantAhead, SmemPlan::kSm90), 0);
  EXPECT_EQ(PlanSmemBytes(DType::kFP16, KvDType::kFp8E4M3, 32, Fp8Pipeline::kRegisters, SmemPlan::kSm90), 0);
  EXPECT_EQ(PlanSmemBytes(DType::kBF16, KvDType::kFp8E4M3, 64, Fp8Pipeline::kDequantAhead, SmemPlan::kA100), 0);
}

TEST(Planner, WorkspaceBound) {
  for (const DeviceInfo& dev : {A100(), H100(), Sm86()})
    for (int h_q : {16, 32, 128})
      for (int batch : {1, 5, 64})
        for (int len : {65, 4096, 65536}) {
          Call c(batch, h_q, len);
          const DecodePlan plan = c.Plan(dev);
          EXPECT_LE(DecodeWorkspaceBytes(c.p, plan), MaxDecodeWorkspaceBytes(dev, 64, 1, h_q, 1))
              << h_q << " " << batch << " " << len;
          if (plan.num_splits == 1) {
            EXPECT_EQ(DecodeWorkspaceBytes(c.p, plan), 0u);
          }
        }
  EXPECT_EQ(MaxDecodeWorkspaceBytes(H100(), 0, 1, 16, 1), 0u);
}

TEST(Planner, DescribeTiles) {
  TileOccupancy tiles[4];
  int n = 0;
  ASSERT_TRUE(DescribeTiles(H100(), DType::kBF16, tiles, 4, &n).ok());
  ASSERT_EQ(n, 3);
  EXPECT_EQ(tiles[2].tile_rows, 64);
  EXPECT_EQ(tiles[2].ctas_per_sm, 1);
  EXPECT_EQ(tiles[2].ctas_per_sm_a100, 1);  // its A100 plan fits 163 KB
  EXPECT_EQ(tiles[0].ctas_per_sm_a100, 2);
  EXPECT_EQ(tiles[1].ctas_per_sm_a100, 2);
  ASSERT_TRUE(DescribeTiles(Sm86(), DType::kFP16, tiles, 4, &n).ok());
  EXPECT_EQ(n, 2);
  EXPECT_EQ(DescribeTiles(H100(), DType::kBF16, tiles, 4, nullptr).code, Code::kInvalidArgument);
}

}  // namespace
}  // namespace latentd::kernels
