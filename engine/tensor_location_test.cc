// TensorLocation on the CPU: each kind's accessors, and region offsets becoming the
// host and device addresses of the same byte.
#include "engine/tensor_location.h"

#include <vector>

#include "gtest/gtest.h"

namespace latentd::engine {
namespace {

using Kind = TensorLocation::Kind;

TEST(TensorLocation, UnsetByDefault) {
  const TensorLocation t;
  EXPECT_EQ(t.kind(), Kind::kNone);
  EXPECT_FALSE(t.set());
  EXPECT_FALSE(t.on_host());
  EXPECT_FALSE(t.device_direct());
  EXPECT_TRUE(t.view().empty());
}

TEST(TensorLocation, HostBytesAreStagedByTheBackend) {
  std::vector<char> buf(64, 'x');
  const TensorLocation t = TensorLocation::Host(buf.data(), buf.size());
  EXPECT_EQ(t.kind(), Kind::kHost);
  EXPECT_TRUE(t.on_host());
  EXPECT_FALSE(t.device_direct());
  EXPECT_EQ(t.host(), buf.data());
  EXPECT_EQ(t.device(), 0u);
  EXPECT_EQ(t.bytes(), 64u);
  EXPECT_EQ(t.view(), std::string(64, 'x'));
}

TEST(TensorLocation, HostRegionOffsetIsReachableFromBoth) {
  std::vector<char> buf(8192);
  const MemoryRegion r{buf.data(), 0x7f0000000000, buf.size()};
  const TensorLocation t = TensorLocation::InHostRegion(r, 4096, 256);
  EXPECT_EQ(t.kind(), Kind::kHostRegion);
  EXPECT_TRUE(t.on_host());
  EXPECT_TRUE(t.device_direct());
  EXPECT_EQ(t.host(), buf.data() + 4096);
  EXPECT_EQ(t.device(), 0x7f0000000000u + 4096);
  EXPECT_EQ(t.view().size(), 256u);
}

TEST(TensorLocation, DeviceRegionOffsetHasNoHostAddress) {
  const MemoryRegion r{nullptr, 0x500000000, 1 << 20};
  const TensorLocation t = TensorLocation::InDeviceRegion(r, 512, 128);
  EXPECT_EQ(t.kind(), Kind::kDeviceRegion);
  EXPECT_FALSE(t.on_host());
  EXPECT_TRUE(t.device_direct());
  EXPECT_EQ(t.host(), nullptr);
  EXPECT_EQ(t.device(), 0x500000000u + 512);
  EXPECT_EQ(t.bytes(), 128u);
  EXPECT_TRUE(t.view().empty());
}

}  // namespace
}  // namespace latentd::engine
