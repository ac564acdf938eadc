// The daemon's version, reported in ServerInfo.version and the start-up line.
#pragma once

namespace latentd::server {
inline constexpr char kVersion[] = "0.1.0";
}  // namespace latentd::server
