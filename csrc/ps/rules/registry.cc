#include "rules.h"

namespace hybridsync {

std::unique_ptr<UpdateRule> make_update_rule(const std::string& name,
                                             const std::map<std::string, double>& hparams) {
  if (name == "sgd") return make_sgd(hparams);
  if (name == "adagrad") return make_adagrad(hparams);
  if (name == "adam") return make_adam(hparams);
  throw PSError("unknown server optimizer '" + name + "' (known: sgd, adagrad, adam)");
}

}  // namespace hybridsync
