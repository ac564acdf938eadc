// Integration-test harness: see daemon.h.
#include "tests/integration/daemon.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

extern char** environ;

namespace latentd::testing {

std::string RunfilePath(const std::string& workspace_relative) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr) return workspace_relative;
  return absl::StrCat(srcdir, "/", workspace != nullptr ? workspace : "latentd", "/", workspace_relative);
}

std::string TempDir(const std::string& name) {
  static std::atomic<int> counter{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name, "-", getpid(), "-", counter++);
  mkdir(dir.c_str(), 0700);
  return dir;
}

pid_t Spawn(const std::string& binary, const std::vector<std::string>& args, const std::string& log_path) {
  std::vector<std::string> argv_s = {binary};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  // The child starts with default signal handling whatever this process blocks.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  // Every daemon of the integration tests starts on a poisoned KV pool (NaN in every row
  // nobody wrote, docs/testing.md), unless the environment says otherwise: a result
  // read from a stale row then fails the test's check instead of passing by luck.
  std::vector<char*> env;
  bool poison_set = false;
  for (char** e = environ; *e != nullptr; ++e) {
    env.push_back(*e);
    poison_set = poison_set || std::strncmp(*e, "LATENTD_KV_POISON=", 18) == 0;
  }
  static char kPoison[] = "LATENTD_KV_POISON=1";
  if (!poison_set) env.push_back(kPoison);
  env.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, binary.c_str(), &actions, &attr, argv.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  return rc == 0 ? pid : -1;
}

Daemon::Daemon(std::vector<std::string> flags) : flags_(std::move(flags)), dir_(TempDir("latentd")) {}

Daemon::~Daemon() {
  if (pid_ > 0 && !exited_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  // Under --config=asan/tsan the daemon is instrumented too; a report it printed must
  // fail the test even when the client side happened not to notice anything.
  if (pid_ > 0) {
    const std::string log = Log();
    for (const char* marker : {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                               "WARNING: ThreadSanitizer", "runtime error:"}) {
      if (absl::StrContains(log, marker)) {
        ADD_FAILURE() << "the daemon reported \"" << marker << "\":\n" << log;
        break;
      }
    }
  }
}

bool Daemon::Start(absl::Duration timeout) {
  const std::string port_file = dir_ + "/port";
  std::vector<std::string> args = {"--backend=cpu", "--listen=127.0.0.1:0", "--port_file=" + port_file,
                                   "--cpu_threads=2"};
  args.insert(args.end(), flags_.begin(), flags_.end());
  // LATENTD_DAEMON_FLAGS (space-separated) come last and win, e.g. --backend=cuda to run
  // the same tests on a GPU host.
  if (const char* extra = std::getenv("LATENTD_DAEMON_FLAGS"); extra != nullptr) {
    for (absl::string_view f : absl::StrSplit(extra, ' ', absl::SkipEmpty())) args.emplace_back(f);
  }
  // LATENTD_DAEMON runs the same tests against another build of the daemon (for
  // example an older one, to show that a test fails there).
  const char* other = std::getenv("LATENTD_DAEMON");
  pid_ = Spawn(other != nullptr && *other != '\0' ? std::string(other) : RunfilePath("server/latentd"), args,
               dir_ + "/latentd.log");
  if (pid_ <= 0) return false;
  const absl::Time deadline = absl::Now() + HangGuard(timeout);
  while (absl::Now() < deadline) {
    std::ifstream f(port_file);
    if (f >> port_ && port_ > 0) return true;
    if (!Running()) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

absl::StatusOr<std::unique_ptr<client::Client>> Daemon::Connect(client::ClientOptions options) const {
  options.target = target();
  return client::Client::Connect(options);
}

void Daemon::Signal(int sig) const {
  if (pid_ > 0) kill(pid_, sig);
}

bool Daemon::Running() {
  if (pid_ <= 0 || exited_) return false;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    exited_ = true;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return false;
  }
  return true;
}

int Daemon::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + HangGuard(timeout);
  while (Running()) {
    if (absl::Now() > deadline) return -1;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return exit_code_;
}

std::string Daemon::Log() const {
  std::ifstream f(dir_ + "/latentd.log");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace latentd::testing
