// Where the unique ids of one batch go: deduplicated, then grouped by destination rank with a
// counting sort, so building one message per destination is a linear scan.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dedup.h"
#include "partitioner.h"

namespace hybridsync {

struct Routing {
  Dedup dedup;                  // unique ids (first-seen order) and, per input id, its unique slot
  std::vector<int64_t> offset;  // size P + 1: dest d's uniques are order[offset[d] .. offset[d+1])
  std::vector<int64_t> order;   // indices into dedup.unique, grouped by destination
  std::vector<int64_t> local;   // the row's position in its shard, aligned with `order`

  int64_t count(int dest) const { return offset[dest + 1] - offset[dest]; }
};

// Routes the unique ids of `dedup` (validated already).
inline Routing route_unique(Dedup dedup, const Partitioner& part, int num_ranks) {
  Routing r;
  r.dedup = std::move(dedup);
  const auto& unique = r.dedup.unique;
  std::vector<int> dest(unique.size());
  r.offset.assign(static_cast<size_t>(num_ranks) + 1, 0);
  for (size_t u = 0; u < unique.size(); ++u) {
    dest[u] = part.shard_of(unique[u]);  // shard s lives on rank s
    ++r.offset[dest[u] + 1];
  }
  for (int d = 0; d < num_ranks; ++d) r.offset[d + 1] += r.offset[d];
  std::vector<int64_t> next(r.offset.begin(), r.offset.end() - 1);
  r.order.resize(unique.size());
  r.local.resize(unique.size());
  for (size_t u = 0; u < unique.size(); ++u) {
    const int64_t at = next[dest[u]]++;
    r.order[at] = static_cast<int64_t>(u);
    r.local[at] = part.local_index(unique[u]);
  }
  return r;
}

// Validates and routes ids[0..n) of table `name`; throws PSIndexError naming a bad id.
inline Routing route_ids(const std::string& name, const Partitioner& part, const int64_t* ids, int64_t n,
                         int num_ranks) {
  return route_unique(deduplicate(name, ids, n, part.num_rows()), part, num_ranks);
}

}  // namespace hybridsync
