// Maps a table's global row ids to (shard, local index) and back; mirrored by
// hybridsync/partition.py (tested against each other).
#pragma once

#include <cstdint>

#include "hybridsync/ps.h"

namespace hybridsync {

// The shard of a dynamic table's raw id: a hash of it modulo the shards.
int hash_shard(int64_t id, int num_shards);

// kHash: local_index is the raw id itself (the shard's id map finds its row).
class Partitioner {
 public:
  Partitioner(int64_t num_rows, int num_shards, PartitionKind kind);
  // Shard owning `id`, its position in that shard, and the inverse (ids must be in range).
  int shard_of(int64_t id) const;
  int64_t local_index(int64_t id) const;
  int64_t global_id(int shard, int64_t local) const;
  // Rows shard `shard` stores.
  int64_t shard_rows(int shard) const;
  int64_t num_rows() const { return num_rows_; }
  int num_shards() const { return num_shards_; }

 private:
  int64_t num_rows_;
  int num_shards_;
  PartitionKind kind_;
  int64_t block_;  // rows per shard for kBlock (the last shard may hold fewer)
};

}  // namespace hybridsync
