// A flat open-addressing map from int64 ids (any: a dynamic table's raw ids include -1, the
// empty marker, which is kept beside the table) to dense slots 0, 1, 2, ... in
// first-seen order: the hot loop of deduplication and of server-side aggregation. Much faster
// than std::unordered_map for the few thousand ids of a step (no per-node allocation).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace hybridsync {

class IdIndex {
 public:
  // Empties the map, sized for about `expected` distinct ids. Only the positions the last use
  // filled are cleared (a request's few thousand ids in a table sized for all its ids), not the
  // whole table: the map is reused request after request.
  void reset(size_t expected) {
    size_t capacity = 16;
    while (capacity < expected * 2) capacity <<= 1;
    clear();
    if (keys_.size() != capacity) {  // (every key is empty now: resizing keeps that)
      keys_.resize(capacity, kEmpty);
      slots_.resize(capacity);
      filled_.reserve(capacity / 2 + 1);
    }
    mask_ = capacity - 1;
  }
  // The slot of `id`, inserting it with the next free slot if new. (slot, inserted)
  std::pair<int64_t, bool> insert(int64_t id) {
    if (id == kEmpty) {
      if (empty_key_slot_ >= 0) return {empty_key_slot_, false};
      empty_key_slot_ = static_cast<int64_t>(size_);
      return {static_cast<int64_t>(size_++), true};
    }
    if ((size_ + 1) * 2 > keys_.size()) grow();
    size_t at = hash(id) & mask_;
    while (true) {
      if (keys_[at] == id) return {slots_[at], false};
      if (keys_[at] == kEmpty) {
        keys_[at] = id;
        slots_[at] = static_cast<int64_t>(size_);
        filled_.push_back(at);
        return {static_cast<int64_t>(size_++), true};
      }
      at = (at + 1) & mask_;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr int64_t kEmpty = -1;
  static size_t hash(int64_t id) { return static_cast<size_t>((static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> 20); }
  // Every key empty again: the filled positions (at most half the table, usually a few percent
  // of it) rather than the whole table.
  void clear() {
    for (size_t at : filled_) keys_[at] = kEmpty;
    filled_.clear();
    size_ = 0;
    empty_key_slot_ = -1;
  }
  void grow() {
    std::vector<int64_t> keys = std::move(keys_), slots = std::move(slots_);
    keys_.assign(keys.size() * 2, kEmpty);
    slots_.resize(keys.size() * 2);
    mask_ = keys_.size() - 1;
    filled_.clear();
    filled_.reserve(keys_.size() / 2 + 1);
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] == kEmpty) continue;
      size_t at = hash(keys[i]) & mask_;
      while (keys_[at] != kEmpty) at = (at + 1) & mask_;
      keys_[at] = keys[i];
      slots_[at] = slots[i];
      filled_.push_back(at);
    }
  }
  std::vector<int64_t> keys_, slots_;
  std::vector<size_t> filled_;  // positions of keys_ holding an id, to clear them in reset()
  size_t mask_ = 0, size_ = 0;
  int64_t empty_key_slot_ = -1;  // the slot of id kEmpty, if present
};

}  // namespace hybridsync
