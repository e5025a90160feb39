// A flat open-addressing map from int64 ids (any: a dynamic table's raw ids include -1, the
// empty marker, which is kept beside the table) to dense slots 0, 1, 2, ... in
// first-seen order: the hot loop of deduplication and of server-side aggregation. Much faster
// than std::unordered_map for the few thousand ids of a step (no per-node allocation).
//
// An id and its slot sit side by side in one 16-byte entry, so a probe touches one cache line
// (separate key and slot arrays cost two misses per insert once the table outgrows L1), and
// insert_all() walks a batch of ids requesting the line of an id a few positions ahead.
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
    if (entries_.size() != capacity) {  // (every key is empty now: resizing keeps that)
      entries_.resize(capacity, Entry{kEmpty, 0});
      filled_.resize(capacity / 2 + 1);
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
    if ((size_ + 1) * 2 > entries_.size()) grow();
    size_t at = hash(id) & mask_;
    while (true) {
      Entry& e = entries_[at];
      if (e.key == id) return {e.slot, false};
      if (e.key == kEmpty) {
        e.key = id;
        e.slot = static_cast<int64_t>(size_);
        filled_[filled_count_++] = at;
        return {static_cast<int64_t>(size_++), true};
      }
      at = (at + 1) & mask_;
    }
  }
  // insert() of ids[0..n) in order, calling visit(i, slot, inserted) for each: the loop of a
  // batch, with the line an id probes requested kAhead ids before its turn and the table's
  // fields kept in registers (visit's stores cannot make the loop reload them).
  // Always inlined, so that a caller built for AVX2 / AVX-512 (HYBRIDSYNC_CLONED) gets the loop,
  // and `visit` inlined into it, built alike -- not one baseline copy calling visit per id.
  template <class Visit>
  __attribute__((always_inline)) void insert_all(const int64_t* ids, int64_t n, Visit&& visit) {
    if (n <= 0) return;
    while ((size_ + static_cast<size_t>(n)) * 2 > entries_.size()) grow();  // room for all: no check per id
    constexpr int64_t kAhead = 8;
    Entry* const table = entries_.data();
    const size_t mask = mask_;
    size_t size = size_;
    size_t* filled = filled_.data() + filled_count_;
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) __builtin_prefetch(&table[hash(ids[i + kAhead]) & mask], 1);
      const int64_t id = ids[i];
      if (id == kEmpty) {
        size_ = size;
        const auto [slot, inserted] = insert(id);  // kept beside the table
        size = size_;
        visit(i, slot, inserted);
        continue;
      }
      size_t at = hash(id) & mask;
      while (table[at].key != id && table[at].key != kEmpty) at = (at + 1) & mask;
      if (table[at].key == id) {
        visit(i, table[at].slot, false);
      } else {
        table[at] = Entry{id, static_cast<int64_t>(size)};
        *filled++ = at;
        visit(i, static_cast<int64_t>(size++), true);
      }
    }
    size_ = size;
    filled_count_ = static_cast<size_t>(filled - filled_.data());
  }
  size_t size() const { return size_; }

 private:
  static constexpr int64_t kEmpty = -1;
  struct Entry {
    int64_t key;
    int64_t slot;
  };
  static size_t hash(int64_t id) { return static_cast<size_t>((static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> 20); }
  // Every key empty again: the filled positions (at most half the table, usually a few percent
  // of it) rather than the whole table.
  void clear() {
    for (size_t k = 0; k < filled_count_; ++k) entries_[filled_[k]].key = kEmpty;
    filled_count_ = 0;
    size_ = 0;
    empty_key_slot_ = -1;
  }
  void grow() {
    std::vector<Entry> old = std::move(entries_);
    entries_.assign(old.empty() ? 16 : old.size() * 2, Entry{kEmpty, 0});  // (never reset: the smallest table)
    mask_ = entries_.size() - 1;
    filled_.assign(entries_.size() / 2 + 1, 0);
    filled_count_ = 0;
    for (const Entry& e : old) {
      if (e.key == kEmpty) continue;
      size_t at = hash(e.key) & mask_;
      while (entries_[at].key != kEmpty) at = (at + 1) & mask_;
      entries_[at] = e;
      filled_[filled_count_++] = at;
    }
  }
  std::vector<Entry> entries_;
  std::vector<size_t> filled_;  // [0, filled_count_): positions of entries_ holding an id, to clear them in reset()
  size_t filled_count_ = 0;     // (at most half the table: filled_ is sized so)
  size_t mask_ = 0, size_ = 0;
  int64_t empty_key_slot_ = -1;  // the slot of id kEmpty, if present
};

}  // namespace hybridsync
