// Test helper: see tracker.h.
#include "tests/integration/tracker.h"

#include "absl/strings/str_cat.h"

namespace latentd::testing {

Tracker::Tracker(client::Client* client, uint64_t seed)
    : client_(client), ref_(client->info(), 1), dtype_(client::DTypeOf(client->info())), rng_(seed) {}

std::string Tracker::RandomRows(int64_t rows) {
  std::lock_guard<std::mutex> l(mu_);
  return client::RandomHalves(rng_, static_cast<size_t>(rows * client_->shape().kv_row_bytes / 2), dtype_);
}

absl::StatusOr<std::string> Tracker::NewSequence(const std::vector<int>& prefix_per_layer, const std::string& id) {
  auto created = client_->CreateSequence(id);
  if (!created.ok()) return created.status();
  std::vector<std::string> rows;
  for (int n : prefix_per_layer) rows.push_back(RandomRows(n));
  std::vector<absl::string_view> views(rows.begin(), rows.end());
  bool any = false;
  for (int n : prefix_per_layer) any |= n > 0;
  if (any) {
    auto appended = client_->AppendKvLayers(*created, views);
    if (!appended.ok()) return appended.status();
  }
  std::lock_guard<std::mutex> l(mu_);
  for (size_t layer = 0; layer < rows.size(); ++layer) {
    ref_.Append(*created, static_cast<int>(layer), rows[layer]);
    length_[{*created, static_cast<int>(layer)}] = prefix_per_layer[layer];
  }
  return *created;
}

absl::StatusOr<std::string> Tracker::Fork(const std::string& sequence_id, const std::string& new_id) {
  auto forked = client_->ForkSequence(sequence_id, new_id);
  if (!forked.ok()) return forked.status();
  std::lock_guard<std::mutex> l(mu_);
  ref_.Fork(sequence_id, *forked);
  for (int layer = 0; layer < client_->info().num_layers(); ++layer) {
    length_[{*forked, layer}] = length_[{sequence_id, layer}];
  }
  return *forked;
}

v1::DecodeStep Tracker::Step(const std::string& sequence_id, int layer, int s_q, bool causal) {
  const client::Shape& sh = client_->shape();
  std::lock_guard<std::mutex> l(mu_);
  v1::DecodeStep step;
  step.set_request_id(next_id_++);
  step.set_sequence_id(sequence_id);
  step.set_layer(layer);
  step.set_causal(causal);
  step.set_q(client::RandomHalves(rng_, static_cast<size_t>(sh.QBytes(s_q) / 2), dtype_));
  step.set_kv(client::RandomHalves(rng_, static_cast<size_t>(sh.KvBytes(s_q) / 2), dtype_));
  ref_.Append(sequence_id, layer, step.kv());
  Expect e;
  e.seq = sequence_id;
  e.layer = layer;
  e.s_q = s_q;
  e.causal = causal;
  e.end = (length_[{sequence_id, layer}] += s_q);
  e.q = step.q();
  expect_[step.request_id()] = std::move(e);
  return step;
}

void Tracker::Appended(const std::string& sequence_id, int layer, const std::string& rows) {
  std::lock_guard<std::mutex> l(mu_);
  ref_.Append(sequence_id, layer, rows);
  length_[{sequence_id, layer}] += static_cast<int64_t>(rows.size()) / client_->shape().kv_row_bytes;
}

void Tracker::Refused(uint64_t request_id) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = expect_.find(request_id);
  if (it == expect_.end()) return;
  const Expect& e = it->second;
  int64_t& len = length_[{e.seq, e.layer}];
  len -= e.s_q;
  ref_.Truncate(e.seq, e.layer, len);
  expect_.erase(it);
}

absl::Status Tracker::Check(const v1::StepResult& result) {
  Expect e;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = expect_.find(result.request_id());
    if (it == expect_.end()) return absl::NotFoundError(absl::StrCat("no step ", result.request_id()));
    e = it->second;
  }
  absl::Status st = ref_.Check(e.seq, e.layer, e.end, e.q, e.s_q, e.causal, result);
  if (st.ok()) return st;
  return absl::Status(st.code(), absl::StrCat("step ", result.request_id(), " (", e.seq, " layer ", e.layer,
                                              " s_q ", e.s_q, " keys ", e.end, "): ", st.message()));
}

}  // namespace latentd::testing
