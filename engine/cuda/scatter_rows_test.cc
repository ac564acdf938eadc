// The fp8 scatter on a real GPU: rows quantized by the device kernel into a CUDA pool
// read back byte for byte equal to QuantizeKvRowFp8's (NaN, infinities, subnormals,
// saturating and all-zero blocks included), at the right rows and nowhere else; and the
// model-dtype scatter still copies rows as they are. Skips when no CUDA device is
// visible.
#include "engine/cuda/scatter_rows.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "engine/kv/cuda_storage.h"
#include "kernels/cpu/half.h"
#include "kernels/kv_fp8.h"

namespace latentd::engine {
namespace {

using kernels::DType;
using kernels::kFp8RowBytes;
using kernels::kHeadDimQK;

bool HaveDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// Values that exercise every branch of the quantizer: ordinary, tiny (subnormal in the
// 16-bit type and in e4m3 after scaling), huge (beyond the largest scale), NaN, +-inf,
// and whole blocks of zeros or of specials only.
std::vector<uint16_t> HardRows(DType dtype, int rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> kind(0, 15);
  std::vector<uint16_t> v(size_t(rows) * kHeadDimQK);
  for (size_t i = 0; i < v.size(); ++i) {
    const size_t block = i / 128;
    float x = normal(rng);
    switch (block % 7) {
      case 1: x *= 1e-6f; break;                 // small block
      case 2: x *= 1e5f; break;                  // saturates (bf16; inf in fp16)
      case 3: x = 0.f; break;                    // all-zero block
      case 4: x = std::numeric_limits<float>::quiet_NaN(); break;  // no finite value
      default: break;
    }
    switch (kind(rng)) {
      case 0: x = std::numeric_limits<float>::quiet_NaN(); break;
      case 1: x = (i & 1) ? INFINITY : -INFINITY; break;
      case 2: x *= 1e-30f; break;  // bf16 subnormal territory; 0 in fp16
      default: break;
    }
    v[i] = kernels::FloatToHalf(dtype, x);
  }
  return v;
}

class ScatterRowsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    for (void* p : device_) cudaFree(p);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, host.size() * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    device_.push_back(p);
    return static_cast<T*>(p);
  }
  cudaStream_t stream_ = nullptr;
  std::vector<void*> device_;
};

TEST_F(ScatterRowsTest, Fp8BytesEqualTheHostQuantizer) {
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (int h_kv : {1, 3}) {
      auto c = kv::KvCacheConfig::FromPages(2, h_kv, 5, 2, kernels::KvDType::kFp8E4M3, dtype);
      ASSERT_TRUE(c.ok()) << c.status();
      auto storage = kv::MakeCudaKvStorage(*c, 0, stream_);
      ASSERT_TRUE(storage.ok()) << storage.status();
      // 70 tokens: rows 10..63 of (layer 1, page 3), then rows 0..15 of (layer 0, page 1).
      const int n = 70;
      const auto src = HardRows(dtype, n * h_kv, 7 + h_kv + static_cast<int>(dtype));
      std::vector<int64_t> dst(n);
      for (int t = 0; t < n; ++t)
        dst[t] = t < 54 ? c->PhysicalPage(1, 3) * 64 + 10 + t : c->PhysicalPage(0, 1) * 64 + (t - 54);
      ASSERT_EQ(LaunchScatterRowsFp8(Upload(src), Upload(dst), n, h_kv, dtype, (*storage)->base(), stream_), 0);
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);

      std::vector<uint8_t> want(size_t(n) * h_kv * kFp8RowBytes);
      for (int r = 0; r < n * h_kv; ++r)
        kernels::QuantizeKvRowFp8(dtype, src.data() + size_t(r) * kHeadDimQK, want.data() + size_t(r) * kFp8RowBytes);
      std::vector<uint8_t> got(want.size());
      ASSERT_TRUE((*storage)->ReadRows(1, 3, 10, 54, got.data()).ok());
      ASSERT_TRUE((*storage)->ReadRows(0, 1, 0, 16, got.data() + 54 * c->row_bytes()).ok());
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(int(got[i]), int(want[i])) << kernels::DTypeName(dtype) << " h_kv " << h_kv << " byte " << i
                                             << " (row " << i / kFp8RowBytes << ", offset " << i % kFp8RowBytes
                                             << ")";
      // Nothing around them was touched.
      std::vector<uint8_t> other(64 * c->row_bytes());
      ASSERT_TRUE((*storage)->ReadRows(1, 3, 0, 10, other.data()).ok());
      EXPECT_EQ(std::vector<uint8_t>(other.begin(), other.begin() + 10 * c->row_bytes()),
                std::vector<uint8_t>(10 * c->row_bytes(), 0));
      ASSERT_TRUE((*storage)->ReadRows(0, 1, 16, 48, other.data()).ok());
      EXPECT_EQ(std::vector<uint8_t>(other.begin(), other.begin() + 48 * c->row_bytes()),
                std::vector<uint8_t>(48 * c->row_bytes(), 0));

      // The storage's own upload path quantizes on the host into the same bytes.
      ASSERT_TRUE((*storage)->WriteRows(1, 4, 0, 54, src.data()).ok());
      std::vector<uint8_t> written(54 * c->row_bytes());
      ASSERT_TRUE((*storage)->ReadRows(1, 4, 0, 54, written.data()).ok());
      EXPECT_EQ(written, std::vector<uint8_t>(want.begin(), want.begin() + written.size()));
    }
  }
}

TEST_F(ScatterRowsTest, ModelDtypeRowsAreCopiedAsTheyAre) {
  auto c = kv::KvCacheConfig::FromPages(1, 2, 2);
  ASSERT_TRUE(c.ok());
  auto storage = kv::MakeCudaKvStorage(*c, 0, stream_);
  ASSERT_TRUE(storage.ok()) << storage.status();
  const auto src = HardRows(DType::kBF16, 3 * 2, 5);
  const std::vector<int64_t> dst = {64 + 5, 64 + 6, 2};
  ASSERT_EQ(LaunchScatterRows(Upload(src), Upload(dst), 3, static_cast<int>(c->row_bytes()), (*storage)->base(),
                              stream_),
            0);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  std::vector<uint16_t> got(2 * 2 * kHeadDimQK);
  ASSERT_TRUE((*storage)->ReadRows(0, 1, 5, 2, got.data()).ok());
  EXPECT_EQ(std::memcmp(got.data(), src.data(), got.size() * 2), 0);
  ASSERT_TRUE((*storage)->ReadRows(0, 0, 2, 1, got.data()).ok());
  EXPECT_EQ(std::memcmp(got.data(), src.data() + 2 * 2 * kHeadDimQK, 2 * kHeadDimQK * 2), 0);
}

}  // namespace
}  // namespace latentd::engine
