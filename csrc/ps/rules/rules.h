// Factories of the built-in update rules, one file each.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "hybridsync/ps.h"

namespace hybridsync {
std::unique_ptr<UpdateRule> make_sgd(const std::map<std::string, double>& hparams);
std::unique_ptr<UpdateRule> make_adagrad(const std::map<std::string, double>& hparams);
std::unique_ptr<UpdateRule> make_adam(const std::map<std::string, double>& hparams);
}  // namespace hybridsync
