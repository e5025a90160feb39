// A map from raw int64 ids to dense positions 0 .. size-1, for dynamic shards' stored and
// pending ids and disk tiers' entries.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace hybridsync {

// ids -> dense positions 0 .. size-1 (insertion appends; erase moves the last entry into the
// gap). Buckets hold positions (4 bytes) and compare through the dense id array, so an entry
// costs 8 bytes of id plus 8-16 of buckets at a load factor of 1/4 to 1/2 (16 of buckets in a
// map reserved for its size, see reserve()).
class IdMap {
 public:
  // Buckets for `n` entries without growing, at a load factor of 1/4 at most.
  void reserve(int64_t n);
  // The position of `id`, or -1.
  int64_t find(int64_t id) const;
  // out[i] = find(ids[i]), with the buckets and ids of later entries prefetched: a shard's map
  // is far larger than the caches, so lookups one at a time wait on memory twice per id.
  void find_many(const int64_t* ids, int64_t n, int64_t* out) const;
  // Appends an absent id; its position.
  int64_t insert(int64_t id);
  // Appends n absent, distinct ids in order (positions size() .. size()+n-1), buckets
  // prefetched ahead: a spill adds an eighth of a shard to a disk tier's map of the table's size.
  void insert_many(const int64_t* ids, int64_t n);
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

}  // namespace hybridsync
