// NotifySystemd against a datagram socket standing in for systemd's: path and abstract
// addresses, and the no-op without $NOTIFY_SOCKET.
#include "server/sd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>

#include "gtest/gtest.h"

namespace latentd::server {
namespace {

// Binds a datagram socket at `name` (a path, or '@' + abstract name); returns the fd.
int Listen(const std::string& name) {
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  if (name.size() >= sizeof(addr.sun_path)) ADD_FAILURE() << "socket name too long: " << name;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, name.data(), std::min(name.size(), sizeof(addr.sun_path) - 1));
  if (name[0] == '@') addr.sun_path[0] = '\0';
  const socklen_t len = offsetof(sockaddr_un, sun_path) + name.size() + (name[0] == '@' ? 0 : 1);
  EXPECT_EQ(bind(fd, reinterpret_cast<const sockaddr*>(&addr), len), 0) << std::strerror(errno);
  return fd;
}

std::string Receive(int fd) {
  char buf[256];
  const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
  return n < 0 ? "" : std::string(buf, n);
}

TEST(SdNotifyTest, NoSocketIsANoOp) {
  unsetenv("NOTIFY_SOCKET");
  EXPECT_EQ(NotifySystemd("READY=1"), "");
}

TEST(SdNotifyTest, PathSocket) {
  // TEST_TMPDIR can exceed sun_path's 108 bytes; /tmp cannot.
  const std::string path = "/tmp/latentd-notify-test-" + std::to_string(getpid()) + ".sock";
  unlink(path.c_str());
  const int fd = Listen(path);
  setenv("NOTIFY_SOCKET", path.c_str(), 1);
  EXPECT_EQ(NotifySystemd("READY=1\nSTATUS=serving"), "");
  EXPECT_EQ(Receive(fd), "READY=1\nSTATUS=serving");
  close(fd);
  unlink(path.c_str());
}

TEST(SdNotifyTest, AbstractSocket) {
  const std::string name = "@latentd-notify-test-" + std::to_string(getpid());
  const int fd = Listen(name);
  setenv("NOTIFY_SOCKET", name.c_str(), 1);
  EXPECT_EQ(NotifySystemd("STOPPING=1"), "");
  EXPECT_EQ(Receive(fd), "STOPPING=1");
  close(fd);
}

TEST(SdNotifyTest, BadAddressIsReported) {
  setenv("NOTIFY_SOCKET", "relative/path", 1);
  EXPECT_NE(NotifySystemd("READY=1"), "");
  setenv("NOTIFY_SOCKET", "/nonexistent/dir/sock", 1);
  EXPECT_NE(NotifySystemd("READY=1"), "");
  unsetenv("NOTIFY_SOCKET");
}

}  // namespace
}  // namespace latentd::server
