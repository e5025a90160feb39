// One table's rows held by this rank, with their optimizer state.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "half.h"
#include "update_rule.h"

namespace hybridsync {

// Memory that reads as zeros and costs nothing until written: blocks of 1 MiB and more come
// straight from mmap (untouched pages, huge ones where granted), smaller ones from calloc. Default construction writes
// nothing, so a fresh vector<T, ZeroPages<T>>(n) holds n zeros and no resident memory yet: a
// shard's rows become resident as they are written (a table being loaded from a whole copy
// does not hold the shard and the copy at once). Only fresh allocations are zero: grow such a
// vector with resize() only from empty.
template <class T>
struct ZeroPages {
  using value_type = T;
  static constexpr size_t kMmapBytes = size_t{1} << 20;
  ZeroPages() = default;
  template <class U>
  ZeroPages(const ZeroPages<U>&) noexcept {}
  T* allocate(size_t n);
  void deallocate(T* p, size_t n) noexcept;
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <class U>
  void construct(U*) noexcept {}  // the zeros are already there
  template <class U>
  bool operator==(const ZeroPages<U>&) const noexcept { return true; }
  template <class U>
  bool operator!=(const ZeroPages<U>&) const noexcept { return false; }
};

// How a shard rounds the values its rule computes into 16-bit rows: to nearest even, or
// stochastically with bits drawn from (seed, row id, step) -- the same at any world size. A fixed
// table's row l has id l * id_stride + id_offset; a dynamic arena's callers pass the ids.
struct Rounding {
  bool stochastic = false;
  uint64_t seed = 0;
  int64_t id_stride = 1, id_offset = 0;
};

// An accumulating slot's values (UpdateRule::accumulating_slots) rescaled for a new batch size:
// what was accumulated above its initial value `base` is multiplied by `factor`, so a value still
// at its initial value stays exactly that (and is not even written: untouched pages stay
// untouched). With base 0 it is a plain product, the same float as value * factor anywhere.
inline void rescale_accumulated(float* values, int64_t n, float factor, float base) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = values[i];
    if (v == base) continue;
    values[i] = base == 0.0f ? v * factor : base + factor * (v - base);
  }
}

