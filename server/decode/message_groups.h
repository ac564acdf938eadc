// The message rule of a Decode stream: a DecodeRequest is one unit. Its valid steps go
// to the engine in one Engine::SubmitBatch, and its results are held back until all of
// them are answered, then released together. MessageGroups tracks the messages not yet
// released, in the order they came.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "server/decode/step_slot.h"

namespace latentd::server::decode {

// One DecodeRequest (or batch taken from a doorbell ring) whose results are not all in.
struct Group {
  uint64_t id = 0;
  int remaining = 0;     // valid steps not yet answered
  Slot* held = nullptr;  // answered ones (and invalid ones), linked by Slot::group_next
  bool ring = false;     // taken from the doorbell ring: results go to its completion queue
};

// Groups live in a ring in message order; a group leaves it once it and every older
// one are released. The ring only grows (to the most messages a stream has had open
// at once), so the steady state allocates nothing. Not thread-safe (the stream's lock).
class MessageGroups {
 public:
  // A new, empty group after every open one.
  Group* New();
  // The open group of that id.
  Group* Find(uint64_t id);
  // Holds an answered slot in its group; true when that was the group's last step
  // outstanding (the caller then releases it).
  bool Answered(Slot* s);
  // Holds a slot answered before it was submitted (it failed validation).
  static void Hold(Group* g, Slot* s) {
    s->group_next = g->held;
    g->held = s;
  }
  // Drops the groups at the front that have no step outstanding and none held.
  void PopReleased();
  size_t open() const { return count_; }

 private:
  std::vector<Group> groups_;
  size_t head_ = 0, count_ = 0;
  uint64_t next_ = 1;
};

}  // namespace latentd::server::decode
