// Consistent hashing of sequences onto daemons, identical in the C++ and Python clients
// (clients/python/src/latentd_client/sharded.py), so that every client process places a
// sequence on the same daemon. Written out rather than taken from a library: std::hash
// and absl::Hash are not stable across processes or builds.
//
//   RouteHash(s) = fmix64(fnv1a64(bytes of s))   (fmix64: MurmurHash3's 64-bit finalizer,
//                                                 which spreads FNV's weak low bits)
//   ring point   = RouteHash("<target>#<v>") for v in [0, virtual_nodes), every target
//   owner(key)   = the target of the first point >= RouteHash(key), wrapping around;
//                  points sorted by (hash, target), so ties resolve the same everywhere
//
// Targets are identified by their strings ("10.0.0.5:50051"): clients that list the same
// strings, in any order, agree; removing one target moves only the keys it owned.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace latentd::client {

uint64_t Fnv1a64(absl::string_view data);
uint64_t Fmix64(uint64_t k);
inline uint64_t RouteHash(absl::string_view key) { return Fmix64(Fnv1a64(key)); }

// The route key of the k-th attempt to place a sequence through a hashing proxy while
// the daemons tried are down: the id itself for k = 0, else
// "<id>#<16 hex digits of RouteHash("<id>#<k>")>". Well mixed on purpose: nginx hashes
// keys with CRC32, under which ids with a short counter appended land in a few clusters
// of its ring, often all on one daemon.
std::string SaltedRoute(absl::string_view sequence_id, int k);

class HashRing {
 public:
  static constexpr int kDefaultVirtualNodes = 160;

  explicit HashRing(std::vector<std::string> targets, int virtual_nodes = kDefaultVirtualNodes);

  int size() const { return static_cast<int>(targets_.size()); }
  const std::string& target(int i) const { return targets_[i]; }
  const std::vector<std::string>& targets() const { return targets_; }

  // Index (into the constructor's list) of the target owning key; -1 when empty.
  int Owner(absl::string_view key) const;
  // Every target once, in the order met walking the ring clockwise from key: the owner
  // first, then where the key would go if the ones before it were unavailable.
  std::vector<int> Preference(absl::string_view key) const;

 private:
  struct Point {
    uint64_t hash;
    int target;
  };
  size_t FirstPoint(uint64_t hash) const;
  std::vector<std::string> targets_;
  std::vector<Point> points_;
};

}  // namespace latentd::client
