// The CUDA IPC region's request checks (no GPU needed): handle size, region size, and
// the per-region bound, each naming its field.
#include "server/dataplane/cuda_region.h"

#include <string>

#include "gtest/gtest.h"

namespace latentd::server::dataplane {
namespace {

wire::CudaRegionFields Request(uint64_t bytes) {
  wire::CudaRegionFields r;
  r.present = true;
  r.handle = std::string(wire::CudaRegionFields::kMaxIpcHandleBytes, 'h');
  r.handle_bytes = wire::CudaRegionFields::kMaxIpcHandleBytes;
  r.bytes = bytes;
  return r;
}

TEST(CudaRegion, WellFormedRequestPasses) { EXPECT_TRUE(CudaRegion::CheckRequest(Request(4096), 1 << 20).ok()); }

TEST(CudaRegion, HandleOfTheWrongSize) {
  wire::CudaRegionFields r = Request(4096);
  r.handle_bytes = 63;
  const absl::Status st = CudaRegion::CheckRequest(r, 1 << 20);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message().rfind("DecodeRequest.open_cuda_region.ipc_handle: 63 bytes", 0), 0u) << st;
}

TEST(CudaRegion, EmptyRegion) {
  const absl::Status st = CudaRegion::CheckRequest(Request(0), 1 << 20);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message().rfind("DecodeRequest.open_cuda_region.bytes: 0", 0), 0u) << st;
}

TEST(CudaRegion, OverTheRegionBound) {
  const absl::Status st = CudaRegion::CheckRequest(Request((1 << 20) + 1), 1 << 20);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("--max_region_bytes=1048576"), absl::string_view::npos) << st;
}

TEST(CudaRegion, DefaultIsEmpty) {
  CudaRegion r;
  EXPECT_TRUE(r.empty());
  EXPECT_EQ(r.device(), 0u);
}

}  // namespace
}  // namespace latentd::server::dataplane
