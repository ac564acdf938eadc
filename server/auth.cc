// Bearer-token authentication: token sources, digest comparison, failure accounting and
// the gate interceptor (see auth.h for what each guards and why).
#include "server/auth.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "grpc/grpc.h"
#include "grpcpp/server_context.h"
#include "spdlog/spdlog.h"

namespace latentd::server {
namespace {

constexpr absl::string_view kHealthPrefix = "/grpc.health.v1.Health/";
constexpr absl::string_view kHealthWatch = "/grpc.health.v1.Health/Watch";
constexpr absl::string_view kDecodeServicePrefix = "/latentd.v1.DecodeService/";

// A token must travel as an HTTP/2 header value after "Bearer ": visible ASCII, no
// spaces. Anything else could never match, so it is refused at start-up instead.
absl::Status ValidateToken(absl::string_view token, absl::string_view source) {
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(source, ": the token is empty"));
  for (char c : token) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": the token may hold only visible ASCII characters (no spaces or control characters)"));
    }
  }
  return absl::OkStatus();
}

std::atomic<uint64_t> g_auth_failures{0};

LogRateLimiter& AuthLogLimiter() {
  static LogRateLimiter* limiter = new LogRateLimiter(absl::Seconds(1));
  return *limiter;
}

// Ends the call now with `status`; the handler that still runs finds its reads failing.
void CancelWith(grpc::ServerContextBase* ctx, const grpc::Status& status) {
  grpc_call* call = ctx->c_call();
  if (call == nullptr) {
    ctx->TryCancel();  // no core call to carry the code: the client sees CANCELLED
    return;
  }
  grpc_call_cancel_with_status(call, static_cast<grpc_status_code>(status.error_code()),
                               status.error_message().c_str(), nullptr);
}

class AuthInterceptor final : public grpc::experimental::Interceptor {
 public:
  AuthInterceptor(grpc::experimental::ServerRpcInfo* info, std::shared_ptr<GateInterceptorFactory::State> state)
      : info_(info), state_(std::move(state)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      const auto* md = methods->GetRecvInitialMetadata();
      static const std::multimap<grpc::string_ref, grpc::string_ref> kEmpty;
      grpc::Status st = CheckBearer(md != nullptr ? *md : kEmpty, state_->options.auth_token);
      if (!st.ok()) {
        grpc::ServerContextBase* ctx = info_->server_context();
        RecordAuthFailure(info_->method(), ctx->peer(), st);
        CancelWith(ctx, st);
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  const std::shared_ptr<GateInterceptorFactory::State> state_;
};

class HealthWatchLimit final : public grpc::experimental::Interceptor {
 public:
  HealthWatchLimit(grpc::experimental::ServerRpcInfo* info, std::shared_ptr<GateInterceptorFactory::State> state)
      : info_(info), state_(std::move(state)) {}
  // The interceptor lives as long as the call's context, so the slot is held until the
  // Watch stream is over, however it ends.
  ~HealthWatchLimit() override {
    if (holding_) state_->health_watchers.fetch_sub(1, std::memory_order_acq_rel);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      const int max = state_->options.max_health_watchers;
      if (state_->health_watchers.fetch_add(1, std::memory_order_acq_rel) < max) {
        holding_ = true;
      } else {
        state_->health_watchers.fetch_sub(1, std::memory_order_acq_rel);
        CancelWith(info_->server_context(),
                   grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                absl::StrCat("health Watch: ", max,
                                             " streams already open (--max_health_watchers); poll Check instead")));
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  const std::shared_ptr<GateInterceptorFactory::State> state_;
  bool holding_ = false;
};

}  // namespace

bool TokensEqual(absl::string_view presented, absl::string_view expected) {
  unsigned char a[SHA256_DIGEST_LENGTH], b[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(presented.data()), presented.size(), a);
  SHA256(reinterpret_cast<const unsigned char*>(expected.data()), expected.size(), b);
  // Equal digests of unequal strings would need a SHA-256 collision.
  return CRYPTO_memcmp(a, b, sizeof(a)) == 0;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, absl::string_view flag) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path, ": ", std::strerror(errno)));
  }
  // Checked on the open descriptor, so the file read is the file checked.
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is not a regular file"));
  }
  if ((st.st_mode & (S_IRGRP | S_IROTH)) != 0) {
    close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        flag, ": ", path, " is readable by group or others (mode ",
        absl::StrFormat("%03o", st.st_mode & 0777), "); chmod 600 it"));
  }
  std::string data;
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path, ": ", std::strerror(err)));
    }
    if (n == 0) break;
    data.append(buf, static_cast<size_t>(n));
    if (data.size() > 64 * 1024) {
      close(fd);
      return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is over 64 KiB; expected a token"));
    }
  }
  close(fd);
  while (!data.empty() && (data.back() == '\n' || data.back() == '\r')) data.pop_back();
  if (data.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is empty"));
  if (absl::Status s = ValidateToken(data, flag); !s.ok()) return s;
  return data;
}

