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
//
// With a disk tier (storage.path), stored rows are in the arena or in a DiskTier; the rules
// above do not see the difference (a stored row is stored, wherever it is; the share bounds both
// tiers together, `memory` the arena alone). Only where rows are changes: a round, and a pull's
// prefetch, first reads back the stored rows it touches, and if the arena would then hold more
// than `memory` rows, rows it does not touch go to disk first (in the eviction order; LRU when
// evict is none), an eighth of `memory` at a time -- so a disk that cannot take them fails the
// pull before any row changes; a round keeps them in memory instead (SpillMode). Spills are
// aligned across shards: at a round that is a multiple of 8 a shard also makes room for the next
// 8 rounds' inflow, so the shards spill together (see spill()). Rows leave the disk only by
// expiry or eviction.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hybridsync/ps.h"
#include "id_map.h"
#include "shard.h"
#include "tier.h"

namespace hybridsync {

class DynamicStore {
 public:
  // share: the most rows this shard holds (0: unbounded). disk: its disk tier (or null), with
  // `memory` the most rows kept in memory between rounds.
  DynamicStore(std::string table, const DynamicSpec& spec, int64_t share, int64_t dim, int64_t memory = 0,
               std::unique_ptr<DiskTier> disk = nullptr);
  // Rows the shard's arena starts with.
  int64_t arena_rows() const;
  void rename(std::string table) {
    table_ = std::move(table);
    if (disk_) disk_->rename(table_);
  }

  // Rows (slot < 0, float32) or slot values of ids into out; absent ids read their initial value.
  // positions (if given): the ids' arena positions as a prefetch just left them (-1: stored nowhere).
  void read(const Shard& arena, const int64_t* ids, int64_t n, float* out, int slot,
            const int64_t* positions = nullptr) const;
  // Rows of ids as stored (the arena's row type: what goes on the wire).
  void read_raw(const Shard& arena, const int64_t* ids, int64_t n, char* out, const int64_t* positions = nullptr) const;
  // A pull's prefetch (disk tier only): the stored rows of ids are in the arena afterwards, and
  // *positions (if given) their places there (-1: stored nowhere), valid until the store changes.
  void prefetch(std::unique_ptr<Shard>& arena, const int64_t* ids, int64_t n,
                std::vector<int64_t>* positions = nullptr);
  // Overwrites rows or slot values; absent ids are created (PSError when the shard is full).
  void write(std::unique_ptr<Shard>& arena, const int64_t* ids, int64_t n, const float* values, int slot);
  // One push round (see the top of this file): `ids` distinct, `grads` summed and scaled.
  void step(std::unique_ptr<Shard>& arena, const int64_t* ids, int64_t n, const float* grads);

  // state() and range() need every disk entry to hold a row: drop_released() first.
  DynamicState state(const Shard& arena) const;
  // Entries [begin, begin + n) of the stored rows (pending: false; with their rows and slots as
  // asked) or of the pending ids, in storage order: a one-sided reader's chunk.
  DynamicState range(const Shard& arena, bool pending, int64_t begin, int64_t n, bool rows, bool slots) const;
  // Inserts the entries of `s` whose ids `mine` accepts (checkpoint restore; replaces stored ones),
  // beyond the share if need be (the next round evicts). `s` without slots: rows it adds start
  // with fresh slots, stored ones keep theirs.
  template <class Mine>
  void restore(std::unique_ptr<Shard>& arena, const DynamicState& s, Mine mine);
  // Overwrites the optimizer slots of those of `ids` that are stored (slots[k]: n x dim each).
  void write_slots(std::unique_ptr<Shard>& arena, const std::vector<int64_t>& ids,
                   const std::vector<std::vector<float>>& slots);
  // The arena got a new rule (its slots restarted): rows on disk get fresh slots too.
  void new_rule(Shard& arena);
  // The rule's accumulating slots of every stored row rescaled (Shard::rescale_accumulators),
  // in memory and on disk; pending ids have no slots yet, and rows admitted later start fresh.
  void rescale_accumulators(Shard& arena, float factor);
  DynamicStats stats(const Shard& arena) const;
  // Forgets every stored row and pending id (a checkpoint load replaces the shard's contents);
  // the map keeps its buckets and the arena its pages.
  void clear();
  // Rows stored (in both tiers), in memory, pending.
  int64_t stored() const { return rows_.size() + (disk_ ? disk_->size() : 0); }
  // Disk tier: removes the entries of rows read back into memory (see DiskTier::release), so
  // that every disk entry holds a row: before anything walks the entries by index (range(),
  // state(), a new rule). Changes no row.
  void drop_released();
  int64_t resident() const { return rows_.size(); }
  int64_t pending() const { return pending_.size(); }
  const DiskTier* disk() const { return disk_.get(); }
  // Lookups (prefetch, round) of stored rows found in memory, and read back from disk.
  int64_t hits() const { return hits_; }
  int64_t loads() const { return loads_; }
  // The initial row of `id`: a pure function of (seed, id).
  void initial_row(int64_t id, float* out) const;
  // The initial rows of n ids into out (n x dim), computed together (see normal_pairs).
  void initial_rows(const int64_t* ids, int64_t n, float* out) const;

