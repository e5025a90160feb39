#include "dedup.h"

#include <cstring>

namespace hybridsync {

void check_ids(const std::string& table, const int64_t* ids, int64_t n, int64_t num_rows) {
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
  out.inverse.resize(static_cast<size_t>(n));
  thread_local IdIndex index;  // per thread: pulls may run on several threads' behalf
  index.reset(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    auto [slot, inserted] = index.insert(ids[i]);
    if (inserted) out.unique.push_back(ids[i]);
    out.inverse[i] = slot;
  }
  return out;
}

void RowAggregator::begin(int64_t dim, size_t expected) {
  dim_ = dim;
  rows_.clear();
  sums_.resize(expected * static_cast<size_t>(dim));
  index_.reset(expected);
}

void RowAggregator::add(const int64_t* rows, int64_t n, const float* grads) {
  for (int64_t k = 0; k < n; ++k) {
    auto [slot, fresh] = index_.insert(rows[k]);
    if (static_cast<size_t>((slot + 1) * dim_) > sums_.size()) sums_.resize(static_cast<size_t>((slot + 1) * dim_) * 2);
    float* dst = sums_.data() + slot * dim_;
    const float* g = grads + k * dim_;
    if (fresh) {
      rows_.push_back(rows[k]);
      std::memcpy(dst, g, dim_ * sizeof(float));
    } else {
      for (int64_t j = 0; j < dim_; ++j) dst[j] += g[j];
    }
  }
}

void RowAggregator::apply(Shard& shard, float scale) {
  const int64_t n = size();
  if (scale != 1.0f) {
    for (int64_t i = 0; i < n * dim_; ++i) sums_[i] *= scale;
  }
  shard.rule().begin_step();
  shard.apply(rows_.data(), n, sums_.data());
}

}  // namespace hybridsync
