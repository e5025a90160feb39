// Bounded staleness (stale synchronous parallel) for one table: what a rank keeps as a worker
// and as the server of its shard. See bounded.cc.
#pragma once

#include <cstdint>
#include <vector>

#include "hybridsync/ps.h"

namespace hybridsync {

struct BoundedState {
  int staleness = 0;  // k; 0: the table's pulls and pushes are collective rounds
  // Worker: this rank's pushes of the table so far (its clock) and what its pulls saw.
  StalenessStats seen;
  // Server: per source rank, its pushes of the table applied on this shard.
  std::vector<int64_t> applied;
};

}  // namespace hybridsync
