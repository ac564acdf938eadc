// JSON parsing for the checkpoint readers (nlohmann-json) with the limits untrusted files
// need: bounded nesting and no duplicate top-level keys.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace latentd::engine::model {

// Parses `text`; `what` names it in errors ("<what>: not valid JSON: ...", "<what>: nests
// deeper than N levels", "<what>: names \"k\" twice"). Printing and destroying a value
// recurse over its nesting, so deeper containers are refused (their contents are never
// stored). A top-level key given twice would silently hide one of its values.
absl::StatusOr<nlohmann::json> ParseJson(absl::string_view text, const std::string& what, int max_depth);

// The value as compact JSON, at most about 60 characters (for error messages).
std::string ShownJson(const nlohmann::json& v);

}  // namespace latentd::engine::model
