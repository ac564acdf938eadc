// The descriptor handoff in one process: the ticket's holder gets the memory file once;
// a wrong ticket, a second use and a withdrawn offer get nothing.
#include "server/dataplane/fd_handoff.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/handoff.h"
#include "server/dataplane/shared_region.h"

namespace latentd::server::dataplane {
namespace {

std::string UniqueName() { return absl::StrCat("@latentd-handoff-test-", getpid()); }

TEST(FdHandoff, TheTicketsHolderGetsTheFileOnce) {
  auto h = FdHandoff::Listen(UniqueName());
  ASSERT_TRUE(h.ok()) << h.status();
  auto file = SharedFile::Make("handoff-test", 4096);
  ASSERT_TRUE(file.ok()) << file.status();
  file->data()[10] = 99;
  auto ticket = (*h)->Offer(file->fd());
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  EXPECT_EQ(ticket->size(), handoff::kTicketBytes);
  EXPECT_EQ((*h)->pending(), 1u);

  std::string wrong = *ticket;
  wrong[0] ^= 1;
  EXPECT_EQ(handoff::CollectFd((*h)->name(), wrong).status().code(), absl::StatusCode::kPermissionDenied);

  absl::StatusOr<int> fd = handoff::CollectFd((*h)->name(), *ticket);
  ASSERT_TRUE(fd.ok()) << fd.status();
  void* map = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  ASSERT_NE(map, MAP_FAILED);
  EXPECT_EQ(static_cast<char*>(map)[10], 99);  // the same memory
  munmap(map, 4096);
  close(*fd);
  EXPECT_EQ((*h)->pending(), 0u);

  EXPECT_EQ(handoff::CollectFd((*h)->name(), *ticket).status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(FdHandoff, AWithdrawnOfferIsGone) {
  auto h = FdHandoff::Listen(UniqueName() + "-w");
  ASSERT_TRUE(h.ok()) << h.status();
  auto file = SharedFile::Make("handoff-test", 4096);
  ASSERT_TRUE(file.ok()) << file.status();
  auto ticket = (*h)->Offer(file->fd());
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  (*h)->Withdraw(*ticket);
  EXPECT_EQ((*h)->pending(), 0u);
  EXPECT_EQ(handoff::CollectFd((*h)->name(), *ticket).status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(FdHandoff, AFilesystemSocketIsTheOwnersAlone) {
  // Under /tmp: the test's own temporary directory can be longer than a socket path may be.
  const std::string path = absl::StrCat("/tmp/latentd-handoff-test-", getpid(), ".sock");
  {
    auto h = FdHandoff::Listen(path);
    ASSERT_TRUE(h.ok()) << h.status();
    struct stat st;
    ASSERT_EQ(stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }
  EXPECT_NE(access(path.c_str(), F_OK), 0);  // removed with the handoff
}

TEST(FdHandoff, NoSocketIsUnavailable) {
  EXPECT_EQ(handoff::CollectFd("@latentd-handoff-test-nobody-listens", std::string(16, 'x')).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace latentd::server::dataplane
