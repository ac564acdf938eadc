// Consistent hashing shared with the Python client; see hash_ring.h.
#include "clients/cpp/hash_ring.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace latentd::client {

uint64_t Fnv1a64(absl::string_view data) {
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a 64-bit offset basis
  for (unsigned char c : data) {
    h ^= c;
    h *= 0x100000001b3ULL;  // FNV 64-bit prime
  }
  return h;
}

uint64_t Fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

std::string SaltedRoute(absl::string_view sequence_id, int k) {
  if (k == 0) return std::string(sequence_id);
  return absl::StrCat(sequence_id, "#", absl::Hex(RouteHash(absl::StrCat(sequence_id, "#", k)), absl::kZeroPad16));
}

HashRing::HashRing(std::vector<std::string> targets, int virtual_nodes) : targets_(std::move(targets)) {
  virtual_nodes = std::max(virtual_nodes, 1);
  points_.reserve(targets_.size() * virtual_nodes);
  for (int t = 0; t < size(); ++t) {
    for (int v = 0; v < virtual_nodes; ++v) {
      points_.push_back({RouteHash(absl::StrCat(targets_[t], "#", v)), t});
    }
  }
  // Ties (two points with one hash) are ordered by the target string, not by the
  // position in the list, so that the order of the list does not matter.
  std::sort(points_.begin(), points_.end(), [this](const Point& a, const Point& b) {
    if (a.hash != b.hash) return a.hash < b.hash;
    return targets_[a.target] < targets_[b.target];
  });
}

size_t HashRing::FirstPoint(uint64_t hash) const {
  auto it = std::lower_bound(points_.begin(), points_.end(), hash,
                             [](const Point& p, uint64_t h) { return p.hash < h; });
  return it == points_.end() ? 0 : static_cast<size_t>(it - points_.begin());
}

int HashRing::Owner(absl::string_view key) const {
  if (points_.empty()) return -1;
  return points_[FirstPoint(RouteHash(key))].target;
}

std::vector<int> HashRing::Preference(absl::string_view key) const {
  std::vector<int> order;
  if (points_.empty()) return order;
  std::vector<bool> seen(targets_.size(), false);
  const size_t start = FirstPoint(RouteHash(key));
  for (size_t i = 0; i < points_.size() && order.size() < targets_.size(); ++i) {
    const int t = points_[(start + i) % points_.size()].target;
    if (!seen[t]) {
      seen[t] = true;
      order.push_back(t);
    }
  }
  return order;
}

}  // namespace latentd::client
