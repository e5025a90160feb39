#include "rules.h"

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

std::unique_ptr<UpdateRule> make_update_rule(const std::string& name,
                                             const std::map<std::string, double>& hparams) {
  if (name == "sgd") return make_sgd(hparams);
  if (name == "adagrad") return make_adagrad(hparams);
  if (name == "adam") return make_adam(hparams);
  throw PSError("unknown server optimizer '" + name + "' (known: sgd, adagrad, adam)");
}

}  // namespace hybridsync
