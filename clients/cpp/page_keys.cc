// The page-key hash chain (page_keys.h) on OpenSSL's SHA-256.
#include "clients/cpp/page_keys.h"

#include <openssl/sha.h>

namespace latentd::client {
namespace {

constexpr size_t kKeyBytes = 16;

void PutLe64(uint64_t v, unsigned char* out) {
  for (int b = 0; b < 8; ++b) out[b] = static_cast<unsigned char>(v >> (8 * b));
}

}  // namespace

std::vector<std::string> PageKeys(absl::Span<const int64_t> token_ids, absl::string_view salt) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256_CTX ctx;
  SHA256_Init(&ctx);
  static constexpr absl::string_view kDomain = "latentd.page_key.v1";
  SHA256_Update(&ctx, kDomain.data(), kDomain.size());
  unsigned char word[8];
  PutLe64(salt.size(), word);
  SHA256_Update(&ctx, word, sizeof(word));
  SHA256_Update(&ctx, salt.data(), salt.size());
  SHA256_Final(digest, &ctx);

  std::vector<std::string> keys;
  const size_t pages = token_ids.size() / kPageTokens;
  keys.reserve(pages);
  unsigned char page[kPageTokens * 8];
  for (size_t p = 0; p < pages; ++p) {
    for (int t = 0; t < kPageTokens; ++t) PutLe64(static_cast<uint64_t>(token_ids[p * kPageTokens + t]), page + 8 * t);
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, digest, kKeyBytes);  // the previous key (or the salt's)
    SHA256_Update(&ctx, page, sizeof(page));
    SHA256_Final(digest, &ctx);
    keys.emplace_back(reinterpret_cast<const char*>(digest), kKeyBytes);
  }
  return keys;
}

}  // namespace latentd::client
