// The ring of a Decode stream's open messages.
#include "server/decode/message_groups.h"

#include <algorithm>

namespace latentd::server::decode {

Group* MessageGroups::New() {
  if (count_ == groups_.size()) {
    std::vector<Group> grown(std::max<size_t>(4, 2 * groups_.size()));
    for (size_t i = 0; i < count_; ++i) grown[i] = groups_[(head_ + i) % groups_.size()];
    groups_.swap(grown);
    head_ = 0;
  }
  Group* g = &groups_[(head_ + count_) % groups_.size()];
  ++count_;
  *g = Group();
  g->id = next_++;
  return g;
}

Group* MessageGroups::Find(uint64_t id) {
  const uint64_t front = groups_[head_].id;
  return &groups_[(head_ + static_cast<size_t>(id - front)) % groups_.size()];
}

bool MessageGroups::Answered(Slot* s) {
  Group* g = Find(s->group);
  Hold(g, s);
  return --g->remaining == 0;
}

void MessageGroups::PopReleased() {
  while (count_ > 0 && groups_[head_].remaining == 0 && groups_[head_].held == nullptr) {
    head_ = (head_ + 1) % groups_.size();
    --count_;
  }
}

}  // namespace latentd::server::decode
