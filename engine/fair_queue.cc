// Fair batch formation over flows (start-time fair queueing by query rows); see
// fair_queue.h.
#include "engine/fair_queue.h"

#include <algorithm>

#include "absl/hash/hash.h"
#include "engine/step_queue.h"

namespace latentd::engine {

FairQueue::Index::Index(int max_entries) {
  size_t cap = 16;
  while (cap < 2 * static_cast<size_t>(std::max(max_entries, 1))) cap <<= 1;
  slots_.resize(cap);
  mask_ = cap - 1;
}

int32_t FairQueue::Index::Find(uint64_t hash, absl::FunctionRef<bool(int32_t)> same) const {
  for (size_t i = hash & mask_; slots_[i].entry >= 0; i = (i + 1) & mask_)
    if (slots_[i].hash == hash && same(slots_[i].entry)) return slots_[i].entry;
  return -1;
}

void FairQueue::Index::Insert(uint64_t hash, int32_t entry) {
  size_t i = hash & mask_;
  while (slots_[i].entry >= 0) i = (i + 1) & mask_;
  slots_[i] = Slot{hash, entry};
}

void FairQueue::Index::Erase(uint64_t hash, int32_t entry) {
  size_t i = hash & mask_;
  while (slots_[i].entry != entry) {
    if (slots_[i].entry < 0) return;  // not present
    i = (i + 1) & mask_;
  }
  // Backward shift: pull later entries of the probe run into the hole when the hole
  // lies between their home slot and where they sit, so lookups never stop early.
  for (size_t j = i;;) {
    j = (j + 1) & mask_;
    if (slots_[j].entry < 0) break;
    const size_t home = slots_[j].hash & mask_;
    if (((j - home) & mask_) >= ((j - i) & mask_)) {
      slots_[i] = slots_[j];
      i = j;
    }
  }
  slots_[i] = Slot{};
}

FairQueue::FairQueue(int capacity)
    : nodes_(std::max(capacity, 1)),
      flows_(std::max(capacity, 1)),
      keys_(std::max(capacity, 1)),
      flow_index_(capacity),
      key_index_(capacity) {
  const int n = std::max(capacity, 1);
  free_nodes_.reserve(n);
  free_flows_.reserve(n);
  free_keys_.reserve(n);
  // Highest id at the bottom so ids are handed out from 0 (easier to read in a debugger).
  for (int i = n - 1; i >= 0; --i) {
    free_nodes_.push_back(i);
    free_flows_.push_back(i);
    free_keys_.push_back(i);
  }
  active_.reserve(n);
  heap_.reserve(n);
}

uint64_t FairQueue::FlowOf(const DecodeStep& step) {
  return step.flow != 0 ? step.flow : absl::HashOf(step.sequence_id);
}

uint64_t FairQueue::KeyHash(const DecodeStep& step) { return absl::HashOf(step.sequence_id, step.layer); }

bool FairQueue::Add(DecodeStep* step) {
  if (free_nodes_.empty()) return false;
  const int32_t n = free_nodes_.back();
  free_nodes_.pop_back();
  Node& node = nodes_[n];
  node = Node{};
  node.step = step;
  node.arrival = StepQueue::Arrival(step);

  const uint64_t fid = FlowOf(*step);
  const uint64_t fhash = absl::HashOf(fid);
  int32_t f = flow_index_.Find(fhash, [&](int32_t e) { return flows_[e].id == fid; });
  if (f < 0) {
    f = free_flows_.back();  // never empty: a flow holds at least one of the nodes
    free_flows_.pop_back();
    flows_[f] = Flow{};
    flows_[f].id = fid;
    flows_[f].start = virtual_time_;  // no credit for having been idle
    flows_[f].active_pos = static_cast<int32_t>(active_.size());
    active_.push_back(f);
    flow_index_.Insert(fhash, f);
  }
  const uint64_t khash = KeyHash(*step);
  int32_t k = key_index_.Find(khash, [&](int32_t e) {
    const DecodeStep& other = *nodes_[keys_[e].head].step;
    return other.layer == step->layer && other.sequence_id == step->sequence_id;
  });
  if (k < 0) {
    k = free_keys_.back();
    free_keys_.pop_back();
    keys_[k] = Key{};
    keys_[k].hash = khash;
    key_index_.Insert(khash, k);
  }
  node.flow = f;
  node.key = k;

  // Behind every earlier arrival. Steps are added in arrival order except across two
  // drains of the sharded queue, so the walk back from the tail is almost always empty.
  Flow& fl = flows_[f];
  int32_t after = fl.tail;
  while (after >= 0 && nodes_[after].arrival > node.arrival) after = nodes_[after].flow_prev;
  node.flow_prev = after;
  node.flow_next = after >= 0 ? nodes_[after].flow_next : fl.head;
  if (node.flow_prev >= 0) nodes_[node.flow_prev].flow_next = n; else fl.head = n;
  if (node.flow_next >= 0) nodes_[node.flow_next].flow_prev = n; else fl.tail = n;

  Key& key = keys_[k];
  after = key.tail;
  while (after >= 0 && nodes_[after].arrival > node.arrival) after = nodes_[after].key_prev;
  node.key_prev = after;
  node.key_next = after >= 0 ? nodes_[after].key_next : key.head;
  if (node.key_prev >= 0) nodes_[node.key_prev].key_next = n; else key.head = n;
  if (node.key_next >= 0) nodes_[node.key_next].key_prev = n; else key.tail = n;

  ++size_;
  return true;
}

void FairQueue::Unlink(int32_t n) {
  Node& node = nodes_[n];
  Flow& fl = flows_[node.flow];
  if (node.flow_prev >= 0) nodes_[node.flow_prev].flow_next = node.flow_next; else fl.head = node.flow_next;
  if (node.flow_next >= 0) nodes_[node.flow_next].flow_prev = node.flow_prev; else fl.tail = node.flow_prev;
  if (fl.head < 0) {
    const int32_t last = active_.back();
    active_[fl.active_pos] = last;
    flows_[last].active_pos = fl.active_pos;
    active_.pop_back();
    flow_index_.Erase(absl::HashOf(fl.id), node.flow);
    free_flows_.push_back(node.flow);
  }
  Key& key = keys_[node.key];
  if (node.key_prev >= 0) nodes_[node.key_prev].key_next = node.key_next; else key.head = node.key_next;
  if (node.key_next >= 0) nodes_[node.key_next].key_prev = node.key_prev; else key.tail = node.key_prev;
  if (key.head < 0) {
    key_index_.Erase(key.hash, node.key);
    free_keys_.push_back(node.key);
  }
  node = Node{};
  free_nodes_.push_back(n);
  --size_;
}

int FairQueue::RemoveIf(absl::FunctionRef<bool(DecodeStep*)> drop) {
  int removed = 0;
  // Backwards: a flow emptied here is replaced at its index by the last one, which has
  // been visited already.
  for (size_t i = active_.size(); i-- > 0;) {
    for (int32_t n = flows_[active_[i]].head; n >= 0;) {
      const int32_t next = nodes_[n].flow_next;
      if (drop(nodes_[n].step)) {
        Unlink(n);
        ++removed;
      }
      n = next;
    }
  }
  return removed;
}

bool FairQueue::HeapBefore(int32_t a, int32_t b) const {
  const Flow& fa = flows_[a];
  const Flow& fb = flows_[b];
  if (fa.start != fb.start) return fa.start < fb.start;
  return nodes_[fa.head].arrival < nodes_[fb.head].arrival;
}

bool FairQueue::RestOfUnitFits(int32_t n, int steps_left, int rows_left) const {
  const uint64_t unit = nodes_[n].step->unit;
  for (; n >= 0 && nodes_[n].step->unit == unit; n = nodes_[n].flow_next) {
    rows_left -= nodes_[n].step->s_q;
    if (--steps_left < 0 || rows_left < 0) return false;
  }
  return true;
}

int FairQueue::Pick(int max_steps, int max_rows, absl::FunctionRef<void(DecodeStep*)> take) {
  ++picks_;
  // std's heap functions keep the greatest on top: invert for the smallest tag.
  auto after = [this](int32_t a, int32_t b) { return HeapBefore(b, a); };
  heap_.assign(active_.begin(), active_.end());
  std::make_heap(heap_.begin(), heap_.end(), after);
  int taken = 0, rows = 0, flows_served = 0, most_rows = 0;
  // Whether node n can join this batch: it is the earliest pending step of its
  // (sequence, layer) (none waits in another flow), none of that (sequence, layer) is in
  // the batch yet, and the room left holds it.
  auto fits = [&](int32_t n) {
    const Key& key = keys_[nodes_[n].key];
    return key.head == n && key.pick != picks_ && taken < max_steps && rows + nodes_[n].step->s_q <= max_rows;
  };
  while (!heap_.empty() && taken < max_steps && rows < max_rows) {
    std::pop_heap(heap_.begin(), heap_.end(), after);
    const int32_t f = heap_.back();
    heap_.pop_back();
    Flow& fl = flows_[f];
    int32_t n = fl.head;
    // A flow whose head cannot be taken sits out this batch, tag unchanged, so it comes
    // first next time. So does a message (unit) whose remaining steps do not all fit in
    // what is left of the batch: it launches whole in the next one instead of being
    // spread over two, which would make its sender wait for both. Only a batch still
    // empty takes part of a unit (one larger than a launch, or held back by the
    // (sequence, layer) rule).
    if (!fits(n)) continue;
    const uint64_t unit = nodes_[n].step->unit;
    if (unit != 0 && taken > 0 && !RestOfUnitFits(n, max_steps - taken, max_rows - rows)) continue;
    virtual_time_ = std::max(virtual_time_, fl.start);
    if (fl.pick != picks_) {
      fl.pick = picks_;
      fl.rows = 0;
      ++flows_served;
    }
    // The head step, then the rest of its unit at once (ahead of other flows' tags, which
    // the flow's advancing tag pays back in later batches).
    bool more = true;
    for (;;) {
      DecodeStep* step = nodes_[n].step;
      fl.start += static_cast<uint64_t>(step->s_q);
      fl.rows += step->s_q;
      most_rows = std::max(most_rows, fl.rows);
      keys_[nodes_[n].key].pick = picks_;
      more = fl.head != fl.tail;
      const int32_t next = nodes_[n].flow_next;
      Unlink(n);  // frees the flow when this was its last step
      take(step);
      ++taken;
      rows += step->s_q;
      if (!more || unit == 0 || nodes_[next].step->unit != unit || !fits(next)) break;
      n = next;
    }
    if (more) {
      heap_.push_back(f);
      std::push_heap(heap_.begin(), heap_.end(), after);
    }
  }
  heap_.clear();
  last_pick_flows_ = flows_served;
  last_pick_max_flow_rows_ = most_rows;
  return taken;
}

}  // namespace latentd::engine
