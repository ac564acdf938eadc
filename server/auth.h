// Bearer-token authentication for latentd: where the token comes from (file, environment,
// flag), a comparison that reveals neither the token nor its length, failure accounting
// with rate-limited logs, and the server interceptor that guards every service the
// daemon does not implement itself (reflection) and bounds health Watch streams.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_interceptor.h"
#include "grpcpp/support/status.h"
#include "grpcpp/support/string_ref.h"

namespace latentd::server {

// The environment variable that may carry the token (keeps it out of `ps`).
inline constexpr char kAuthTokenEnv[] = "LATENTD_AUTH_TOKEN";

// True when `presented` equals `expected`. Both are reduced to SHA-256 digests which are
// compared without an early exit, so the time taken depends on neither the position of
// the first difference nor on how the lengths relate.
bool TokensEqual(absl::string_view presented, absl::string_view expected);

// Reads a token file: the contents less trailing CR/LF. Fails, naming `flag`, when the
// file cannot be read, is empty, or is readable by group or others (the token would be
// no secret on a shared machine).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path, absl::string_view flag = "--auth_token_file");

// The three places a token may come from. At most one may be given: a second source is
// far more likely a mistake (a stale variable, a leftover flag) than an intended
// override, so the daemon refuses to start rather than silently pick one.
struct TokenSources {
  std::string file_path;           // --auth_token_file (empty: not given)
  std::optional<std::string> env;  // LATENTD_AUTH_TOKEN (nullopt: unset; set but empty is an error)
  std::string flag;                // --auth_token (empty: not given)
};
struct ResolvedToken {
  std::string token;   // empty: authentication off
  std::string source;  // "--auth_token_file", "LATENTD_AUTH_TOKEN", "--auth_token" or ""
};
absl::StatusOr<ResolvedToken> ResolveAuthToken(const TokenSources& sources);

// OK when the metadata carries 'authorization: Bearer <token>', else UNAUTHENTICATED
// with a message that names what is wrong but never echoes what was presented.
grpc::Status CheckBearer(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
                         absl::string_view token);

// Counts one refused call and logs it, at most one line per second (the rest are
// counted and reported with the next line): a client retrying a bad token in a loop
// must not flood the log. `what` is the service or method refused.
void RecordAuthFailure(absl::string_view what, absl::string_view peer, const grpc::Status& status);
// Calls refused for authentication since the start (for stats and metrics).
uint64_t AuthFailures();

// One log line per interval; what did not get a line is counted for the next one.
class LogRateLimiter {
 public:
  explicit LogRateLimiter(absl::Duration interval) : interval_(interval) {}
  // True when a line may be written at `now`; *suppressed is then the number of events
  // that got no line since the previous one.
  bool Allow(absl::Time now, uint64_t* suppressed);

 private:
  const absl::Duration interval_;
  absl::Mutex mu_;
  absl::Time last_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

// Server interceptors for what DecodeService cannot guard itself.
//
// With a token set, every call outside latentd.v1.DecodeService and grpc.health.v1.Health
// (today: reflection, which is gRPC's own sync service) is checked when its initial
// metadata arrives and, lacking the token, cancelled with UNAUTHENTICATED before the
// handler reads anything. An interceptor cannot finish a call itself in gRPC 1.51
// (Hijack is client-only), so the cancel goes through the core call
// (grpc_call_cancel_with_status), which sends the given code and message to the client.
// A unary handler behind the gate would still run (its answer is discarded), which is
// why DecodeService keeps its own check in each handler; it is also left out of the
// interceptor so its streams' messages take no extra hop through interceptor code.
//
// Health stays open for probes; its Watch streams are counted and the ones beyond
// max_health_watchers are cancelled with RESOURCE_EXHAUSTED (each open Watch holds a
// reactor and a slot in gRPC's health service until the client leaves).
struct GateOptions {
  std::string auth_token;  // empty: no authentication
  int max_health_watchers = 64;
};

class GateInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit GateInterceptorFactory(GateOptions options);
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

  // Shared with the interceptors, which may outlive the factory by a little.
  struct State {
    GateOptions options;
    std::atomic<int> health_watchers{0};
  };

 private:
  std::shared_ptr<State> state_;
};

}  // namespace latentd::server
