#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "shard.h"

namespace hybridsync {

template <class T>
T* ZeroPages<T>::allocate(size_t n) {
  const size_t bytes = n * sizeof(T);
  if (bytes >= kMmapBytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    // Huge pages where the system grants them on request (THP "madvise"): a step's rows are
    // scattered over the whole table, so with 4 KiB pages nearly every row read or updated is
    // also a TLB miss. Still nothing is resident until written (2 MiB at a time). Advisory.
    madvise(p, bytes, MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void* p = std::calloc(n ? n : 1, sizeof(T));
  if (p == nullptr) throw std::bad_alloc();
  return static_cast<T*>(p);
}

template <class T>
void ZeroPages<T>::deallocate(T* p, size_t n) noexcept {
  if (n * sizeof(T) >= kMmapBytes) {
    munmap(p, n * sizeof(T));
  } else {
    std::free(p);
  }
}

template struct ZeroPages<float>;

Shard::Shard(std::string table, int64_t rows, int64_t dim, std::unique_ptr<UpdateRule> rule)
    : table_(std::move(table)), rows_(rows), dim_(dim), rule_(std::move(rule)) {
  if (rows < 0 || dim < 1) {
    throw PSError("table '" + table_ + "': shape (" + std::to_string(rows) + ", " +
                  std::to_string(dim) + ") is not a valid (rows, dim)");
  }
  owned_.resize(static_cast<size_t>(rows * dim));  // zeros, resident once written
  base_ = owned_.data();
  set_rule(std::move(rule_));
}

void Shard::attach(float* base, int64_t stride, int64_t offset) {
  base_ = base;
  stride_ = stride;
  offset_ = offset;
  owned_.clear();
  owned_.shrink_to_fit();
}

void Shard::detach() {
  if (!attached()) return;
  decltype(owned_) copy;
  copy.resize(static_cast<size_t>(rows_ * dim_));
  for (int64_t l = 0; l < rows_; ++l) std::memcpy(copy.data() + l * dim_, row(l), sizeof(float) * dim_);
  owned_ = std::move(copy);
  base_ = owned_.data();
  stride_ = 1;
  offset_ = 0;
}

void Shard::grow(int64_t rows, int64_t keep) {
  if (attached() || rows < rows_ || keep < 0 || keep > rows_) {
    throw PSError("table '" + table_ + "': cannot grow from " + std::to_string(rows_) + " to " +
                  std::to_string(rows) + " rows keeping " + std::to_string(keep) +
                  (attached() ? " (its rows are the caller's)" : ""));
  }
  const auto floats = static_cast<size_t>(rows * dim_), kept = static_cast<size_t>(keep * dim_);
  decltype(owned_) bigger;
  bigger.resize(floats);  // zeros, resident once written
  std::copy(owned_.begin(), owned_.begin() + kept, bigger.begin());
  owned_ = std::move(bigger);
  base_ = owned_.data();
  for (size_t k = 0; k < slots_.size(); ++k) {
    const float init = rule_->slot_init(static_cast<int>(k));
    decltype(owned_) slot;
    if (init == 0.0f) {
      slot.resize(floats);
    } else {
      slot.assign(floats, init);
    }
    std::copy(slots_[k].begin(), slots_[k].begin() + kept, slot.begin());
    slots_[k] = std::move(slot);
  }
  rows_ = rows;
}

void Shard::set_rule(std::unique_ptr<UpdateRule> rule) {
  rule_ = std::move(rule);
  slots_.clear();
  slots_.shrink_to_fit();
  const auto names = rule_->slot_names();
  for (size_t k = 0; k < names.size(); ++k) {
    const float init = rule_->slot_init(static_cast<int>(k));
    if (init == 0.0f) {
      slots_.emplace_back(static_cast<size_t>(rows_ * dim_));  // fresh zero pages, resident once written
    } else {
      slots_.emplace_back(static_cast<size_t>(rows_ * dim_), init);
    }
  }
}

namespace {

// Rows whose cache lines are requested this far ahead of their turn: a step's rows are scattered
// over a table much larger than the caches, so each one is a memory miss otherwise waited for.
constexpr int64_t kPrefetchAhead = 8;

inline void prefetch(const float* p, int64_t floats, int write) {
  for (int64_t j = 0; j < floats; j += 64 / static_cast<int64_t>(sizeof(float))) {
    if (write) {
      __builtin_prefetch(p + j, 1);
    } else {
      __builtin_prefetch(p + j, 0);
    }
  }
}

}  // namespace

void Shard::gather(const int64_t* local, int64_t n, float* out, int slot) const {
  for (int64_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) prefetch(row_of(slot, local[i + kPrefetchAhead]), dim_, 0);
    std::memcpy(out + i * dim_, row_of(slot, local[i]), sizeof(float) * dim_);
  }
}

void Shard::scatter(const int64_t* local, int64_t n, const float* values, int slot) {
  for (int64_t i = 0; i < n; ++i) std::memcpy(row_of(slot, local[i]), values + i * dim_, sizeof(float) * dim_);
}

void Shard::apply(const int64_t* local, int64_t n, const float* grads) {
  std::vector<float*> slot_rows(slots_.size());
  for (int64_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) {
      const int64_t ahead = local[i + kPrefetchAhead];
      prefetch(row(ahead), dim_, 1);
      for (auto& slot : slots_) prefetch(slot.data() + ahead * dim_, dim_, 1);
    }
    const int64_t offset = local[i] * dim_;
    for (size_t k = 0; k < slots_.size(); ++k) slot_rows[k] = slots_[k].data() + offset;
    rule_->apply(row(local[i]), slot_rows.data(), grads + i * dim_, dim_);
  }
}

int64_t Shard::row_bytes() const { return static_cast<int64_t>(sizeof(float) * owned_.size()); }

int64_t Shard::state_bytes() const {
  return static_cast<int64_t>(sizeof(float) * rows_ * dim_ * slots_.size());
}

}  // namespace hybridsync
