// The serving tools' result checker: sampled decode results are compared against the
// client-side CPU reference on a thread of its own, so that a check (milliseconds of CPU
// attention) never delays reading the next result, nor the latency measured for it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "clients/cpp/reference.h"
#include "proto/latentd.pb.h"

namespace latentd::tools {

class ResultChecker {
 public:
  // One sampled result.
  struct Item {
    std::string sequence_id;
    int layer = 0;
    int64_t end = 0;      // the layer's length after the step (its own rows included)
    absl::string_view q;  // the step's q bytes; the tools' input pools outlive the checker
    v1::StepResult result;
  };

  // What a check does: the tools check against the reference (AgainstReference); a test
  // may stand in its own.
  struct Checks {
    // OK when the item's result is right; the error says where it differs.
    std::function<absl::Status(const Item&)> check;
    // What would explain a wrong result, or "" (run only for the mismatches described:
    // it costs far more than the check). May be empty.
    std::function<std::string(const Item&, const absl::Status&)> explain;
  };
  // Reference::Check; a result off by more than the tolerance (DATA_LOSS) is explained
  // by Reference::Diagnose.
  static Checks AgainstReference(client::Reference* ref, int s_q, bool causal);

  struct Options {
    // Items pushed while this many wait are dropped and counted in skipped(), so a
    // checker far behind costs no memory (0: no bound).
    size_t max_queue = 0;
    // Mismatches described in failures(), the first ones.
    int max_described = 1;
  };

  ResultChecker(Checks checks, Options options);
  // Runs what is still queued, then stops its thread.
  ~ResultChecker();
  ResultChecker(const ResultChecker&) = delete;
  ResultChecker& operator=(const ResultChecker&) = delete;

  // Queues a check; false when the queue is full and the item was dropped.
  bool Push(Item item);
  // Returns once every item pushed before has been checked.
  void Flush();

  uint64_t checked() const { return checked_.load(); }
  uint64_t mismatched() const { return mismatched_.load(); }
  uint64_t skipped() const { return skipped_.load(); }
  // The first max_described mismatches, "<sequence> layer <l> length <end>: <error>",
  // each followed by its explanation on an indented line, joined by "\n  " ("" if none).
  std::string failures() const;

 private:
  void Loop();

  const Checks checks_;
  const Options options_;
  std::atomic<uint64_t> checked_{0}, mismatched_{0}, skipped_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;  // under mu_
  std::string failures_;    // under mu_
  bool busy_ = false;       // under mu_: the thread is checking an item taken off the queue
  bool stop_ = false;       // under mu_
  std::thread thread_;      // last: started once the rest is built
};

}  // namespace latentd::tools
