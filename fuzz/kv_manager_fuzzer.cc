// libFuzzer target: KvCacheManager operation sequences. The input's bytes choose the
// pool shape and then every operation (create, append, reserve, truncate, fork,
// release, touch, idle scan, open/close read); the shadow model shared with
// engine/kv:manager_property_test checks each one. A failed check aborts.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "engine/kv/testing/manager_model.h"
#include "fuzz/input.h"

using latentd::engine::kv::KvCacheConfig;
using latentd::engine::kv::testing::ManagerModel;
using latentd::engine::kv::testing::ModelOptions;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  latentd::fuzz::Input in(data, size);
  // Small pools run out often, which is where the interesting paths are; the byte
  // comparison after failed appends copies the whole pool, so it stays on only while
  // the pool is small.
  KvCacheConfig config;
  config.num_layers = in.Range(1, 3);
  config.num_heads_kv = in.Range(1, 2);
  config.num_pages = in.Range(2, 16);
  ModelOptions options;
  const int flags = in.Range(0, 3);
  options.with_reads = flags & 1;
  options.with_touch = flags & 2;
  options.compare_bytes = config.total_bytes() <= (1 << 20);
  options.verify_all_every = 16;

  ManagerModel model(config, [&in](int lo, int hi) { return in.Range(lo, hi); }, options);
  // Each operation takes at least one byte, so the input bounds the run.
  int ops = 0;
  while (!in.empty() && ops < 4000) {
    ++ops;
    if (!model.Step()) break;
  }
  if (!model.failed()) model.VerifyAll();
  if (!model.failed()) model.ReleaseAll();
  if (model.failed()) {
    std::fprintf(stderr, "kv_manager_fuzzer: op %d: %s\n", ops, model.failure().c_str());
    std::abort();
  }
  return 0;
}
