// Hands a stream's memory file to that stream's own client: the Decode response that
// opens a region carries a one-time ticket, and the client collects the file descriptor
// over a Unix socket (SCM_RIGHTS) by sending it. No path to the file exists, so no other
// process can open the region without the ticket, which only the stream's client saw.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace latentd::server::dataplane {

class FdHandoff {
 public:
  // Listens on `name` (proto/handoff.h): a filesystem path (made mode 0600, removed when destroyed), or,
  // starting with '@', a name in the abstract socket namespace. Serves claims on a
  // thread of its own until destroyed.
  static absl::StatusOr<std::unique_ptr<FdHandoff>> Listen(const std::string& name);
  ~FdHandoff();
  FdHandoff(const FdHandoff&) = delete;
  FdHandoff& operator=(const FdHandoff&) = delete;

  // Keeps a copy of `fd` for whoever first sends the returned ticket (handoff::kTicketBytes
  // random bytes); the copy is
  // closed once sent (or withdrawn), so the caller may close its own at once.
  absl::StatusOr<std::string> Offer(int fd);
  // Closes an unclaimed offer's copy (its stream ended first). No-op once claimed.
  void Withdraw(const std::string& ticket);
  const std::string& name() const { return name_; }
  // Offers not yet claimed (for tests).
  size_t pending() const;

 private:
  FdHandoff(std::string name, int listen_fd, int stop_fd);
  void Serve();
  void Answer(int conn);

  const std::string name_;
  const int listen_fd_;
  const int stop_fd_;  // an eventfd: written once to stop Serve
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, int> offers_ ABSL_GUARDED_BY(mu_);  // ticket -> fd copy
  std::thread thread_;
};

}  // namespace latentd::server::dataplane
