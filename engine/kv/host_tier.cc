// The host tier's arena and bookkeeping (host_tier.h).
#include "engine/kv/host_tier.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/params.h"

namespace latentd::engine::kv {

absl::StatusOr<std::unique_ptr<HostTier>> HostTier::Create(int64_t capacity_bytes, int64_t row_bytes) {
  if (row_bytes <= 0) return absl::InvalidArgumentError("host tier: row_bytes must be positive");
  const int64_t block_bytes = row_bytes * kernels::kPageSize;
  const int64_t blocks = capacity_bytes > 0 ? capacity_bytes / block_bytes : 0;
  if (blocks > INT32_MAX)
    return absl::InvalidArgumentError(absl::StrCat("host_kv_bytes: expected at most ", INT32_MAX * block_bytes,
                                                   " bytes, got ", capacity_bytes));
  char* arena = nullptr;
  if (blocks > 0) {
    // Page-aligned, so cudaHostRegister pins exactly the arena.
    const size_t bytes = static_cast<size_t>(blocks * block_bytes);
    void* p = nullptr;
    if (posix_memalign(&p, 4096, bytes) != 0 || p == nullptr)
      return absl::ResourceExhaustedError(absl::StrCat("host_kv_bytes: cannot allocate ", bytes, " bytes"));
    // Touched now: the tier is committed up front rather than failing on first offload.
    std::memset(p, 0, bytes);
    arena = static_cast<char*>(p);
  }
  return std::unique_ptr<HostTier>(new HostTier(arena, static_cast<int32_t>(blocks), block_bytes));
}

HostTier::HostTier(char* arena, int32_t num_blocks, int64_t block_bytes)
    : arena_(arena), num_blocks_(num_blocks), block_bytes_(block_bytes) {
  free_.reserve(num_blocks);
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

HostTier::~HostTier() { std::free(arena_); }

int64_t HostTier::BlocksFor(const std::vector<int64_t>& lengths) {
  int64_t n = 0;
  for (int64_t len : lengths) n += PagesForTokens(len);
  return n;
}

std::unique_ptr<HostTier::Entry> HostTier::Reserve(const std::vector<int64_t>& lengths) {
  if (BlocksFor(lengths) > free_blocks()) {
    ++refused_;
    return nullptr;
  }
  auto e = std::make_unique<Entry>();
  e->lengths = lengths;
  e->blocks.resize(lengths.size());
  for (size_t l = 0; l < lengths.size(); ++l) {
    const int64_t pages = PagesForTokens(lengths[l]);
    e->blocks[l].reserve(pages);
    for (int64_t p = 0; p < pages; ++p) {
      e->blocks[l].push_back(free_.back());
      free_.pop_back();
    }
  }
  return e;
}

void HostTier::Free(Entry& e) {
  for (auto& layer : e.blocks)
    for (int32_t b : layer) free_.push_back(b);
  e.blocks.clear();
}

void HostTier::Cancel(std::unique_ptr<Entry> entry) {
  if (entry != nullptr) Free(*entry);
}

void HostTier::Commit(std::unique_ptr<Entry> entry) {
  ++offloads_;
  std::string id = entry->id;
  entries_[id] = std::move(entry);
}

HostTier::Entry* HostTier::Find(absl::string_view id) {
  auto it = entries_.find(id);
  return it == entries_.end() ? nullptr : it->second.get();
}
const HostTier::Entry* HostTier::Find(absl::string_view id) const {
  auto it = entries_.find(id);
  return it == entries_.end() ? nullptr : it->second.get();
}

void HostTier::Remove(absl::string_view id, bool restored) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Free(*it->second);
  entries_.erase(it);
  if (restored) ++restores_;
}

std::vector<std::string> HostTier::IdleIds(absl::Time cutoff) const {
  std::vector<std::string> ids;
  for (const auto& [id, e] : entries_)
    if (!e->busy && e->last_used < cutoff) ids.push_back(id);
  return ids;
}

HostTier::Stats HostTier::GetStats() const {
  Stats s;
  s.capacity_bytes = arena_bytes();
  s.used_bytes = (int64_t(num_blocks_) - free_blocks()) * block_bytes_;
  s.sequences = static_cast<int64_t>(entries_.size());
  s.offloads = offloads_;
  s.restores = restores_;
  s.refused = refused_;
  return s;
}

}  // namespace latentd::engine::kv
