// NotifySystemd: the sd_notify protocol (a datagram of newline-separated KEY=value to an
// AF_UNIX socket; a leading '@' in the path means the Linux abstract namespace).
#include "server/sd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace latentd::server {

std::string NotifySystemd(absl::string_view state) {
  const char* path = std::getenv("NOTIFY_SOCKET");
  if (path == nullptr || path[0] == '\0') return "";
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const size_t len = std::strlen(path);
  if ((path[0] != '/' && path[0] != '@') || len >= sizeof(addr.sun_path)) {
    return absl::StrCat("NOTIFY_SOCKET: unusable address '", path, "'");
  }
  std::memcpy(addr.sun_path, path, len);
  if (path[0] == '@') addr.sun_path[0] = '\0';
  // An abstract address is exactly as long as its name; a path one includes the NUL.
  const socklen_t addr_len =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len + (path[0] == '/' ? 1 : 0));
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::StrCat("NOTIFY_SOCKET: socket: ", std::strerror(errno));
  const ssize_t sent =
      sendto(fd, state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<const sockaddr*>(&addr), addr_len);
  const int err = errno;
  close(fd);
  if (sent != static_cast<ssize_t>(state.size())) {
    return absl::StrCat("NOTIFY_SOCKET: sendto ", path, ": ", std::strerror(err));
  }
  return "";
}

}  // namespace latentd::server
