// The handoff socket (fd_handoff.h): one thread accepts a connection at a time, reads a
// ticket, and answers with the offered descriptor (one byte 'k' and SCM_RIGHTS) or
// without one (one byte 'n'). A connection that sends nothing is dropped after a second.
#include "server/dataplane/fd_handoff.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "proto/handoff.h"

namespace latentd::server::dataplane {
namespace {

absl::Status Errno(absl::string_view what) { return absl::InternalError(absl::StrCat(what, ": ", strerror(errno))); }

}  // namespace

absl::StatusOr<std::unique_ptr<FdHandoff>> FdHandoff::Listen(const std::string& name) {
  socklen_t len = 0;
  absl::StatusOr<sockaddr_un> addr = handoff::Address(name, &len);
  if (!addr.ok()) return addr.status();
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  if (name[0] != '@') unlink(name.c_str());  // a stale socket of an earlier run
  // The file is the daemon user's alone; the ticket is what admits a client.
  const mode_t old = umask(0177);
  const int bound = bind(fd, reinterpret_cast<const sockaddr*>(&*addr), len);
  umask(old);
  if (bound != 0 || listen(fd, 64) != 0) {
    absl::Status st = Errno(absl::StrCat("data plane socket ", name));
    close(fd);
    return st;
  }
  const int stop = eventfd(0, EFD_CLOEXEC);
  if (stop < 0) {
    close(fd);
    return Errno("eventfd");
  }
  return std::unique_ptr<FdHandoff>(new FdHandoff(name, fd, stop));
}

FdHandoff::FdHandoff(std::string name, int listen_fd, int stop_fd)
    : name_(std::move(name)), listen_fd_(listen_fd), stop_fd_(stop_fd) {
  thread_ = std::thread([this] { Serve(); });
}

FdHandoff::~FdHandoff() {
  const uint64_t one = 1;
  (void)!write(stop_fd_, &one, sizeof(one));
  thread_.join();
  close(listen_fd_);
  close(stop_fd_);
  if (name_[0] != '@') unlink(name_.c_str());
  absl::MutexLock l(&mu_);
  for (auto& [ticket, fd] : offers_) close(fd);
}

absl::StatusOr<std::string> FdHandoff::Offer(int fd) {
  std::string ticket(handoff::kTicketBytes, '\0');
  if (getrandom(&ticket[0], ticket.size(), 0) != static_cast<ssize_t>(ticket.size())) return Errno("getrandom");
  const int copy = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) return Errno("dup");
  absl::MutexLock l(&mu_);
  offers_[ticket] = copy;
  return ticket;
}

void FdHandoff::Withdraw(const std::string& ticket) {
  int fd = -1;
  {
    absl::MutexLock l(&mu_);
    auto it = offers_.find(ticket);
    if (it == offers_.end()) return;
    fd = it->second;
    offers_.erase(it);
  }
  close(fd);
}

size_t FdHandoff::pending() const {
  absl::MutexLock l(&mu_);
  return offers_.size();
}

void FdHandoff::Serve() {
  for (;;) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (p[1].revents != 0) return;
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    Answer(conn);
    close(conn);
  }
}

void FdHandoff::Answer(int conn) {
  const timeval timeout{1, 0};
  setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  std::string ticket(handoff::kTicketBytes, '\0');
  size_t got = 0;
  while (got < handoff::kTicketBytes) {
    const ssize_t r = recv(conn, &ticket[got], handoff::kTicketBytes - got, 0);
    if (r <= 0) return;
    got += static_cast<size_t>(r);
  }
  int fd = -1;
  {
    absl::MutexLock l(&mu_);
    auto it = offers_.find(ticket);
    if (it != offers_.end()) {
      fd = it->second;
      offers_.erase(it);  // one use
    }
  }
  char answer = fd >= 0 ? 'k' : 'n';
  iovec iov{&answer, 1};
  msghdr msg;
  std::memset(&msg, 0, sizeof(msg));
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  (void)sendmsg(conn, &msg, MSG_NOSIGNAL);
  if (fd >= 0) close(fd);  // the client has its own now; the daemon keeps only its mapping
}

}  // namespace latentd::server::dataplane
