// Prefix-cache page keys as clients compute them from token ids (docs/prefix-cache.md):
// a hash chain over each full 64-token page and its predecessors, optionally salted per
// tenant, 16 bytes per page. The Python client's page_keys() computes the same bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace latentd::client {

inline constexpr int kPageTokens = 64;

// One key per full page of `token_ids` (floor(n / 64) of them; a partial last page has
// none). Key i is the first 16 bytes of SHA-256(key i-1 || the page's 64 ids as
// little-endian int64); before key 0 stands SHA-256("latentd.page_key.v1" || the salt's
// length as little-endian uint64 || salt)'s first 16 bytes. Two prefixes share key i
// only when their first 64 (i + 1) tokens and their salts are the same.
std::vector<std::string> PageKeys(absl::Span<const int64_t> token_ids, absl::string_view salt = "");

}  // namespace latentd::client
