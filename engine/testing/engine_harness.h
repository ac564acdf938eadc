// Test harness for the engine: a client that keeps a host copy of every row it
// uploads, submits decode steps, collects their results, and checks each result
// against kernels/cpu run on that copy (the oracle). Shared by the CPU engine tests
// and the same scenarios on the CUDA backend. With an fp8 cache the oracle reads the
// copy quantized and dequantized as the engine stores it (kernels/kv_fp8.h).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "engine/engine.h"

namespace latentd::engine::testing {

class Harness : public StepCallback {
 public:
  explicit Harness(Engine* engine, uint64_t seed = 1);
  ~Harness() override;

  const ModelConfig& model() const { return model_; }

  // Creates a sequence and uploads `prefix` random rows to every layer.
  std::string NewSequence(int prefix, const std::string& id = "");
  std::string Fork(const std::string& id);
  // Takes over another harness's record of a sequence's rows under `id` (a sequence
  // imported into this harness's engine from the other's), so steps on it are checked.
  void Adopt(const Harness& from, const std::string& from_id, const std::string& id);

  struct Pending {
    DecodeStep step;
    std::string q, kv;
    std::vector<uint16_t> out;
    std::vector<float> lse;
    std::vector<uint16_t> context;  // the layer's rows the step should attend over, after its own
    int64_t context_len = 0;
    bool done = false;
    absl::Status status;
    int completion_rank = -1;
    std::string completed_on;  // the name of the thread that ran its StepDone
    std::atomic<bool> cancelled{false};
  };

  // Builds a step with random q and new rows; records the expected context (the
  // sequence's shadow rows plus the new ones) and advances the shadow. The caller
  // submits it.
  Pending* MakeStep(const std::string& id, int layer, int s_q, bool causal);
  // Submits; on refusal, rolls the shadow back and returns the status.
  absl::Status Submit(Pending* p);
  // Submits several through Engine::SubmitBatch; returns the first refusal, if any.
  absl::Status SubmitBatch(const std::vector<Pending*>& ps);
  // Forgets that a step's rows were appended (for steps expected to fail in the engine).
  void Rollback(Pending* p);

  bool WaitAll(absl::Duration timeout);
  int completed() const;

  // Checks one completed OK step against the oracle; exact=true wants identical bits.
  ::testing::AssertionResult Check(const Pending& p, bool exact) const;

  void StepDone(DecodeStep* step, absl::Status status) override;

  // While set, StepDone blocks the engine thread (to stall the scheduler in tests).
  void HoldCallbacks(bool hold);

 private:
  struct Shadow {
    std::vector<std::vector<uint16_t>> layers;  // per layer: [len, h_kv, 576]
  };
  std::string RandomRows(int n);

  Engine* engine_;
  ModelConfig model_;
  kernels::KvDType kv_dtype_;
  std::mt19937_64 rng_;
  std::map<std::string, Shadow> shadows_;
  std::vector<std::unique_ptr<Pending>> steps_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  int completed_ ABSL_GUARDED_BY(mu_) = 0;
  int submitted_ ABSL_GUARDED_BY(mu_) = 0;
  bool hold_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace latentd::engine::testing
