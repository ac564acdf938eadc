// The scheduler's waiting room: decode steps grouped by flow (DecodeStep::flow) so that
// each launch shares its query rows fairly between submitters, while steps of one flow
// and of one (sequence, layer) keep their arrival order. Scheduler thread only.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "engine/types.h"

namespace latentd::engine {

// Start-time fair queueing by rows. Every flow carries a virtual start tag for its
// head step; a batch takes, repeatedly, the head of the flow with the smallest tag,
// and a taken step advances its flow's tag by its s_q. A flow that (re)appears starts
// at the current virtual time, so an idle flow earns no credit and a backlogged one no
// penalty beyond its own rows. Tags persist across batches: a flow left out of a full
// batch has the smallest tag in the next one, which rotates service when there are
// more flows than slots.
//
// Every structure is sized at construction (capacity = steps pending at once), so
// adding, sweeping and picking allocate nothing.
class FairQueue {
 public:
  explicit FairQueue(int capacity);

  // The flow a step is scheduled under: DecodeStep::flow, or for 0 a flow of its own
  // sequence (a hash of the id; a collision with another key only merges two flows).
  static uint64_t FlowOf(const DecodeStep& step);

  // Adds a step behind the earlier-arrived steps of its flow (StepQueue::Arrival
  // order). False only when `capacity` steps are already pending.
  bool Add(DecodeStep* step);

  // Removes every pending step for which drop(step) is true (cancelled, expired).
  // O(pending). Returns the number removed.
  int RemoveIf(absl::FunctionRef<bool(DecodeStep*)> drop);

  // Takes up to max_steps steps holding up to max_rows query rows, calling take(step)
  // for each in the order taken. A step is taken only when it heads its flow, is the
  // earliest pending step of its (sequence, layer) and no step of that (sequence,
  // layer) is in this pick yet; a flow whose head cannot be taken sits out the rest of
  // the pick and keeps its tag. A message (steps of one flow sharing a nonzero
  // DecodeStep::unit, consecutive in the flow) is taken whole, or sits out while the
  // rest of it does not fit what is left of the batch; only an empty batch takes part
  // of one. O(flows + taken * log flows + units passed over * unit size). Returns the
  // count.
  int Pick(int max_steps, int max_rows, absl::FunctionRef<void(DecodeStep*)> take);

  int size() const { return size_; }
  bool empty() const { return size_ == 0; }
  int flows() const { return static_cast<int>(active_.size()); }
  // Of the last Pick: flows that got rows, and the most rows one flow got.
  int last_pick_flows() const { return last_pick_flows_; }
  int last_pick_max_flow_rows() const { return last_pick_max_flow_rows_; }

 private:
  // Open addressing over int32 entry ids, fixed capacity (a power of two at least twice
  // the entries it ever holds), linear probing, deletion by backward shift (no
  // tombstones, so it never needs rebuilding).
  class Index {
   public:
    explicit Index(int max_entries);
    // The entry with this hash for which same(entry) holds, or -1.
    int32_t Find(uint64_t hash, absl::FunctionRef<bool(int32_t)> same) const;
    void Insert(uint64_t hash, int32_t entry);
    void Erase(uint64_t hash, int32_t entry);

   private:
    struct Slot {
      uint64_t hash = 0;
      int32_t entry = -1;
    };
    std::vector<Slot> slots_;
    size_t mask_ = 0;
  };

  struct Node {  // one pending step
    DecodeStep* step = nullptr;
    uint64_t arrival = 0;
    int32_t flow = -1, key = -1;
    int32_t flow_prev = -1, flow_next = -1;  // within its flow, by arrival
    int32_t key_prev = -1, key_next = -1;    // within its (sequence, layer), by arrival
  };
  struct Flow {
    uint64_t id = 0;
    uint64_t start = 0;  // virtual start tag of the head step
    int32_t head = -1, tail = -1;
    int32_t active_pos = -1;  // index in active_
    uint64_t pick = 0;        // last Pick that gave it rows
    int rows = 0;             // rows it got in that Pick
  };
  struct Key {  // one (sequence, layer) with pending steps
    uint64_t hash = 0;
    int32_t head = -1, tail = -1;
    uint64_t pick = 0;  // last Pick that took one of its steps
  };

  static uint64_t KeyHash(const DecodeStep& step);
  bool HeapBefore(int32_t a, int32_t b) const;  // min-heap order of flows
  // Whether node n and the steps of its unit behind it in its flow fit the room left.
  bool RestOfUnitFits(int32_t n, int steps_left, int rows_left) const;
  void Unlink(int32_t node);                     // from its flow and key; frees emptied ones

  std::vector<Node> nodes_;
  std::vector<Flow> flows_;
  std::vector<Key> keys_;
  std::vector<int32_t> free_nodes_, free_flows_, free_keys_;
  Index flow_index_, key_index_;
  std::vector<int32_t> active_;  // flows with pending steps
  std::vector<int32_t> heap_;    // Pick's scratch
  int size_ = 0;
  uint64_t virtual_time_ = 0;
  uint64_t picks_ = 0;
  int last_pick_flows_ = 0, last_pick_max_flow_rows_ = 0;
};

}  // namespace latentd::engine
