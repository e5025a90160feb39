// What every update rule shares: changing a hyper-parameter without leaving a bad value behind.
#include "../update_rule.h"

namespace hybridsync {

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
