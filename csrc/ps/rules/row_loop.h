// The loop of every rule's apply_rows: a batch's rows in order, each row's lines and its slots'
// requested ahead of its turn, and the rule's per-row update inlined into the loop.
#pragma once

#include <cstdint>

#include "../row_kernels.h"
#include "../update_rule.h"

namespace hybridsync {

// Calls update(row, slot_offset, grad, dim) on each row of `batch`: row i's values, the offset
// of its values in every slot array (slot k's are batch.slots[k] + slot_offset), its summed
// gradient, and the row width -- a constant for the common widths (with_row_width), so the
// rule's per-row loop is built for it: unrolled, no trip-count or remainder code per row.
template <class Update>
__attribute__((always_inline)) inline void for_each_row(const RowBatch& batch, Update&& update) {
  with_row_width(batch.dim, [&](auto width) __attribute__((always_inline)) {
    constexpr int64_t kWidth = decltype(width)::value;
    const int64_t dim = kWidth ? kWidth : batch.dim;
    const int64_t distance = prefetch_rows_ahead(static_cast<int64_t>(sizeof(float)) * dim * (1 + batch.num_slots));
    for (int64_t i = 0; i < batch.n; ++i) {
      if (i + distance < batch.n) {
        const int64_t ahead = batch.index[i + distance];
        prefetch_row(batch.rows + ahead * batch.row_stride, dim, true);
        for (int k = 0; k < batch.num_slots; ++k) prefetch_row(batch.slots[k] + ahead * dim, dim, true);
      }
      const int64_t l = batch.index[i];
      update(batch.rows + l * batch.row_stride, l * dim, batch.grads + i * dim, dim);
    }
  });
}

}  // namespace hybridsync
