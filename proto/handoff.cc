// The client's side of the descriptor handoff (handoff.h).
#include "proto/handoff.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace latentd::handoff {

absl::StatusOr<sockaddr_un> Address(const std::string& name, socklen_t* len) {
  sockaddr_un a;
  std::memset(&a, 0, sizeof(a));
  a.sun_family = AF_UNIX;
  if (name.empty() || name.size() >= sizeof(a.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("data plane socket '", name, "': expected 1 to ", sizeof(a.sun_path) - 1, " characters"));
  }
  std::memcpy(a.sun_path, name.data(), name.size());
  const bool abstract = name[0] == '@';
  if (abstract) a.sun_path[0] = '\0';  // no file: the name lives in the abstract namespace
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size() + (abstract ? 0 : 1));
  return a;
}

absl::StatusOr<int> CollectFd(const std::string& name, const std::string& ticket) {
  socklen_t len = 0;
  absl::StatusOr<sockaddr_un> addr = Address(name, &len);
  if (!addr.ok()) return addr.status();
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return absl::UnavailableError(absl::StrCat("socket: ", strerror(errno)));
  if (connect(s, reinterpret_cast<const sockaddr*>(&*addr), len) != 0 ||
      send(s, ticket.data(), ticket.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(ticket.size())) {
    const int err = errno;
    close(s);
    return absl::UnavailableError(absl::StrCat("data plane socket ", name, ": ", strerror(err)));
  }
  char answer = 0;
  iovec iov{&answer, 1};
  msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t r = recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
  close(s);
  int fd = -1;
  if (r > 0) {
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
    }
  }
  if (r == 1 && answer == 'k' && fd >= 0) return fd;
  if (fd >= 0) close(fd);
  return absl::PermissionDeniedError(
      "data plane socket: no region offered under this ticket (a ticket works once, for the stream it came on)");
}

}  // namespace latentd::handoff
