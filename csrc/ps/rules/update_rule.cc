// What every update rule shares: the batch loop of a rule that updates one row at a time, and
// changing a hyper-parameter without leaving a bad value behind.
#include "../update_rule.h"

#include <vector>

#include "row_loop.h"

namespace hybridsync {

void UpdateRule::apply_rows(const RowBatch& batch) const {
  std::vector<float*> slots(static_cast<size_t>(batch.num_slots));
  for_each_row(batch, [&](float* row, int64_t offset, const float* grad, int64_t) {
    for (int k = 0; k < batch.num_slots; ++k) slots[k] = batch.slots[k] + offset;
    apply(row, slots.data(), grad, batch.dim);
  });
}

void UpdateRule::set_hyperparameter(const std::string& key, double value) {
  auto it = hp_.find(key);
  if (it == hp_.end()) {
    throw PSError("server optimizer '" + name() + "' has no hyper-parameter '" + key + "'");
  }
  const double old = it->second;
  it->second = value;
  try {
    validate();
  } catch (...) {
    it->second = old;
    throw;
  }
}

}  // namespace hybridsync
