// Readiness and stopping notices to systemd (Type=notify units): one datagram to the
// socket named by $NOTIFY_SOCKET, written by hand so the daemon needs no libsystemd.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace latentd::server {

// Sends `state` (e.g. "READY=1", "STOPPING=1", "STATUS=...") when $NOTIFY_SOCKET is
// set; a no-op otherwise. Returns an error text, empty on success or when not under
// systemd. Never throws or blocks for long (a datagram to a local socket).
std::string NotifySystemd(absl::string_view state);

}  // namespace latentd::server
