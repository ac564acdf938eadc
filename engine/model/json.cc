// ParseJson: nlohmann-json's parser with a callback that enforces the nesting limit and
// catches duplicate top-level keys while the document is read.
#include "engine/model/json.h"

#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace latentd::engine::model {

absl::StatusOr<nlohmann::json> ParseJson(absl::string_view text, const std::string& what, int max_depth) {
  using Json = nlohmann::json;
  std::set<std::string> seen;
  std::string duplicate;
  bool too_deep = false;
  // depth: 0 for the top-level value's start, 1 for its keys and direct children.
  auto on_event = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::key && depth == 1 && duplicate.empty() &&
        !seen.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    if ((event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start) &&
        depth >= max_depth) {
      too_deep = true;
      return false;  // discarded: never stored in the document
    }
    return true;
  };
  Json j;
  try {
    j = Json::parse(text.begin(), text.end(), on_event);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not valid JSON: ", e.what()));
  }
  if (too_deep) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": nests deeper than ", max_depth, " levels"));
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": names ", ShownJson(Json(duplicate)), " twice"));
  }
  return j;
}

std::string ShownJson(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

}  // namespace latentd::engine::model
