// Deduplication, duplicate summing and the shards' per-round aggregation (see dedup.h).
#include "dedup.h"

#include <cstring>

#include "row_kernels.h"

namespace hybridsync {

namespace {

// Whether every id is in [0, num_rows): one branch-free pass the compiler vectorizes (a negative
// id is a huge unsigned one), so the common case costs a fraction of a loop that stops at the first
// bad id; only a batch that has one is searched for it.
HYBRIDSYNC_CLONED bool all_in_range(const int64_t* ids, int64_t n, int64_t num_rows) {
  const auto limit = static_cast<uint64_t>(num_rows);
  uint64_t outside = 0;
  for (int64_t i = 0; i < n; ++i) outside |= static_cast<uint64_t>(ids[i]) >= limit;
  return outside == 0;
}

}  // namespace

void check_ids(const std::string& table, const int64_t* ids, int64_t n, int64_t num_rows) {
  if (num_rows < 0) return;  // a dynamic table: every int64 is an id
  if (all_in_range(ids, n, num_rows)) return;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= num_rows) {
      throw PSIndexError("table '" + table + "': id " + std::to_string(ids[i]) + " is out of range [0, " +
                         std::to_string(num_rows) + ")");
    }
  }
}

namespace {

// Per thread: pulls and pushes may run on several threads' behalf.
IdIndex& thread_index() {
  thread_local IdIndex index;
  return index;
}

}  // namespace

Dedup deduplicate(const std::string& table, const int64_t* ids, int64_t n, int64_t num_rows) {
  check_ids(table, ids, n, num_rows);
  Dedup out;
  out.inverse.reserve(static_cast<size_t>(n));  // (filled as it goes: no zero-fill first)
  IdIndex& index = thread_index();
  index.reset(static_cast<size_t>(n));
  index.insert_all(ids, n, [&](int64_t i, int64_t slot, bool inserted) __attribute__((always_inline)) {
    if (inserted) out.unique.push_back(ids[i]);
    out.inverse.push_back(slot);
  });
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

// Indexes ids[0..n) and adds their gradient rows into `sums` by slot in input order (a row's
// first gradient copied, the others added); new ids are appended to `unique`. `sq` gets the sum
// of the rows' squared norms when `statistics`. With `in_place` (the index empty on entry)
// nothing is copied while every id is new -- row k is then unique row k already -- and the rows
// so far are copied into `sums` only at the first repeat: returns true when no id repeated, so
// `sums` was never written and the sums are `grads` itself. Built per common row width
// (with_row_width): a raw id costs its probe and one row's few vector adds (or copies, inline),
// not a generic loop over dim.
HYBRIDSYNC_CLONED HYBRIDSYNC_INLINE_COPIES bool add_rows(const int64_t* ids, int64_t n, const float* grads,
                                                         int64_t dim, IdIndex& index, std::vector<int64_t>& unique,
                                                         float* sums, bool in_place, bool statistics, double* sq) {
  return with_row_width(dim, [&](auto width) __attribute__((always_inline)) {
    constexpr int64_t kWidth = decltype(width)::value;
    const int64_t d = kWidth ? kWidth : dim;
    double total = 0.0;
    bool copying = !in_place;  // rows go into sums (in place: from the first repeat on)
    index.insert_all(ids, n, [&](int64_t i, int64_t slot, bool fresh) __attribute__((always_inline)) {
      const float* g = grads + i * d;
      if (statistics) total += squared_norm(g, d);
      if (fresh) unique.push_back(ids[i]);
      if (!copying) {
        if (fresh) return;  // row i is unique row i, where it is
        std::memcpy(sums, grads, sizeof(float) * static_cast<size_t>(i * d));  // rows 0..i-1: unique rows 0..i-1
        copying = true;
      }
      float* dst = sums + slot * d;
      if (fresh) {
        copy_row(dst, g, d);
      } else {
        add_row(dst, g, d);
      }
    });
    *sq = total;
    return !copying;
  });
}

// The sum of n rows' squared norms.
HYBRIDSYNC_CLONED double squared_norms(const float* rows, int64_t n, int64_t dim) {
  double sq = 0.0;
  for (int64_t i = 0; i < n; ++i) sq += squared_norm(rows + i * dim, dim);
  return sq;
}

HYBRIDSYNC_CLONED void scale_rows(float* values, int64_t count, float scale) {
  for (int64_t i = 0; i < count; ++i) values[i] *= scale;
}

}  // namespace

void sum_duplicates(const Dedup& dedup, const float* grads, int64_t dim, GradientBuffer* out) {
  out->resize(dedup.unique.size() * static_cast<size_t>(dim));
  add_up_duplicates(dedup.inverse.data(), static_cast<int64_t>(dedup.inverse.size()), grads, dim, out->data());
}

const float* deduplicate_and_sum(const std::string& table, const int64_t* ids, int64_t n, int64_t num_rows,
                                 const float* grads, int64_t dim, std::vector<int64_t>* unique, GradientBuffer* sums) {
  check_ids(table, ids, n, num_rows);
  unique->clear();
  unique->reserve(static_cast<size_t>(n));  // (filled as it goes: no zero-fill first)
  IdIndex& index = thread_index();
  index.reset(static_cast<size_t>(n));
  sums->resize(static_cast<size_t>(n * dim));  // unique <= n rows (unwritten: nothing zero-filled)
  double unused = 0.0;
  if (add_rows(ids, n, grads, dim, index, *unique, sums->data(), true, false, &unused)) {
    sums->clear();
    return grads;
  }
  sums->resize(unique->size() * static_cast<size_t>(dim));
  return sums->data();
}

void RowAggregator::step(Shard& shard, const std::vector<GradientRows>& sources, float scale) {
  sum(shard.dim(), sources, scale);
  shard.rule().begin_step();
  shard.apply(rows_.data(), size(), sums());
}

void RowAggregator::sum(int64_t dim, const std::vector<GradientRows>& sources, float scale) {
  size_t expected = 0;
  for (const GradientRows& s : sources) expected += static_cast<size_t>(s.n);
  dim_ = dim;
  rows_.clear();
  in_place_ = nullptr;
  sums_.resize(expected * static_cast<size_t>(dim_));
  index_.reset(expected);
  local_sq_ = 0.0;
  for (size_t k = 0; k < sources.size(); ++k) {
    const GradientRows& s = sources[k];
    double sq = 0.0;
    // The first source's rows are left in place until one repeats (add_rows).
    if (add_rows(s.rows, s.n, s.grads, dim_, index_, rows_, sums_.data(), k == 0, statistics_, &sq)) {
      if (sources.size() == 1 && scale == 1.0f) {
        in_place_ = s.grads;  // the sums are the source's rows, read where they are
      } else {  // later sources add into them, or the scale rewrites them
        std::memcpy(sums_.data(), s.grads, sizeof(float) * static_cast<size_t>(s.n * dim_));
      }
    }
    local_sq_ += sq;
  }
  combined_sq_ = statistics_ ? squared_norms(sums(), size(), dim_) : 0.0;
  if (scale != 1.0f) scale_rows(sums_.data(), size() * dim_, scale);
}

}  // namespace hybridsync
