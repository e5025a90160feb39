// Deduplication of a batch's ids, and summing the gradient rows that share a row: the hot
// loops of every pull and push, shared by the client (before sending), the servers (across
// workers) and the single-shard test helper, so there is one implementation of each.
#pragma once

#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "shard.h"
#include "id_index.h"

namespace hybridsync {

// Throws PSIndexError naming `table` and the first id outside [0, num_rows) (none: num_rows < 0).
void check_ids(const std::string& table, const int64_t* ids, int64_t n, int64_t num_rows);

// ids[i] -> unique[inverse[i]], unique ids in first-seen order.
struct Dedup {
  std::vector<int64_t> unique;
  std::vector<int64_t> inverse;
};
// Validates 0 <= id < num_rows (PSIndexError naming `table` and the id) and deduplicates.
Dedup deduplicate(const std::string& table, const int64_t* ids, int64_t n, int64_t num_rows);

// The allocator of buffers that are written in full before they are read: resize() leaves new
// elements unwritten, so a fresh buffer costs no zero-fill pass over memory.
template <class T>
struct Unzeroed : std::allocator<T> {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = Unzeroed<U>;
  };
  Unzeroed() = default;
  template <class U>
  Unzeroed(const Unzeroed<U>&) noexcept {}
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;  // default-initialised: a float is left as it is
  }
};
using GradientBuffer = std::vector<float, Unzeroed<float>>;

// A worker's gradients (n x dim, one row per input id) added up per unique id of `dedup`, so
// each row crosses the wire once: row u of *out (resized to unique x dim; reuse one buffer
// request after request) sums the rows i with inverse[i] == u. Each row's first gradient is
// copied, the others added: nothing is zero-filled first.
void sum_duplicates(const Dedup& dedup, const float* grads, int64_t dim, GradientBuffer* out);

// deduplicate() and sum_duplicates() in one pass over the ids (a push's hot loop): each
// gradient row is added into its unique row as its id is indexed, in input order, so the sums
// are the floats sum_duplicates() gives. *unique gets deduplicate()'s unique ids (no inverse: a
// push maps no rows back). Returns the summed rows (unique x dim): `grads` itself while no id
// repeats -- the rows before the first repeat are unique rows 0, 1, ... already, so they are
// copied into *sums only when a repeat comes, and a batch without one copies nothing.
const float* deduplicate_and_sum(const std::string& table, const int64_t* ids, int64_t n, int64_t num_rows,
                                 const float* grads, int64_t dim, std::vector<int64_t>* unique, GradientBuffer* sums);

// Gradient rows from one source (a worker's request, or a caller): rows[i] gets grads[i*dim...].
struct GradientRows {
  const int64_t* rows = nullptr;
  int64_t n = 0;
  const float* grads = nullptr;
};

// A shard's optimizer step over gradients from any number of sources. Reused round after
// round, so its buffers are allocated once.
class RowAggregator {
 public:
  // Sums the sources' gradients per row (in source order, so every run adds in the same order;
  // rows may repeat within and across sources), multiplies the sums by `scale`, then runs one
  // step of `shard`'s rule, once per distinct row. Row indices must be valid.
  void step(Shard& shard, const std::vector<GradientRows>& sources, float scale);
  // The same sums and statistics without running the rule (a dynamic table runs its own step).
  void sum(int64_t dim, const std::vector<GradientRows>& sources, float scale);
  // The sums of the last sum()/step(), size() x dim rows. While no row repeats in a lone source
  // and scale is 1 these are that source's gradients, read in place (nothing copied): valid
  // while the sources are.
  const float* sums() const { return in_place_ ? in_place_ : sums_.data(); }
  // The distinct rows of the last step (first-seen order), e.g. to send replicas.
  int64_t size() const { return static_cast<int64_t>(rows_.size()); }
  const int64_t* rows() const { return rows_.data(); }
  // Gradient statistics of the last step, before `scale`: the sum over sources of each
  // source's squared norm, and the squared norm of their sum (what the noise scale needs).
  // Computed only while statistics are on (the adaptive batch size reads them); 0 otherwise.
  double local_sq() const { return local_sq_; }
  double combined_sq() const { return combined_sq_; }
  void set_statistics(bool on) { statistics_ = on; }
  bool statistics() const { return statistics_; }

 private:
  IdIndex index_;
  std::vector<int64_t> rows_;
  GradientBuffer sums_;  // (written in full before read: growing it zero-fills nothing)
  const float* in_place_ = nullptr;  // the lone source's gradients, when they are the sums
  int64_t dim_ = 1;
  bool statistics_ = false;
  double local_sq_ = 0.0, combined_sq_ = 0.0;
};

}  // namespace hybridsync
