// A fixed table's shard with a disk tier: its rows live in a DiskTier, up to a memory share of
// them cached in an arena (a Shard of a few rows, not of the whole shard). A row is in one place
// at a time: in memory, on disk, or nowhere -- then it holds its initial value, a function of
// (seed, id) (RowInit), so rows never written cost neither memory nor disk.
//
// When an operation needs rows (a pull's prefetch, a push, a write) the rows it touches are
// marked, rows not in memory are read back (or computed), and if memory would then hold more
// than its share, rows that operation does not touch go to disk first, least recently used
// first, an eighth of the share at a time; rows never changed since they were computed are
// simply forgotten. The spilling comes first, so a disk that cannot take them fails the
// operation before any row changes -- except a push, which keeps them in memory instead
// (SpillMode). A row on disk trains exactly as a row in memory: it moves
// as stored, bit for bit. An operation touching more rows than the share holds them all until
// the next one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hybridsync/ps.h"
#include "id_map.h"
#include "seeded.h"
#include "shard.h"
#include "tier.h"

namespace hybridsync {

class TieredRows {
 public:
  // shard_rows: rows of this shard (local l has id l * id_stride + id_offset); memory: rows the
  // arena keeps between operations (>= 1).
  TieredRows(int64_t shard_rows, int64_t memory, int64_t id_stride, int64_t id_offset, std::unique_ptr<DiskTier> disk);
  // The arena to give the shard's Shard: rows for the memory share.
  int64_t arena_rows() const { return memory_; }
  int64_t rows() const { return rows_; }
  DiskTier& disk() { return *disk_; }
  const DiskTier& disk() const { return *disk_; }

  // Every row takes its value from `init` (nothing in memory or on disk is kept).
  void reset(const RowInit& init);
  const RowInit& init() const { return init_; }
  // A pull's prefetch: rows local[0..n) (duplicates allowed) are in memory afterwards.
  void prefetch(Shard& arena, const int64_t* local, int64_t n);
  // Rows (slot < 0, float32) or slot values of local rows into out, wherever they are; memory
  // does not change (one-sided reads of the whole table stream through here).
  void gather(const Shard& arena, const int64_t* local, int64_t n, float* out, int slot) const;
  // Rows as stored (row_size() bytes each; what goes on the wire), likewise.
  void gather_raw(const Shard& arena, const int64_t* local, int64_t n, char* out) const;
  // Overwrites rows (rounded to the row type) or slot values of local rows.
  void scatter(Shard& arena, const int64_t* local, int64_t n, const float* values, int slot);
  // One round of the arena's rule (begin_step() done) on distinct rows local[i].
  void apply(Shard& arena, const int64_t* local, int64_t n, const float* grads);
  // The arena got a new rule (its slots restarted): rows on disk keep their values and get
  // fresh slots too.
  void new_rule(Shard& arena);
  // The rule's accumulating slots of every row rescaled (Shard::rescale_accumulators): those in
  // memory and those on disk; rows stored nowhere hold their initial slots, which stay.
  void rescale_accumulators(Shard& arena, float factor);
  // Local rows that hold something other than their initial value, in memory and on disk.
  std::vector<int64_t> written_in_memory() const;
  const std::vector<int64_t>& on_disk() const { return disk_->keys(); }
  int64_t resident() const { return resident_.size(); }
  // Counters: lookups (prefetch, push, write) of rows found in memory, and read from disk.
  int64_t hits() const { return hits_; }
  int64_t loads() const { return loads_; }
  int64_t steps() const { return steps_; }
  int64_t index_bytes() const;

 private:
  // Positions in the arena of local[0..n) after loading those not there (spilling first).
  void locate(Shard& arena, const int64_t* local, int64_t n, std::vector<int64_t>* pos,
              SpillMode mode = SpillMode::kMust);
  // Makes room for `incoming` rows: rows not touched by this operation go to disk.
  void spill(Shard& arena, int64_t incoming, SpillMode mode);
  // Row l's initial value as stored (rounded to the row type) and fresh slots, at position p.
  void initialize(Shard& arena, int64_t l, int64_t p) const;
  int64_t id_of(int64_t l) const { return l * id_stride_ + id_offset_; }
  int64_t rows_, memory_, id_stride_, id_offset_;
  std::unique_ptr<DiskTier> disk_;
  RowInit init_;
  IdMap resident_;              // local row -> arena position
  std::vector<uint32_t> tick_;  // per position: the operation that last touched it
  std::vector<uint8_t> dirty_;  // per position: holds what its initial value would not give
  uint32_t now_ = 0;
  int64_t hits_ = 0, loads_ = 0, steps_ = 0;
};

}  // namespace hybridsync
