// The data plane's descriptor handoff, shared by the daemon and the C++ client: how a
// handoff socket is named, and the client's side of a claim (connect, send the one-time
// ticket from SharedRegion.ticket, receive the memory file's descriptor by SCM_RIGHTS).
// docs/api.md describes it for other languages.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace latentd::handoff {

constexpr size_t kTicketBytes = 16;

// `name` as a socket address: a filesystem path, or (starting with '@') a name in the
// abstract namespace. INVALID_ARGUMENT when empty or too long.
absl::StatusOr<sockaddr_un> Address(const std::string& name, socklen_t* len);

// Collects the descriptor offered under `ticket` from the socket `name`. The daemon
// answers one byte: 'k' with the descriptor, or 'n' without one, which comes back as
// PERMISSION_DENIED (a wrong ticket, or one used before). UNAVAILABLE when the socket
// cannot be reached.
absl::StatusOr<int> CollectFd(const std::string& name, const std::string& ticket);

}  // namespace latentd::handoff
