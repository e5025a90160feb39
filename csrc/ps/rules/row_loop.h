// The loop of every rule's apply_rows: a batch's rows in order, each row's lines and its slots'
// requested ahead of its turn, and the rule's per-row update inlined into the loop.
#pragma once

#include <cstdint>

#include "../row_kernels.h"
#include "../update_rule.h"

namespace hybridsync {

// Calls update(row, slot_offset, grad) on each row of `batch`: row i's values, the offset of its
// values in every slot array (slot k's are batch.slots[k] + slot_offset), its summed gradient.
template <class Update>
inline void for_each_row(const RowBatch& batch, Update&& update) {
  const int64_t dim = batch.dim;
  const int64_t distance = prefetch_rows_ahead(static_cast<int64_t>(sizeof(float)) * dim * (1 + batch.num_slots));
  for (int64_t i = 0; i < batch.n; ++i) {
    if (i + distance < batch.n) {
      const int64_t ahead = batch.index[i + distance];
      prefetch_row(batch.rows + ahead * batch.row_stride, dim, true);
      for (int k = 0; k < batch.num_slots; ++k) prefetch_row(batch.slots[k] + ahead * dim, dim, true);
    }
    const int64_t l = batch.index[i];
    update(batch.rows + l * batch.row_stride, l * dim, batch.grads + i * dim);
  }
}

}  // namespace hybridsync
