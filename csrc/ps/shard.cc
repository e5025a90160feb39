#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "shard.h"

#include "row_kernels.h"

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

namespace {

// A pull's gather: row local[i] (at base + local[i] * row_stride) into out row i, the rows a
// prefetch distance ahead requested meanwhile (they are scattered over a table much larger than
// the caches), each row copied inline.
HYBRIDSYNC_CLONED HYBRIDSYNC_INLINE_COPIES void gather_rows(const float* base, int64_t row_stride, const int64_t* local,
                                                            int64_t n, int64_t dim, float* out) {
  const int64_t distance = prefetch_rows_ahead(static_cast<int64_t>(sizeof(float)) * dim);
  int64_t i = 0;
  for (; i + distance < n; ++i, out += dim) {
    prefetch_row(base + local[i + distance] * row_stride, dim, false);
    copy_row(out, base + local[i] * row_stride, dim);
  }
  for (; i < n; ++i, out += dim) copy_row(out, base + local[i] * row_stride, dim);
}

}  // namespace

template struct ZeroPages<float>;
template struct ZeroPages<uint16_t>;

Shard::Shard(std::string table, int64_t rows, int64_t dim, std::unique_ptr<UpdateRule> rule, RowType type)
    : table_(std::move(table)), rows_(rows), dim_(dim), rule_(std::move(rule)), type_(type) {
  if (rows < 0 || dim < 1) {
    throw PSError("table '" + table_ + "': shape (" + std::to_string(rows) + ", " +
                  std::to_string(dim) + ") is not a valid (rows, dim)");
  }
  if (type_ == RowType::kFloat32) {
    owned_.resize(static_cast<size_t>(rows * dim));  // zeros, resident once written
    base_ = owned_.data();
  } else {
    half_.resize(static_cast<size_t>(rows * dim));  // (+0.0 in both 16-bit types)
  }
  set_rule(std::move(rule_));
}

