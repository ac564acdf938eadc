// gRPC statuses the service's reactors answer with: engine and validation errors
// carried over with their code, and the drain's UNAVAILABLE. Private to //server:service.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace latentd::server {

inline grpc::Status Unavailable() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "server is shutting down; retry on another replica");
}

// Wraps an engine/validation error with the RPC's context.
inline grpc::Status Prefixed(const absl::Status& s, absl::string_view prefix) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), absl::StrCat(prefix, s.message()));
}

}  // namespace latentd::server
