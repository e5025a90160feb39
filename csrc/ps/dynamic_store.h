// One shard of a dynamic table: raw int64 ids -> rows created on first touch, with admission,
// eviction and expiry. The rows and optimizer slots live in a Shard used as a dense arena
// (positions 0 .. stored-1, no per-row allocation); an open-addressing map finds an id's
// position. Removing a row moves the last one into its place, so the arena stays dense.
//
// The rules, applied once per push round (a step boundary) on every shard alike, so that a
// one-process reference with the same per-shard rule reproduces them exactly (see
// docs/dynamic-tables.md):
//  1. the round's step t is the rule's step + 1; every touched id's count goes up by one;
//  2. expiry (ttl_steps > 0): stored rows and pending counts untouched for more than ttl_steps
//     rounds (t - last_touch > ttl_steps) are removed;
//  3. admission: an id not stored whose count reaches admit_after is a candidate; others stay
//     pending (their gradient is counted, not applied);
//  4. eviction (capacity): if stored + candidates exceed the shard's share, rows not touched
//     this round are evicted in LRU (last touch, id) or LFU (count, last touch, id) order until
//     stored + candidates fit 7/8 of the share (a batch, so eviction is not a scan per round);
//     candidates that still do not fit wait, lowest ids admitted first;
//  5. admitted rows start at their initial value (seed, id) with fresh slots; the rule then
//     updates every stored touched row.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hybridsync/ps.h"
#include "shard.h"

namespace hybridsync {

// ids -> dense positions 0 .. size-1 (insertion appends; erase moves the last entry into the
// gap). Buckets hold positions (4 bytes) and compare through the dense id array, so an entry
// costs 8 bytes of id plus 8-16 of buckets at a load factor of 1/4 to 1/2.
class IdMap {
 public:
  // Buckets for `n` entries without growing.
  void reserve(int64_t n);
  // The position of `id`, or -1.
  int64_t find(int64_t id) const;
  // out[i] = find(ids[i]), with the buckets and ids of later entries prefetched: a shard's map
  // is far larger than the caches, so lookups one at a time wait on memory twice per id.
  void find_many(const int64_t* ids, int64_t n, int64_t* out) const;
  // Appends an absent id; its position.
  int64_t insert(int64_t id);
  // Removes the entry at `pos`; the position whose entry moved into `pos` (-1: none moved).
  int64_t erase_at(int64_t pos);
  // Removes the entries at `victims` (positions) at once, lookups prefetched ahead (an
  // eviction removes an eighth of a shard): the entries left above the new size move down into
  // the gaps. Returns the moves as (from, to) pairs, in order.
  std::vector<std::pair<int64_t, int64_t>> erase_many(std::vector<int64_t> victims);
  int64_t size() const { return static_cast<int64_t>(ids_.size()); }
  // Empties it, keeping its buckets.
  void clear() {
    if (!ids_.empty()) std::fill(buckets_.begin(), buckets_.end(), -1);
    ids_.clear();
  }
  int64_t id(int64_t pos) const { return ids_[pos]; }
  const std::vector<int64_t>& ids() const { return ids_; }
  int64_t bytes() const;

 private:
  size_t home(int64_t id) const;
  size_t bucket_of(int64_t id) const;  // the bucket holding `id` (present)
  void unlink(size_t bucket);          // empties a bucket, shifting its probe run back
  void rehash(size_t buckets);
  std::vector<int32_t> buckets_;  // -1: empty
  std::vector<int64_t> ids_;
  int shift_ = 64;
  size_t mask_ = 0;
};

class DynamicStore {
 public:
  // share: the most rows this shard holds (0: unbounded).
  DynamicStore(std::string table, const DynamicSpec& spec, int64_t share, int64_t dim);
  // Rows the shard's arena starts with.
  int64_t arena_rows() const;
  void rename(std::string table) { table_ = std::move(table); }

  // Rows (slot < 0) or slot values of ids into out; absent ids read their initial value.
  void read(const Shard& arena, const int64_t* ids, int64_t n, float* out, int slot) const;
  // Overwrites rows or slot values; absent ids are created (PSError when the shard is full).
  void write(std::unique_ptr<Shard>& arena, const int64_t* ids, int64_t n, const float* values, int slot);
  // One push round (see the top of this file): `ids` distinct, `grads` summed and scaled.
  void step(std::unique_ptr<Shard>& arena, const int64_t* ids, int64_t n, const float* grads);

  DynamicState state(const Shard& arena) const;
  // Inserts the entries of `s` whose ids `mine` accepts (checkpoint restore; replaces stored ones),
  // beyond the share if need be (the next round evicts).
  template <class Mine>
  void restore(std::unique_ptr<Shard>& arena, const DynamicState& s, Mine mine);
  DynamicStats stats(const Shard& arena) const;
  // Forgets every stored row and pending id (a checkpoint load replaces the shard's contents);
  // the map keeps its buckets and the arena its pages.
  void clear();
  int64_t stored() const { return rows_.size(); }
  // The ids stored here, in arena order.
  const std::vector<int64_t>& stored_ids() const { return rows_.ids(); }
  // The initial row of `id`: a pure function of (seed, id).
  void initial_row(int64_t id, float* out) const;
  // The initial rows of n ids into out (n x dim), computed together (see normal_pairs).
  void initial_rows(const int64_t* ids, int64_t n, float* out) const;