 private:
  // A new stored row at the end of the arena, its values unset; its position.
  int64_t append_row(std::unique_ptr<Shard>& arena, int64_t id, uint32_t count, int32_t last);
  // A new stored row at the end of the arena (initial value, fresh slots); its position.
  int64_t add_row(std::unique_ptr<Shard>& arena, int64_t id, uint32_t count, int32_t last);
  // orphans: gets the row's released disk entry (to be removed with the row), if it has one.
  void remove_row(Shard& arena, int64_t pos, std::vector<int64_t>* orphans);
  // Removes the rows at `positions` in one pass (see IdMap::erase_many).
  void remove_rows(Shard& arena, std::vector<int64_t> positions);
  void remove_pending(int64_t pos);
  // Removes rows and pending ids whose last touch was round `expiring` and not since.
  void expire(Shard& arena, int32_t now);
  // Evicts rows not touched in round `now` until at most `target` rows are stored.
  int64_t evict_to(Shard& arena, int64_t target, int32_t now);
  // Disk tier: brings the stored rows of ids (which may repeat) into the arena (making room
  // first); the rows ids name are marked as this operation's, so nothing spills them.
  // positions (if given): the ids' positions in the arena afterwards (-1: not stored).
  // distinct: the ids do not repeat (a round's), so they need no sorting out.
  void load(std::unique_ptr<Shard>& arena, const int64_t* ids, int64_t n, SpillMode mode = SpillMode::kMust,
            std::vector<int64_t>* positions = nullptr, bool distinct = false);
  // Disk tier: rows of the arena not marked by the newest operation go to disk until
  // `incoming` more rows fit `memory_`. Whether any went (rows of the arena moved).
  bool spill(Shard& arena, int64_t incoming, SpillMode mode = SpillMode::kMust);
  // Disk tier: back within `memory_` rows, any row a candidate to spill (restores, writes).
  void settle(Shard& arena) {
    ++now_;
    spill(arena, 0);
  }
  // Removes disk entries (released or not), keeping their counters and rows' entries in step.
  void remove_on_disk(std::vector<int64_t> entries);
  void grow(Shard& arena, int64_t rows);
  // A float32 row as a 16-bit arena would store it (rounded and back).
  void round_trip(const Shard& arena, float* row) const;
  // ttl: the list of ids touched in `round` (lists are kept for the newest ttl_steps + 1 rounds).
  std::vector<int64_t>& touch_list(int32_t round);
  std::string table_;
  DynamicSpec spec_;
  int64_t share_, dim_, memory_;
  IdMap rows_;  // stored ids in memory; position = arena row
  std::vector<uint32_t> counts_;
  std::vector<int32_t> last_;
  std::vector<uint32_t> tick_;         // disk tier: per arena row, the operation that last needed it
  // Disk tier: per arena row, the released disk entry it was read back from (-1: none), which
  // it goes to again when it spills, and which goes with it when it is removed.
  std::vector<int64_t> disk_entry_;
  std::unique_ptr<DiskTier> disk_;     // stored rows not in memory (entries keyed by id), or null
  std::vector<uint32_t> disk_counts_;  // per disk entry
  std::vector<int32_t> disk_last_;
  uint32_t now_ = 0;                   // operations so far (disk tier)
  int64_t hits_ = 0, loads_ = 0;
  // Disk tier: spills fall on rounds that are multiples of kSpillPeriod on every shard (spill()).
  static constexpr int64_t kSpillPeriod = 8;
  int64_t added_since_spill_ = 0;  // rows that came into the arena since the last spill
  int64_t last_spill_round_ = -1;  // the rule's step at the last spill (-1: none yet)
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
  // Disk tier: ids a load found stored nowhere since the last row was added. Only add_row makes
  // an id stored (and only a stored row can spill), so until then the reads and the round that
  // follow a pull's prefetch skip the disk's index for them: ~2 lookups per new id, each a miss
  // in a map of the table's size.
  IdMap unstored_;
  // Whether `id` is known to be stored nowhere (see unstored_).
  bool known_unstored(int64_t id) const { return unstored_.size() > 0 && unstored_.find(id) >= 0; }
};

template <class Mine>
void DynamicStore::restore(std::unique_ptr<Shard>& arena, const DynamicState& s, Mine mine) {
  const int slots = arena->num_slots();
  const bool with_slots = !s.slots.empty();
  if (s.dim != dim_ || (with_slots && static_cast<int>(s.slots.size()) != slots)) {
    throw PSError("table '" + table_ + "': a checkpoint of dim " + std::to_string(s.dim) + " with " +
                  std::to_string(s.slots.size()) + " optimizer slots cannot load into dim " + std::to_string(dim_) +
                  " with " + std::to_string(slots));
  }
  for (size_t i = 0; i < s.ids.size(); ++i) {
    const int64_t id = s.ids[i];
    if (!mine(id)) continue;
    int64_t pos = rows_.find(id);
    if (pos < 0 && disk_) {  // (on disk: loaded, so rows the state leaves out keep their slots)
      load(arena, &id, 1);
      pos = rows_.find(id);
    }
    if (pos < 0) {
      // Loaded at another world size, a shard may get more than its share: it holds them (the
      // lookups stay those that were saved) and its next round evicts down by its rule.
      const int64_t waiting = pending_.find(id);
      if (waiting >= 0) remove_pending(waiting);  // (stored now: it waits no more)
      pos = add_row(arena, id, 0, 0);
    }
    counts_[pos] = static_cast<uint32_t>(s.counts[i]);
    last_[pos] = static_cast<int32_t>(s.last_touch[i]);
    arena->set_row(pos, s.rows.data() + i * dim_);
    for (int k = 0; with_slots && k < slots; ++k) {
      std::copy(s.slots[k].begin() + i * dim_, s.slots[k].begin() + (i + 1) * dim_, arena->row_of(k, pos));
    }
    if (disk_ && rows_.size() > 2 * memory_) settle(*arena);  // (a big state streams through memory)
  }
  if (disk_) settle(*arena);
  for (size_t i = 0; i < s.pending_ids.size(); ++i) {
    const int64_t id = s.pending_ids[i];
    if (!mine(id) || rows_.find(id) >= 0 || (disk_ && disk_->find(id) >= 0)) continue;
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
    for (int64_t p = 0; p < rows_.size(); ++p) file(rows_.id(p), last_[p]);
    for (int64_t e = 0; disk_ && e < disk_->entries(); ++e) {  // (a released entry's row is in memory)
      if (!disk_->released(e)) file(disk_->key(e), disk_last_[static_cast<size_t>(e)]);
    }
    for (int64_t p = 0; p < pending_.size(); ++p) file(pending_.id(p), pending_last_[p]);
  }
}

}  // namespace hybridsync
