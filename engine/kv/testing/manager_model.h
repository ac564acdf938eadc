// A shadow model of KvCacheManager for randomized checking: create (with and without
// prefix keys) / append / reserve / truncate / fork / release / read operations chosen
// by a ChoiceSource, each checked against the model. Shared by manager_property_test (seeded PRNG) and the kv fuzzer.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "engine/kv/config.h"
#include "engine/kv/manager.h"
#include "engine/kv/storage.h"

namespace latentd::engine::kv::testing {

// Where the operations' choices come from: returns an integer in [lo, hi]. The test
// draws from a seeded PRNG, the fuzzer reads its input.
using ChoiceSource = std::function<int(int lo, int hi)>;

struct ModelOptions {
  // Also open and close reads (KvCacheManager::OpenRead) and check page reuse.
  bool with_reads = false;
  // Check that a failed append leaves the storage bytes untouched (copies the whole pool
  // before each append expected to fail; the fuzzer turns it off for large pools).
  bool compare_bytes = true;
  // How often (in operations) every row of every sequence is read back.
  int verify_all_every = 25;
  // Also Touch sequences and check IdleSequences against the model's last-use times.
  bool with_touch = false;
};

// What a run exercised; the property test asserts that each path was reached.
struct ModelCounts {
  int64_t ops = 0, forks = 0, cow_copies = 0, out_of_pages = 0, reads = 0, retired = 0;
  int64_t keyed_creates = 0, prefix_hit_pages = 0;
  int64_t high_water_pages = 0;
};

class ManagerModel {
 public:
  ManagerModel(const KvCacheConfig& config, ChoiceSource choose, ModelOptions options = {});

  // One random operation followed by the bookkeeping and reuse checks. False once a
  // check has failed (see failure()).
  bool Step();
  // Reads back every row of every sequence.
  bool VerifyAll();
  // Releases every sequence and closes every read, checking that all pages come back.
  bool ReleaseAll();

  bool failed() const { return !failure_.empty(); }
  // The first failed check: file:line, the condition and the operation's context.
  const std::string& failure() const { return failure_; }
  const ModelCounts& counts() const { return counts_; }
  const KvCacheManager& manager() const { return *mgr_; }

  // Collects one failure message; used by the MODEL_CHECK macros in the .cc.
  class FailureStream {
   public:
    FailureStream(ManagerModel* model, const char* file, int line, const char* cond);
    ~FailureStream();
    template <typename T>
    FailureStream& operator<<(const T& v) {
      os_ << v;
      return *this;
    }

   private:
    ManagerModel* model_;
    std::ostringstream os_;
  };

 private:
  using Rows = std::vector<std::vector<uint32_t>>;  // per layer, per token: the row's tag
  struct Snapshot {
    std::vector<int32_t> table;
    std::vector<int64_t> lengths;
    std::vector<int32_t> refs;
    int64_t free_pages;
    std::vector<char> bytes;
  };

  int Uniform(int lo, int hi) { return choose_(lo, hi); }
  std::string PickSequence();
  void Forget(const std::string& id);
  int PickRows();
  int64_t PagesNeeded(const Sequence* seq, int layer, int n);
  // with_bytes: also copy the pool (only the failing appends compare it).
  Snapshot Take(const Sequence* seq, bool with_bytes);
  void ExpectUnchanged(const Sequence* seq, const Snapshot& s);

  void DoStep();
  void Create();
  // A sequence of one of a few prompt families: keys for its first pages, whatever the
  // cache attaches, then the family's rows appended to every layer up to the keyed
  // length (released again if the pool runs out first, as a client would).
  void KeyedCreate();
  void AppendEveryLayerOp();
  void AppendOp();
  void AppendOp(const std::string& id, int layer, int n);
  void ReserveOp();
  void TruncateOp();
  void ForkOp();
  void OpenReadOp();
  void CloseReadOp();
  void TouchOp();
  void ReleaseOp();
  void CountCopies(const Sequence* seq, int layer, int n);
  void CheckBookkeeping();
  void CheckReuse();
  void VerifySequence(const std::string& id);

  const KvCacheConfig config_;
  ChoiceSource choose_;
  const ModelOptions options_;
  std::unique_ptr<KvStorage> storage_;
  std::unique_ptr<KvCacheManager> mgr_;
  std::map<std::string, Rows> model_;
  std::vector<std::string> ids_;
  std::vector<char> row_, expect_;
  uint32_t next_tag_ = 1;
  int next_id_ = 0;
  ModelCounts counts_;
  std::string failure_;
  // Reads: open ones oldest first, the newest closed, and per page the newest read open
  // when it was last freed (0: none).
  std::deque<uint64_t> open_reads_;
  uint64_t closed_upto_ = 0;
  std::vector<int32_t> prev_refs_;
  std::vector<uint64_t> freed_under_;
  // Touch times are whole seconds after base_, later than any creation stamp.
  absl::Time base_;
  std::map<std::string, absl::Time> last_used_;
};

}  // namespace latentd::engine::kv::testing
