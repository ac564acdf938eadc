// Where a decode step's round trip goes, for the benchmark tools: the client's send and
// receipt times around the eight server timestamps of StepTiming (DecodeStep.trace),
// collected per step and printed as the median of each phase.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "proto/latentd.pb.h"

namespace latentd::tools {

class RoundTripBreakdown {
 public:
  static constexpr int kPhases = 9;

  // One traced step: sent and received are the client's clock in Unix microseconds
  // (the server's StepTiming is on the same clock on the same host).
  void Add(int64_t sent_us, const v1::StepTiming& t, int64_t received_us) {
    samples_.push_back({{sent_us, t.received_us(), t.parsed_us(), t.submitted_us(), t.batched_us(), t.launched_us(),
                         t.finished_us(), t.completed_us(), t.response_us(), received_us}});
  }
  void Merge(const RoundTripBreakdown& other) {
    samples_.insert(samples_.end(), other.samples_.begin(), other.samples_.end());
  }
  size_t size() const { return samples_.size(); }

  // The median of each phase and their sum; nothing when no step was traced.
  void Print(FILE* out) const {
    static const char* const kNames[kPhases] = {
        "client send -> server read",  "parse + validate",       "wait for stream room",
        "engine queue (batch window)", "stage (append, pack)",   "launch -> results on host",
        "wait for rest of message",    "response build + queue", "server write -> client read"};
    if (samples_.empty()) return;
    std::fprintf(out, "server-side breakdown (median over %zu steps, microseconds):\n", samples_.size());
    double sum = 0;
    for (int p = 0; p < kPhases; ++p) {
      std::vector<double> d;
      d.reserve(samples_.size());
      for (const Sample& s : samples_)
        if (s.t[p] != 0 && s.t[p + 1] != 0) d.push_back(static_cast<double>(s.t[p + 1] - s.t[p]));
      double med = 0;
      if (!d.empty()) {
        std::nth_element(d.begin(), d.begin() + static_cast<std::ptrdiff_t>(d.size() / 2), d.end());
        med = d[d.size() / 2];
      }
      sum += med;
      std::fprintf(out, "  %-32s %9.1f\n", kNames[p], med);
    }
    std::fprintf(out, "  %-32s %9.1f\n", "sum of medians", sum);
  }

 private:
  struct Sample {
    int64_t t[kPhases + 1];  // client send, the eight StepTiming stamps, client receipt
  };
  std::vector<Sample> samples_;
};

}  // namespace latentd::tools