// Rows are owned, or alias a caller's full-table buffer (row l at base + (l*stride + offset)*dim).
// Rows are float32, float16 or bfloat16 (row_type); optimizer slots are always float32. The
// float views (row(), row_of() for rows) exist for float32 rows only; gather, scatter and
// apply work for every type. The Client serialises access.
class Shard {
 public:
  Shard(std::string table, int64_t rows, int64_t dim, std::unique_ptr<UpdateRule> rule,
        RowType type = RowType::kFloat32);
  // The table's name, for errors (known only after the model is built).
  const std::string& table() const { return table_; }
  void rename(std::string table) { table_ = std::move(table); }
  int64_t rows() const { return rows_; }
  int64_t dim() const { return dim_; }
  UpdateRule& rule() { return *rule_; }
  const UpdateRule& rule() const { return *rule_; }
  RowType row_type() const { return type_; }
  // Bytes of one stored row (in its row type).
  int64_t row_size() const { return dim_ * row_type_bytes(type_); }
  void set_rounding(const Rounding& r) { rounding_ = r; }
  const Rounding& rounding() const { return rounding_; }
  // Local row l (float32 rows only); inline because the hot loops call it per row.
  float* row(int64_t l) { return base_ + (l * stride_ + offset_) * dim_; }
  const float* row(int64_t l) const { return base_ + (l * stride_ + offset_) * dim_; }
  // Local row l of the rows (slot < 0: float32 rows only) or of optimizer slot `slot`.
  float* row_of(int slot, int64_t l) { return slot < 0 ? row(l) : slot_row(slot, l); }
  const float* row_of(int slot, int64_t l) const { return slot < 0 ? row(l) : slots_[slot].data() + l * dim_; }
  // Row l's bytes as stored (row_size() of them), any row type: copied whole between places.
  char* raw_row(int64_t l) {
    return type_ == RowType::kFloat32 ? reinterpret_cast<char*>(row(l)) : reinterpret_cast<char*>(half_.data() + l * dim_);
  }
  const char* raw_row(int64_t l) const { return const_cast<Shard*>(this)->raw_row(l); }
  // Row l as float32 values, and overwriting it from float32 values (rounded to nearest even).
  void get_row(int64_t l, float* out) const;
  void set_row(int64_t l, const float* values);
  // Copies rows local[i] (slot < 0) or slot values to out[i*dim...] as float32, or overwrites
  // them from values[i*dim...] (rows rounded to nearest even).
  void gather(const int64_t* local, int64_t n, float* out, int slot = -1) const;
  void scatter(const int64_t* local, int64_t n, const float* values, int slot = -1);
  // Copies rows local[i] as stored (row_size() bytes each) to out: what goes on the wire.
  void gather_raw(const int64_t* local, int64_t n, char* out) const;
  // Row l with its optimizer slots as one record of record_size() bytes (the row as stored,
  // then each slot's float32 values): how a disk tier keeps it.
  int64_t record_size() const { return row_size() + dim_ * static_cast<int64_t>(sizeof(float) * slots_.size()); }
  void get_record(int64_t l, char* out) const;
  void set_record(int64_t l, const char* in);
  // Gives row l fresh optimizer slots (their initial values).
  void reset_slots(int64_t l);
  // The rule's accumulating slots of rows [0, rows) rescaled by `factor` (rescale_accumulated).
  void rescale_accumulators(int64_t rows, float factor);
  // The same for n records laid out as get_record() writes them (a disk tier's).
  void rescale_record_accumulators(char* records, int64_t n, float factor) const;
  // Fresh optimizer slots of one row, as the tail of a record (see get_record).
  std::vector<char> fresh_slots() const;
  // Row `to` (and its slots) becomes a copy of row `from`.
  void copy_row(int64_t from, int64_t to);
  // Runs the rule on unique rows local[i] with gradients grads[i*dim...] (no begin_step()).
  // 16-bit rows are updated in float32 and rounded back (ids[i]: row i's id for stochastic
  // rounding; nullptr: from the Rounding's stride and offset).
  void apply(const int64_t* local, int64_t n, const float* grads, const int64_t* ids = nullptr);
  // Owned rows only: `rows` rows (more than now), the first `keep` rows and their slot values
  // kept, the others zero (slots: their initial value). The rule stays, with its step and the
  // constants its begin_step() computed, so a dynamic table may grow in the middle of a round.
  void grow(int64_t rows, int64_t keep);
  // Replaces the optimizer; its state slots start fresh.
  void set_rule(std::unique_ptr<UpdateRule> rule);
  // Rows live in the caller's memory until detach() copies them back into owned memory
  // (float32 rows only).
  void attach(float* base, int64_t stride, int64_t offset);
  void detach();
  bool attached() const { return type_ == RowType::kFloat32 && owned_.empty() && rows_ > 0; }
  // Optimizer state slot k (rows x dim, row-major), for checkpoints.
  float* slot(int k) { return slots_[k].data(); }
  const float* slot(int k) const { return slots_[k].data(); }
  int num_slots() const { return static_cast<int>(slots_.size()); }
  // Gives the memory of owned rows [begin, begin + n) (slot < 0) or of those rows' optimizer
  // slot back to the system: they read as zeros afterwards. For a table about to be dropped
  // whose rows went elsewhere (a hand-over read); rows aliasing a caller's buffer stay.
  void release(int slot, int64_t begin, int64_t n);
  // Bytes held by owned rows (0 when attached), and by the optimizer state.
  int64_t row_bytes() const;
  int64_t state_bytes() const;

 private:
  float* slot_row(int slot, int64_t l) { return slots_[slot].data() + l * dim_; }
  std::string table_;
  int64_t rows_, dim_;
  std::unique_ptr<UpdateRule> rule_;
  RowType type_;
  Rounding rounding_;
  std::vector<float, ZeroPages<float>> owned_;    // float32 rows
  std::vector<uint16_t, ZeroPages<uint16_t>> half_;  // 16-bit rows
  float* base_ = nullptr;
  int64_t stride_ = 1, offset_ = 0;
  std::vector<std::vector<float, ZeroPages<float>>> slots_;  // zero-initialised ones cost nothing until written
};

}  // namespace hybridsync
