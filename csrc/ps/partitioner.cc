#include <string>

#include "partitioner.h"
#include "seeded.h"

#include <algorithm>

namespace hybridsync {

Partitioner::Partitioner(int64_t num_rows, int num_shards, PartitionKind kind)
    : num_rows_(num_rows), num_shards_(num_shards), kind_(kind) {
  if (num_rows < 0 && kind != PartitionKind::kHash) throw PSError("num_rows must be >= 0, got " + std::to_string(num_rows));
  if (num_shards < 1) throw PSError("num_shards must be >= 1, got " + std::to_string(num_shards));
  // Ceil-divide so the first shards hold full blocks and only the last one is short.
  block_ = num_rows == 0 ? 1 : (num_rows + num_shards - 1) / num_shards;
}

int Partitioner::shard_of(int64_t id) const {
  if (kind_ == PartitionKind::kHash) return hash_shard(id, num_shards_);
  return static_cast<int>(kind_ == PartitionKind::kCyclic ? id % num_shards_ : id / block_);
}

int64_t Partitioner::local_index(int64_t id) const {
  if (kind_ == PartitionKind::kHash) return id;  // the shard's map finds the row
  return kind_ == PartitionKind::kCyclic ? id / num_shards_ : id % block_;
}

int64_t Partitioner::global_id(int shard, int64_t local) const {
  if (kind_ == PartitionKind::kHash) return local;
  return kind_ == PartitionKind::kCyclic ? local * num_shards_ + shard : shard * block_ + local;
}

int64_t Partitioner::shard_rows(int shard) const {
  if (kind_ == PartitionKind::kHash) return 0;  // rows come and go: ask the shard
  if (kind_ == PartitionKind::kCyclic) {
    // Ids shard, shard + S, shard + 2S, ... below num_rows.
    return num_rows_ > shard ? (num_rows_ - shard + num_shards_ - 1) / num_shards_ : 0;
  }
  const int64_t begin = static_cast<int64_t>(shard) * block_;
  if (begin >= num_rows_) return 0;
  return std::min(block_, num_rows_ - begin);
}

int hash_shard(int64_t id, int num_shards) {
  // A different mix than the shards' own maps use (those hash the id's top bits), so the ids of
  // one shard still spread over its map.
  return static_cast<int>(mix64(static_cast<uint64_t>(id) ^ 0xD6E8FEB86659FD93ull) % static_cast<uint64_t>(num_shards));
}

}  // namespace hybridsync
