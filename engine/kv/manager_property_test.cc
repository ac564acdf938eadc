// Thousands of random create / append / reserve / truncate / fork / release operations
// on a small pool, checked against a shadow model after every one: bookkeeping stays
// consistent, no page leaks or is freed twice, out-of-pages failures happen exactly when
// the pages needed exceed the free ones and change nothing, every row reads back as
// written, through forks and copy-on-write, and (with reads open) no page freed under
// an open read is handed out before that read closes. The model and its checks live in
// testing/manager_model (the kv fuzzer drives the same ones).
#include <cstdio>
#include <random>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "engine/kv/testing/manager_model.h"

namespace latentd::engine::kv {
namespace {

using testing::ManagerModel;
using testing::ModelCounts;
using testing::ModelOptions;

// Runs `ops` seeded operations, then releases everything; returns what was exercised.
ModelCounts RunSeeded(const KvCacheConfig& config, uint64_t seed, int ops,
                      ModelOptions options = {}) {
  std::mt19937_64 rng(seed);
  ManagerModel model(
      config, [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); },
      options);
  for (int op = 0; op < ops; ++op) {
    if (!model.Step()) {
      ADD_FAILURE() << "op " << op << ": " << model.failure();
      return model.counts();
    }
  }
  EXPECT_TRUE(model.VerifyAll()) << model.failure();
  const ModelCounts counts = model.counts();
  std::printf("%d ops: %lld forks, %lld copy-on-write pages, %lld out-of-pages, high water %lld/%lld\n",
              ops, static_cast<long long>(counts.forks), static_cast<long long>(counts.cow_copies),
              static_cast<long long>(counts.out_of_pages),
              static_cast<long long>(counts.high_water_pages),
              static_cast<long long>(config.num_pages));
  EXPECT_TRUE(model.ReleaseAll()) << model.failure();
  return counts;
}

// Each path was reached: the pool was exercised, ran out, and copied on write.
void ExpectExercised(const KvCacheConfig& config, const ModelCounts& c, bool with_reads) {
  EXPECT_GT(c.high_water_pages, config.num_pages / 2);
  EXPECT_GT(c.out_of_pages, 0);
  EXPECT_GT(c.cow_copies, 0);
  EXPECT_GT(c.forks, 0);
  EXPECT_GT(c.keyed_creates, 0);
  EXPECT_GT(c.prefix_hit_pages, 0);  // some prompt pages came from the prefix cache
  if (with_reads) {
    EXPECT_GT(c.reads, 0);
    EXPECT_GT(c.retired, 0);  // some pages were freed under an open read
  }
}

TEST(KvCacheManagerProperty, RandomOperationsMatchTheModel) {
  for (uint64_t seed : {1, 2, 3, 4}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    const KvCacheConfig config{3, 1, 24};
    ExpectExercised(config, RunSeeded(config, seed, 4000), false);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(KvCacheManagerProperty, PagesFreedUnderOpenReadsWaitForThem) {
  for (uint64_t seed : {21, 22}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    const KvCacheConfig config{3, 1, 24};
    ModelOptions options;
    options.with_reads = true;
    ExpectExercised(config, RunSeeded(config, seed, 4000, options), true);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(KvCacheManagerProperty, OneLayerAndTwoHeads) {
  for (uint64_t seed : {11, 12}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    const KvCacheConfig config{1, 2, 12};
    ExpectExercised(config, RunSeeded(config, seed, 3000), false);
    if (::testing::Test::HasFailure()) return;
  }
}

// Idle scans agree with the model's last-use times through touches and forks.
TEST(KvCacheManagerProperty, TouchAndIdleScan) {
  for (uint64_t seed : {31, 32}) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    const KvCacheConfig config{2, 1, 16};
    ModelOptions options;
    options.with_touch = true;
    options.with_reads = true;
    ExpectExercised(config, RunSeeded(config, seed, 2000, options), true);
    if (::testing::Test::HasFailure()) return;
  }
}

}  // namespace
}  // namespace latentd::engine::kv
