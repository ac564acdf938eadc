// ResultChecker: one thread takes sampled results off a queue and checks them; see
// result_checker.h.
#include "tools/serving/result_checker.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace latentd::tools {

ResultChecker::Checks ResultChecker::AgainstReference(client::Reference* ref, int s_q, bool causal) {
  Checks c;
  c.check = [ref, s_q, causal](const Item& item) {
    return ref->Check(item.sequence_id, item.layer, item.end, item.q, s_q, causal, item.result);
  };
  c.explain = [ref, s_q, causal](const Item& item, const absl::Status& st) -> std::string {
    if (!absl::IsDataLoss(st)) return "";  // not a wrong result (a failed step, an unknown sequence)
    auto d = ref->Diagnose(item.sequence_id, item.layer, item.end, item.q, s_q, causal, item.result.out());
    return d.ok() ? d->ToString(item.end, s_q) : d.status().ToString();
  };
  return c;
}

ResultChecker::ResultChecker(Checks checks, Options options)
    : checks_(std::move(checks)), options_(options), thread_([this] { Loop(); }) {}

ResultChecker::~ResultChecker() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool ResultChecker::Push(Item item) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (options_.max_queue > 0 && queue_.size() >= options_.max_queue) {
      ++skipped_;
      return false;
    }
    queue_.push_back(std::move(item));
  }
  cv_.notify_all();
  return true;
}

void ResultChecker::Flush() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return queue_.empty() && !busy_; });
}

std::string ResultChecker::failures() const {
  std::lock_guard<std::mutex> l(mu_);
  return failures_;
}

void ResultChecker::Loop() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopped, and nothing left
      item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    // The check and any explanation run outside the lock: pushes never wait on them.
    const absl::Status st = checks_.check(item);
    ++checked_;  // before mismatched_: a reader of both never sees more mismatches than checks
    std::string described;
    if (!st.ok() && ++mismatched_ <= static_cast<uint64_t>(options_.max_described)) {
      described = absl::StrCat(item.sequence_id, " layer ", item.layer, " length ", item.end, ": ", st.ToString());
      if (checks_.explain) {
        if (const std::string why = checks_.explain(item, st); !why.empty()) absl::StrAppend(&described, "\n    ", why);
      }
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!described.empty()) absl::StrAppend(&failures_, failures_.empty() ? "" : "\n  ", described);
      busy_ = false;
    }
    cv_.notify_all();
  }
}

}  // namespace latentd::tools