 private:
  // A new stored row at the end of the arena (initial value, fresh slots); its position.
  int64_t add_row(std::unique_ptr<Shard>& arena, int64_t id, uint32_t count, int32_t last);
  void remove_row(Shard& arena, int64_t pos);
  // Removes the rows at `positions` in one pass (see IdMap::erase_many).
  void remove_rows(Shard& arena, std::vector<int64_t> positions);
  void remove_pending(int64_t pos);
  // Removes rows and pending ids whose last touch was round `expiring` and not since.
  void expire(Shard& arena, int32_t now);
  // Evicts rows not touched in round `now` until at most `target` rows are stored.
  int64_t evict_to(Shard& arena, int64_t target, int32_t now);
  void grow(std::unique_ptr<Shard>& arena, int64_t rows);
  // ttl: the list of ids touched in `round` (lists are kept for the newest ttl_steps + 1 rounds).
  std::vector<int64_t>& touch_list(int32_t round);
  std::string table_;
  DynamicSpec spec_;
  int64_t share_, dim_;
  IdMap rows_;  // stored ids; position = arena row
  std::vector<uint32_t> counts_;
  std::vector<int32_t> last_;
  IdMap pending_;  // seen, not admitted
  std::vector<uint32_t> pending_counts_;
  std::vector<int32_t> pending_last_;
  std::deque<std::vector<int64_t>> touched_;  // ttl: the ids of the newest rounds, oldest first
  int64_t touched_first_ = 0;                 // the round of touched_.front()
  DynamicStats counters_;
  // Initial rows the pulls since the last round computed for ids not stored: the push that
  // follows a pull admits the same ids, and copies them instead of computing them again.
  mutable IdMap fresh_ids_;
  mutable std::vector<float> fresh_rows_;
};

template <class Mine>
void DynamicStore::restore(std::unique_ptr<Shard>& arena, const DynamicState& s, Mine mine) {
  const int slots = arena->num_slots();
  if (s.dim != dim_ || static_cast<int>(s.slots.size()) != slots) {
    throw PSError("table '" + table_ + "': a checkpoint of dim " + std::to_string(s.dim) + " with " +
                  std::to_string(s.slots.size()) + " optimizer slots cannot load into dim " + std::to_string(dim_) +
                  " with " + std::to_string(slots));
  }
  for (size_t i = 0; i < s.ids.size(); ++i) {
    const int64_t id = s.ids[i];
    if (!mine(id)) continue;
    int64_t pos = rows_.find(id);
    if (pos < 0) {
      // Loaded at another world size, a shard may get more than its share: it holds them (the
      // lookups stay those that were saved) and its next round evicts down by its rule.
      pos = add_row(arena, id, 0, 0);
    }
    counts_[pos] = static_cast<uint32_t>(s.counts[i]);
    last_[pos] = static_cast<int32_t>(s.last_touch[i]);
    std::copy(s.rows.begin() + i * dim_, s.rows.begin() + (i + 1) * dim_, arena->row(pos));
    for (int k = 0; k < slots; ++k) {
      std::copy(s.slots[k].begin() + i * dim_, s.slots[k].begin() + (i + 1) * dim_, arena->row_of(k, pos));
    }
  }
  for (size_t i = 0; i < s.pending_ids.size(); ++i) {
    const int64_t id = s.pending_ids[i];
    if (!mine(id) || rows_.find(id) >= 0) continue;
    int64_t pos = pending_.find(id);
    if (pos < 0) {
      pos = pending_.insert(id);
      pending_counts_.push_back(0);
      pending_last_.push_back(0);
    }
    pending_counts_[pos] = static_cast<uint32_t>(s.pending_counts[i]);
    pending_last_[pos] = static_cast<int32_t>(s.pending_last[i]);
  }
  // Rounds to come expire from these last-touch steps: rebuild the per-round lists.
  if (spec_.ttl_steps > 0) {
    touched_.clear();
    const auto now = static_cast<int32_t>(arena->rule().step());
    touch_list(static_cast<int32_t>(now - spec_.ttl_steps));  // the oldest round still listed
    auto file = [&](int64_t id, int32_t last) {
      if (now - last <= spec_.ttl_steps && last <= now) touch_list(last).push_back(id);  // older ones never expire
    };
    for (int64_t p = 0; p < stored(); ++p) file(rows_.id(p), last_[p]);
    for (int64_t p = 0; p < pending_.size(); ++p) file(pending_.id(p), pending_last_[p]);
  }
}

}  // namespace hybridsync
