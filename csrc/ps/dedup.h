// Deduplication of a batch's ids, and summing the gradient rows that share a row: the hot
// loops of every pull and push, shared by the client (before sending), the servers (across
// workers) and the single-shard test helper, so there is one implementation of each.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hybridsync/ps.h"
#include "id_index.h"

namespace hybridsync {

// Throws PSIndexError naming `table` and the first id outside [0, num_rows).
void check_ids(const std::string& table, const int64_t* ids, int64_t n, int64_t num_rows);

// ids[i] -> unique[inverse[i]], unique ids in first-seen order.
struct Dedup {
  std::vector<int64_t> unique;
  std::vector<int64_t> inverse;
};
// Validates 0 <= id < num_rows (PSIndexError naming `table` and the id) and deduplicates.
Dedup deduplicate(const std::string& table, const int64_t* ids, int64_t n, int64_t num_rows);

// Adds gradient rows up per row index (rows may repeat, within and across add() calls, e.g.
// one call per worker), then applies the sums to a shard once per row. Reused round after
// round, so its buffers are allocated once.
class RowAggregator {
 public:
  // Starts a new sum for rows of `dim` floats, sized for about `expected` rows.
  void begin(int64_t dim, size_t expected);
  // Adds grads[i*dim...] to the sum of row rows[i].
  void add(const int64_t* rows, int64_t n, const float* grads);
  // The distinct rows summed so far (first-seen order) and their sums.
  int64_t size() const { return static_cast<int64_t>(rows_.size()); }
  const int64_t* rows() const { return rows_.data(); }
  // Multiplies the sums by `scale`, then runs one optimizer step of `shard` over them.
  void apply(Shard& shard, float scale);

 private:
  IdIndex index_;
  std::vector<int64_t> rows_;
  std::vector<float> sums_;
  int64_t dim_ = 1;
};

}  // namespace hybridsync