absl::StatusOr<ResolvedToken> ResolveAuthToken(const TokenSources& sources) {
  const bool from_file = !sources.file_path.empty();
  const bool from_env = sources.env.has_value();
  const bool from_flag = !sources.flag.empty();
  if (int(from_file) + int(from_env) + int(from_flag) > 1) {
    std::string given;
    if (from_file) absl::StrAppend(&given, "--auth_token_file ");
    if (from_env) absl::StrAppend(&given, kAuthTokenEnv, " ");
    if (from_flag) absl::StrAppend(&given, "--auth_token ");
    given.pop_back();
    return absl::InvalidArgumentError(absl::StrCat(
        "auth token given more than once (", given, "); give exactly one of --auth_token_file, ", kAuthTokenEnv,
        " or --auth_token"));
  }
  ResolvedToken r;
  if (from_file) {
    auto token = ReadTokenFile(sources.file_path);
    if (!token.ok()) return token.status();
    r.token = *std::move(token);
    r.source = "--auth_token_file";
  } else if (from_env) {
    if (absl::Status s = ValidateToken(*sources.env, kAuthTokenEnv); !s.ok()) return s;
    r.token = *sources.env;
    r.source = kAuthTokenEnv;
  } else if (from_flag) {
    if (absl::Status s = ValidateToken(sources.flag, "--auth_token"); !s.ok()) return s;
    r.token = sources.flag;
    r.source = "--auth_token";
  }
  return r;
}

grpc::Status CheckBearer(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                         absl::string_view token) {
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "metadata authorization: missing; expected 'Bearer <token>'");
  }
  const absl::string_view value(it->second.data(), it->second.size());
  constexpr absl::string_view kPrefix = "Bearer ";
  // The prefix is public; only the token part needs the constant-time comparison.
  if (!absl::StartsWith(value, kPrefix) || !TokensEqual(value.substr(kPrefix.size()), token)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "metadata authorization: wrong token; expected 'Bearer <token>' with the server's token");
  }
  return grpc::Status::OK;
}

bool LogRateLimiter::Allow(absl::Time now, uint64_t* suppressed) {
  absl::MutexLock lock(&mu_);
  if (now - last_ < interval_) {
    ++suppressed_;
    return false;
  }
  last_ = now;
  *suppressed = suppressed_;
  suppressed_ = 0;
  return true;
}

void RecordAuthFailure(absl::string_view what, absl::string_view peer, const grpc::Status& status) {
  g_auth_failures.fetch_add(1, std::memory_order_relaxed);
  uint64_t suppressed = 0;
  if (!AuthLogLimiter().Allow(absl::Now(), &suppressed)) return;
  // The message says missing or wrong; what the client presented is never logged.
  spdlog::warn("auth: refused {} from {}: {} ({} more refused since the previous line; {} in total)", std::string(what), std::string(peer),
               status.error_message(), suppressed, g_auth_failures.load(std::memory_order_relaxed));
}

uint64_t AuthFailures() { return g_auth_failures.load(std::memory_order_relaxed); }

GateInterceptorFactory::GateInterceptorFactory(GateOptions options) : state_(std::make_shared<State>()) {
  state_->options = std::move(options);
}

grpc::experimental::Interceptor* GateInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  const absl::string_view method = info->method() != nullptr ? info->method() : "";
  if (absl::StartsWith(method, kHealthPrefix)) {
    return method == kHealthWatch ? new HealthWatchLimit(info, state_) : nullptr;
  }
  // DecodeService checks the token in each handler (see auth.h); no interceptor keeps
  // its streams' per-message path as it was.
  if (state_->options.auth_token.empty() || absl::StartsWith(method, kDecodeServicePrefix)) return nullptr;
  return new AuthInterceptor(info, state_);
}

}  // namespace latentd::server
