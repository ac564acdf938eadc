// The shared memory file: sized, sealed against resizing, mapped, reachable by its /proc
// path, and closed with its owner.
#include "server/dataplane/shared_region.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include "gtest/gtest.h"

namespace latentd::server::dataplane {
namespace {

TEST(SharedFile, MadeSealedAndMapped) {
  absl::StatusOr<SharedFile> f = SharedFile::Make("shared-region-test", 8192);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->bytes(), 8192u);
  ASSERT_NE(f->data(), nullptr);
  std::memset(f->data(), 7, 8192);
  struct stat st;
  ASSERT_EQ(fstat(f->fd(), &st), 0);
  EXPECT_EQ(st.st_size, 8192);
  const int seals = fcntl(f->fd(), F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_SHRINK);
  EXPECT_TRUE(seals & F_SEAL_GROW);
  EXPECT_TRUE(seals & F_SEAL_SEAL);
  EXPECT_NE(ftruncate(f->fd(), 4096), 0);   // cannot shrink under the daemon's reads
  EXPECT_NE(ftruncate(f->fd(), 16384), 0);  // nor grow
}

TEST(SharedFile, ProcPathOpensTheSameMemory) {
  absl::StatusOr<SharedFile> f = SharedFile::Make("shared-region-test", 4096);
  ASSERT_TRUE(f.ok()) << f.status();
  f->data()[100] = 42;
  const int fd = open(f->ProcPath().c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0) << f->ProcPath();
  char c = 0;
  EXPECT_EQ(pread(fd, &c, 1, 100), 1);
  EXPECT_EQ(c, 42);
  close(fd);
}

TEST(SharedFile, ClosedWithItsOwnerAndMovable) {
  int fd = -1;
  {
    absl::StatusOr<SharedFile> f = SharedFile::Make("shared-region-test", 4096);
    ASSERT_TRUE(f.ok()) << f.status();
    SharedFile moved = *std::move(f);
    EXPECT_TRUE(f->empty());
    fd = moved.fd();
    EXPECT_NE(fcntl(fd, F_GETFD), -1);
  }
  EXPECT_EQ(fcntl(fd, F_GETFD), -1);  // closed
}

TEST(SharedFile, ImpossibleSizeIsResourceExhausted) {
  absl::StatusOr<SharedFile> f = SharedFile::Make("shared-region-test", uint64_t{1} << 62);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kResourceExhausted) << f.status();
}

}  // namespace
}  // namespace latentd::server::dataplane
