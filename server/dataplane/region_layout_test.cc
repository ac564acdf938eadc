// The region bounds rule: tensors inside the region, past its ring, aligned, with s_q in
// range; each refusal names its field.
#include "server/dataplane/region_layout.h"

#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

namespace latentd::server::dataplane {
namespace {

// One token of a small model: q 1152, kv 1152, out 1024, lse 4 bytes.
constexpr RowBytes kRows{1152, 1152, 1024, 4};
constexpr uint64_t kMaxSq = 4;

RegionTensors Fitting() {
  RegionTensors t;
  t.s_q = 1;
  t.q_offset = 4096;
  t.kv_offset = 8192;
  t.out_offset = 12288;
  t.lse_offset = 16384;
  return t;
}

void ExpectRefused(const absl::Status& st, const char* field) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(st.message().rfind(field, 0), 0u) << st;
}

TEST(RegionLayout, TensorsInsideAndAlignedAreAccepted) {
  EXPECT_TRUE(CheckRegionTensors(Fitting(), kRows, kMaxSq, {20480, 4096}).ok());
  // The last bytes of the region may be used.
  RegionTensors t = Fitting();
  t.lse_offset = 20480 - 4;
  EXPECT_TRUE(CheckRegionTensors(t, kRows, kMaxSq, {20480, 4096}).ok());
}

TEST(RegionLayout, OverlappingTensorsAreTheClientsOwnAffair) {
  RegionTensors t = Fitting();
  t.kv_offset = t.q_offset;
  t.out_offset = t.q_offset;
  EXPECT_TRUE(CheckRegionTensors(t, kRows, kMaxSq, {20480, 4096}).ok());
}

TEST(RegionLayout, SqOutOfRange) {
  RegionTensors t = Fitting();
  t.s_q = 0;
  ExpectRefused(CheckRegionTensors(t, kRows, kMaxSq, {20480, 0}), "region.s_q: 0");
  t.s_q = kMaxSq + 1;
  ExpectRefused(CheckRegionTensors(t, kRows, kMaxSq, {1 << 20, 0}), "region.s_q: 5");
}

TEST(RegionLayout, TensorPastTheEnd) {
  RegionTensors t = Fitting();
  t.out_offset = 20480 - 1024 + 2;  // one element too far
  ExpectRefused(CheckRegionTensors(t, kRows, kMaxSq, {20480, 0}), "region.out_offset");
  t = Fitting();
  t.q_offset = 20480 + 2;  // starts past the end
  ExpectRefused(CheckRegionTensors(t, kRows, kMaxSq, {20480, 0}), "region.q_offset");
}

TEST(RegionLayout, HugeOffsetDoesNotWrap) {
  RegionTensors t = Fitting();
  t.kv_offset = std::numeric_limits<uint64_t>::max() - 1;
  ExpectRefused(CheckRegionTensors(t, kRows, kMaxSq, {20480, 0}), "region.kv_offset");
}

TEST(RegionLayout, Misaligned) {
  RegionTensors t = Fitting();
  t.q_offset += 1;
  ExpectRefused(CheckRegionTensors(t, kRows, kMaxSq, {20480, 0}), "region.q_offset");
  t = Fitting();
  t.lse_offset += 2;  // 2-aligned is not enough for float lse
  ExpectRefused(CheckRegionTensors(t, kRows, kMaxSq, {20480, 0}), "region.lse_offset");
}

TEST(RegionLayout, TensorInsideTheRing) {
  RegionTensors t = Fitting();
  t.q_offset = 2048;
  ExpectRefused(CheckRegionTensors(t, kRows, kMaxSq, {20480, 4096}), "region.q_offset: 2048; expected >= 4096");
  // Without a ring the same offset is fine.
  EXPECT_TRUE(CheckRegionTensors(t, kRows, kMaxSq, {20480, 0}).ok());
}

}  // namespace
}  // namespace latentd::server::dataplane
