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

void sum_duplicates(const Dedup& dedup, const float* grads, int64_t dim, GradientBuffer* out) {
  out->resize(dedup.unique.size() * static_cast<size_t>(dim));
  float* sums = out->data();
  const int64_t n = static_cast<int64_t>(dedup.inverse.size());
  int64_t seen = 0;  // unique ids are numbered in first-seen order: u == seen is u's first row
  for (int64_t i = 0; i < n; ++i) {
    const int64_t u = dedup.inverse[i];
    if (u == seen) {
      std::memcpy(sums + u * dim, grads + i * dim, sizeof(float) * dim);
      ++seen;
    } else {
      add_row(sums + u * dim, grads + i * dim, dim);
    }
  }
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
  for (const GradientRows& s : sources) add(s);
  const int64_t n = size();
  combined_sq_ = 0.0;
  if (statistics_) {
    for (int64_t i = 0; i < n; ++i) combined_sq_ += squared_norm(sums_.data() + i * dim_, dim_);
  }
  if (scale != 1.0f) {
    for (int64_t i = 0; i < n * dim_; ++i) sums_[i] *= scale;
  }
}

void RowAggregator::add(const GradientRows& source) {
  for (int64_t k = 0; k < source.n; ++k) {
    auto [slot, fresh] = index_.insert(source.rows[k]);
    float* dst = sums_.data() + slot * dim_;
    const float* g = source.grads + k * dim_;
    if (statistics_) local_sq_ += squared_norm(g, dim_);
    if (fresh) {
      rows_.push_back(source.rows[k]);
      std::memcpy(dst, g, dim_ * sizeof(float));
    } else {
      add_row(dst, g, dim_);
    }
  }
}

}  // namespace hybridsync
