// Integration-test harness: starts the real latentd binary (CPU backend) on a free
// loopback port as a child process, connects the C++ client, and sends signals.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "clients/cpp/client.h"

namespace latentd::testing {

// Path of a binary in this test's runfiles, e.g. "server/latentd".
std::string RunfilePath(const std::string& workspace_relative);
// A fresh directory under TEST_TMPDIR.
std::string TempDir(const std::string& name);

// How much longer a wait that only guards against a hang (a daemon that never comes up
// or never exits) allows in this build: 1, or more under ASan/TSan, where the daemon
// starts and runs several times slower. Such waits return as soon as their condition
// holds, so a longer guard costs nothing when all is well; it only keeps a slow or
// loaded machine from failing a test that would have passed.
#if defined(__SANITIZE_THREAD__)
inline constexpr int kSanitizerSlowdown = 10;  // TSan: 5-15x slower (docs/testing.md), more under load
#elif defined(__SANITIZE_ADDRESS__)
inline constexpr int kSanitizerSlowdown = 4;
#else
inline constexpr int kSanitizerSlowdown = 1;
#endif
inline absl::Duration HangGuard(absl::Duration d) { return d * kSanitizerSlowdown; }

// Starts a child process with stdout and stderr to log_path. Returns its pid or -1.
pid_t Spawn(const std::string& binary, const std::vector<std::string>& args, const std::string& log_path);

class Daemon {
 public:
  // Flags are added to --backend=cpu --listen=127.0.0.1:0 --port_file=... .
  explicit Daemon(std::vector<std::string> flags = {});
  ~Daemon();  // SIGKILLs the daemon if it still runs

  // Spawns the daemon and waits until its port file appears, which the daemon writes
  // once it serves (false if it exits first or the wait passes HangGuard(timeout); see
  // Log).
  bool Start(absl::Duration timeout = absl::Seconds(60));
  int port() const { return port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }

  // A connected client (ServerInfo fetched) with the given options; target is filled in.
  absl::StatusOr<std::unique_ptr<client::Client>> Connect(client::ClientOptions options = {}) const;

  void Signal(int sig) const;
  // Waits for exit: the exit status (WEXITSTATUS), 128 + signal if killed, -1 once
  // HangGuard(timeout) has passed.
  int Wait(absl::Duration timeout);
  bool Running();
  std::string Log() const;

 private:
  std::vector<std::string> flags_;
  std::string dir_;
  pid_t pid_ = -1;
  int port_ = 0;
  bool exited_ = false;
  int exit_code_ = -1;
};

}  // namespace latentd::testing
