// The device KvStorage on a real GPU: rows written, read back and copied page by page
// across every layer. Skips when no CUDA device is visible.
#include "engine/kv/cuda_storage.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

namespace latentd::engine::kv {
namespace {

bool HaveDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::vector<char> Rows(const KvCacheConfig& c, int n, int seed) {
  std::vector<char> v(n * c.row_bytes());
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<char>(seed * 131 + i * 7);
  return v;
}

class CudaKvStorageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

TEST_F(CudaKvStorageTest, WriteReadCopyRoundTrip) {
  KvCacheConfig c{3, 2, 5};
  auto s = MakeCudaKvStorage(c, 0, stream_);
  ASSERT_TRUE(s.ok()) << s.status();
  KvStorage& st = **s;
  ASSERT_NE(st.base(), nullptr);

  // Starts zeroed.
  std::vector<char> back(64 * c.row_bytes());
  ASSERT_TRUE(st.ReadRows(2, 4, 0, 64, back.data()).ok());
  EXPECT_EQ(back, std::vector<char>(back.size(), 0));

  for (int layer = 0; layer < 3; ++layer) {
    auto rows = Rows(c, 64, layer + 1);
    ASSERT_TRUE(st.WriteRows(layer, 1, 0, 40, rows.data()).ok());
    ASSERT_TRUE(st.WriteRows(layer, 1, 40, 24, rows.data() + 40 * c.row_bytes()).ok());
  }
  ASSERT_TRUE(st.CopyPage(1, 3).ok());
  ASSERT_TRUE(st.Synchronize().ok());
  for (int layer = 0; layer < 3; ++layer) {
    ASSERT_TRUE(st.ReadRows(layer, 1, 0, 64, back.data()).ok());
    EXPECT_EQ(back, Rows(c, 64, layer + 1)) << layer;
    ASSERT_TRUE(st.ReadRows(layer, 3, 0, 64, back.data()).ok());
    EXPECT_EQ(back, Rows(c, 64, layer + 1)) << layer;
    ASSERT_TRUE(st.ReadRows(layer, 2, 0, 64, back.data()).ok());
    EXPECT_EQ(back, std::vector<char>(back.size(), 0)) << layer;
  }

  // The documented layout: (layer, page) lives at storage page layer * num_pages + page.
  std::vector<char> raw(c.row_bytes());
  const char* dev = static_cast<const char*>(st.base()) +
                    c.PhysicalPage(2, 3) * c.layer_page_bytes() + 5 * c.row_bytes();
  ASSERT_EQ(cudaMemcpy(raw.data(), dev, raw.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  auto want = Rows(c, 64, 3);
  EXPECT_EQ(std::memcmp(raw.data(), want.data() + 5 * c.row_bytes(), raw.size()), 0);
}

TEST_F(CudaKvStorageTest, RejectsBadArguments) {
  KvCacheConfig c{2, 1, 2};
  auto s = MakeCudaKvStorage(c, 0, stream_);
  ASSERT_TRUE(s.ok()) << s.status();
  auto rows = Rows(c, 2, 0);
  EXPECT_EQ((*s)->WriteRows(2, 0, 0, 1, rows.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*s)->WriteRows(0, 0, 63, 2, rows.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*s)->CopyPage(0, 2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeCudaKvStorage(c, 1 << 20, stream_).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeCudaKvStorage(KvCacheConfig{0, 1, 1}, 0, stream_).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaKvStorageTest, TooLargeIsResourceExhausted) {
  auto free_bytes = CudaFreeMemoryBytes(0);
  ASSERT_TRUE(free_bytes.ok()) << free_bytes.status();
  auto c = KvCacheConfig::FromBudget(8, 1, *free_bytes * 2);
  ASSERT_TRUE(c.ok()) << c.status();
  auto s = MakeCudaKvStorage(*c, 0, stream_);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
  // The device is still usable afterwards.
  EXPECT_TRUE(MakeCudaKvStorage(KvCacheConfig{1, 1, 1}, 0, stream_).ok());
}

TEST_F(CudaKvStorageTest, SizesFromFreeMemory) {
  auto free_bytes = CudaFreeMemoryBytes(0);
  ASSERT_TRUE(free_bytes.ok()) << free_bytes.status();
  EXPECT_GT(*free_bytes, 0);
  auto c = KvCacheConfigFromFreeGpuMemory(4, 1, 0.01, 0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_LE(c->total_bytes(), *free_bytes / 100 + 1);
  EXPECT_GT(c->num_pages, 0);
  EXPECT_FALSE(KvCacheConfigFromFreeGpuMemory(4, 1, 0.0, 0).ok());
}

}  // namespace
}  // namespace latentd::engine::kv