void Shard::attach(float* base, int64_t stride, int64_t offset) {
  if (type_ != RowType::kFloat32) {
    throw PSError("table '" + table_ + "' stores " + row_type_name(type_) + " rows: it cannot alias a float32 replica");
  }
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
  if (type_ == RowType::kFloat32) {
    decltype(owned_) bigger;
    bigger.resize(floats);  // zeros, resident once written
    std::copy(owned_.begin(), owned_.begin() + kept, bigger.begin());
    owned_ = std::move(bigger);
    base_ = owned_.data();
  } else {
    decltype(half_) bigger;
    bigger.resize(floats);
    std::copy(half_.begin(), half_.begin() + kept, bigger.begin());
    half_ = std::move(bigger);
  }
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

void Shard::get_row(int64_t l, float* out) const {
  if (type_ == RowType::kFloat32) {
    std::memcpy(out, row(l), sizeof(float) * dim_);
  } else {
    decode_row(type_, half_.data() + l * dim_, out, dim_);
  }
}

void Shard::set_row(int64_t l, const float* values) {
  if (type_ == RowType::kFloat32) {
    std::memcpy(row(l), values, sizeof(float) * dim_);
  } else {
    encode_row(type_, values, half_.data() + l * dim_, dim_);
  }
}

void Shard::get_record(int64_t l, char* out) const {
  std::memcpy(out, raw_row(l), static_cast<size_t>(row_size()));
  out += row_size();
  for (const auto& slot : slots_) {
    std::memcpy(out, slot.data() + l * dim_, sizeof(float) * dim_);
    out += sizeof(float) * dim_;
  }
}

void Shard::set_record(int64_t l, const char* in) {
  std::memcpy(raw_row(l), in, static_cast<size_t>(row_size()));
  in += row_size();
  for (auto& slot : slots_) {
    std::memcpy(slot.data() + l * dim_, in, sizeof(float) * dim_);
    in += sizeof(float) * dim_;
  }
}

void Shard::reset_slots(int64_t l) {
  for (size_t k = 0; k < slots_.size(); ++k) {
    std::fill(slots_[k].data() + l * dim_, slots_[k].data() + (l + 1) * dim_, rule_->slot_init(static_cast<int>(k)));
  }
}

void Shard::rescale_accumulators(int64_t rows, float factor) {
  for (const int k : rule_->accumulating_slots()) {
    rescale_accumulated(slots_[static_cast<size_t>(k)].data(), rows * dim_, factor, rule_->slot_init(k));
  }
}

void Shard::rescale_record_accumulators(char* records, int64_t n, float factor) const {
  const std::vector<int> slots = rule_->accumulating_slots();
  if (slots.empty()) return;
  std::vector<float> values(static_cast<size_t>(dim_));
  const size_t bytes = static_cast<size_t>(dim_) * sizeof(float);
  for (int64_t i = 0; i < n; ++i) {
    for (const int k : slots) {  // (copied out: a 16-bit row of odd dim leaves the slots unaligned)
      char* at = records + i * record_size() + row_size() + static_cast<int64_t>(k) * static_cast<int64_t>(bytes);
      std::memcpy(values.data(), at, bytes);
      rescale_accumulated(values.data(), dim_, factor, rule_->slot_init(k));
      std::memcpy(at, values.data(), bytes);
    }
  }
}

std::vector<char> Shard::fresh_slots() const {
  std::vector<float> values;
  for (int k = 0; k < num_slots(); ++k) values.insert(values.end(), dim_, rule_->slot_init(k));
  std::vector<char> out(values.size() * sizeof(float));
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

void Shard::copy_row(int64_t from, int64_t to) {
  std::memcpy(raw_row(to), raw_row(from), static_cast<size_t>(row_size()));
  for (auto& slot : slots_) std::memcpy(slot.data() + to * dim_, slot.data() + from * dim_, sizeof(float) * dim_);
}

void Shard::gather(const int64_t* local, int64_t n, float* out, int slot) const {
  if (slot < 0 && type_ != RowType::kFloat32) {
    for (int64_t i = 0; i < n; ++i) get_row(local[i], out + i * dim_);
    return;
  }
  if (slot < 0) {
    gather_rows(base_ + offset_ * dim_, stride_ * dim_, local, n, dim_, out);
  } else {
    gather_rows(slots_[slot].data(), dim_, local, n, dim_, out);
  }
}

void Shard::gather_raw(const int64_t* local, int64_t n, char* out) const {
  if (type_ == RowType::kFloat32) {
    gather(local, n, reinterpret_cast<float*>(out));
    return;
  }
  const int64_t bytes = row_size();
  for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * bytes, raw_row(local[i]), static_cast<size_t>(bytes));
}

void Shard::scatter(const int64_t* local, int64_t n, const float* values, int slot) {
  if (slot < 0 && type_ != RowType::kFloat32) {
    for (int64_t i = 0; i < n; ++i) set_row(local[i], values + i * dim_);
    return;
  }
  for (int64_t i = 0; i < n; ++i) std::memcpy(row_of(slot, local[i]), values + i * dim_, sizeof(float) * dim_);
}

void Shard::apply(const int64_t* local, int64_t n, const float* grads, const int64_t* ids) {
  if (type_ != RowType::kFloat32) {
    std::vector<float*> slot_rows(slots_.size());
    // The rule runs on the row in float32; the result is rounded back into 16 bits.
    std::vector<float> work(static_cast<size_t>(dim_));
    const uint64_t key = rounding_.stochastic ? rounding_round_key(rounding_.seed, rule_->step()) : 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t l = local[i];
      for (size_t k = 0; k < slots_.size(); ++k) slot_rows[k] = slots_[k].data() + l * dim_;
      get_row(l, work.data());
      rule_->apply(work.data(), slot_rows.data(), grads + i * dim_, dim_);
      uint16_t* dst = half_.data() + l * dim_;
      if (rounding_.stochastic) {
        const int64_t id = ids ? ids[i] : l * rounding_.id_stride + rounding_.id_offset;
        encode_row_stochastic(type_, work.data(), dst, dim_, key, static_cast<uint64_t>(id));
      } else {
        encode_row(type_, work.data(), dst, dim_);
      }
    }
    return;
  }
  // One call for the whole batch: the rule's own loop (rows in place: row l at base_ + (l * stride_ + offset_) * dim_).
  std::vector<float*> slot_arrays(slots_.size());
  for (size_t k = 0; k < slots_.size(); ++k) slot_arrays[k] = slots_[k].data();
  RowBatch batch;
  batch.index = local;
  batch.n = n;
  batch.rows = base_ + offset_ * dim_;
  batch.row_stride = stride_ * dim_;
  batch.slots = slot_arrays.data();
  batch.num_slots = static_cast<int>(slots_.size());
  batch.grads = grads;
  batch.dim = dim_;
  rule_->apply_rows(batch);
}

void Shard::release(int slot, int64_t begin, int64_t n) {
  if (begin < 0 || n <= 0 || begin > rows_ - n) return;
  char* first = nullptr;
  int64_t bytes = 0;
  if (slot >= 0 && slot < num_slots()) {
    first = reinterpret_cast<char*>(slots_[slot].data() + begin * dim_);
    bytes = n * dim_ * static_cast<int64_t>(sizeof(float));
  } else if (slot < 0 && !half_.empty()) {
    first = reinterpret_cast<char*>(half_.data() + begin * dim_);
    bytes = n * dim_ * static_cast<int64_t>(sizeof(uint16_t));
  } else if (slot < 0 && !owned_.empty() && base_ == owned_.data()) {
    first = reinterpret_cast<char*>(owned_.data() + begin * dim_);
    bytes = n * dim_ * static_cast<int64_t>(sizeof(float));
  }
  if (first == nullptr) return;
  // Only pages wholly inside the range: a neighbour's rows share the edge pages.
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t from = (reinterpret_cast<uintptr_t>(first) + page - 1) & ~(page - 1);
  const uintptr_t to = (reinterpret_cast<uintptr_t>(first) + static_cast<uintptr_t>(bytes)) & ~(page - 1);
  if (to > from) madvise(reinterpret_cast<void*>(from), to - from, MADV_DONTNEED);  // advisory: a failure only costs memory
}

int64_t Shard::row_bytes() const {
  return static_cast<int64_t>(sizeof(float) * owned_.size() + sizeof(uint16_t) * half_.size());
}

int64_t Shard::state_bytes() const {
  return static_cast<int64_t>(sizeof(float) * rows_ * dim_ * slots_.size());
}

}  // namespace hybridsync
