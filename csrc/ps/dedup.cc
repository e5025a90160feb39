// Deduplication, duplicate summing and the shards' per-round aggregation (see dedup.h).
#include "dedup.h"

#include <cstring>

#include "row_kernels.h"

namespace hybridsync {

void check_ids(const std::string& table, const int64_t* ids, int64_t n, int64_t num_rows) {
  if (num_rows < 0) return;  // a dynamic table: every int64 is an id
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= num_rows) {
      throw PSIndexError("table '" + table + "': id " + std::to_string(ids[i]) + " is out of range [0, " +
                         std::to_string(num_rows) + ")");
    }
  }
}

Dedup deduplicate(const std::string& table, const int64_t* ids, int64_t n, int64_t num_rows) {
  check_ids(table, ids, n, num_rows);
  Dedup out;
  out.inverse.reserve(static_cast<size_t>(n));  // (filled as it goes: no zero-fill first)
  thread_local IdIndex index;  // per thread: pulls may run on several threads' behalf
  index.reset(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    auto [slot, inserted] = index.insert(ids[i]);
    if (inserted) out.unique.push_back(ids[i]);
    out.inverse.push_back(slot);
  }
  return out;
}

namespace {

// The loops over rows, each built for the machine (HYBRIDSYNC_CLONED; see row_kernels.h).

HYBRIDSYNC_CLONED void add_up_duplicates(const int64_t* inverse, int64_t n, const float* grads, int64_t dim,
                                         float* sums) {
  int64_t seen = 0;  // unique ids are numbered in first-seen order: u == seen is u's first row
  for (int64_t i = 0; i < n; ++i) {
    const int64_t u = inverse[i];
    if (u == seen) {
      std::memcpy(sums + u * dim, grads + i * dim, sizeof(float) * dim);
      ++seen;
    } else {
      add_row(sums + u * dim, grads + i * dim, dim);
    }
  }
}

// One source's rows into the sums (a row's first gradient copied, the others added), new rows
// appended to `rows`; the sum of the source rows' squared norms when `statistics`, else 0.
HYBRIDSYNC_CLONED double add_source(const GradientRows& source, int64_t dim, bool statistics, IdIndex& index,
                                    std::vector<int64_t>& rows, float* sums) {
  double sq = 0.0;
  for (int64_t k = 0; k < source.n; ++k) {
    auto [slot, fresh] = index.insert(source.rows[k]);
    float* dst = sums + slot * dim;
    const float* g = source.grads + k * dim;
    if (statistics) sq += squared_norm(g, dim);
    if (fresh) {
      rows.push_back(source.rows[k]);
      std::memcpy(dst, g, dim * sizeof(float));
    } else {
      add_row(dst, g, dim);
    }
  }
  return sq;
}

// The squared norm of n summed rows when `statistics` (else 0), then the rows times `scale`.
HYBRIDSYNC_CLONED double finish_sums(float* sums, int64_t n, int64_t dim, float scale, bool statistics) {
  double sq = 0.0;
  if (statistics) {
    for (int64_t i = 0; i < n; ++i) sq += squared_norm(sums + i * dim, dim);
  }
  if (scale != 1.0f) {
    for (int64_t i = 0; i < n * dim; ++i) sums[i] *= scale;
  }
  return sq;
}

}  // namespace

void sum_duplicates(const Dedup& dedup, const float* grads, int64_t dim, GradientBuffer* out) {
  out->resize(dedup.unique.size() * static_cast<size_t>(dim));
  add_up_duplicates(dedup.inverse.data(), static_cast<int64_t>(dedup.inverse.size()), grads, dim, out->data());
}

void RowAggregator::step(Shard& shard, const std::vector<GradientRows>& sources, float scale) {
  sum(shard.dim(), sources, scale);
  shard.rule().begin_step();
  shard.apply(rows_.data(), size(), sums_.data());
}

void RowAggregator::sum(int64_t dim, const std::vector<GradientRows>& sources, float scale) {
  size_t expected = 0;
  for (const GradientRows& s : sources) expected += static_cast<size_t>(s.n);
  dim_ = dim;
  rows_.clear();
  sums_.resize(expected * static_cast<size_t>(dim_));
  index_.reset(expected);
  local_sq_ = 0.0;
  for (const GradientRows& s : sources) local_sq_ += add_source(s, dim_, statistics_, index_, rows_, sums_.data());
  combined_sq_ = finish_sums(sums_.data(), size(), dim_, scale, statistics_);
}

}  // namespace hybridsync
