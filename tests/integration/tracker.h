// Test helper: makes sequences and decode steps with random data through one client and
// remembers what each step should return (via client::Reference), so a test can check
// any StepResult by its request_id.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "clients/cpp/client.h"
#include "clients/cpp/reference.h"

namespace latentd::testing {

class Tracker {
 public:
  explicit Tracker(client::Client* client, uint64_t seed = 1);

  // CreateSequence (server-chosen id when empty) plus random prefixes per layer.
  absl::StatusOr<std::string> NewSequence(const std::vector<int>& prefix_per_layer, const std::string& id = "");
  absl::StatusOr<std::string> Fork(const std::string& sequence_id, const std::string& new_id = "");

  // A valid step with random q and kv; the reference assumes the server appends it.
  v1::DecodeStep Step(const std::string& sequence_id, int layer, int s_q = 1, bool causal = false);
  // Rows the test uploaded itself (outside NewSequence).
  void Appended(const std::string& sequence_id, int layer, const std::string& rows);
  // The server refused the step: forget its rows (it must be the last on its layer).
  void Refused(uint64_t request_id);
  // Checks a result against the CPU implementation (error if not OK or different).
  absl::Status Check(const v1::StepResult& result);

  client::Client* client() { return client_; }
  client::Reference& reference() { return ref_; }
  std::string RandomRows(int64_t rows);

 private:
  struct Expect {
    std::string seq;
    int layer = 0, s_q = 1;
    bool causal = false;
    int64_t end = 0;
    std::string q;
  };
  client::Client* client_;
  client::Reference ref_;
  kernels::DType dtype_;
  std::mutex mu_;
  std::mt19937_64 rng_;
  uint64_t next_id_ = 1;
  std::map<std::pair<std::string, int>, int64_t> length_;
  std::map<uint64_t, Expect> expect_;
};

}  // namespace latentd::testing
