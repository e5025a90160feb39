// The update-rule registry behind make_update_rule.
#include "registry.h"

#include "util/registry.h"

namespace hybridsync {
namespace {

// Function-local, so registrations from other files' static initialisers find it constructed.
Registry<UpdateRuleFactory>& rules() {
  static Registry<UpdateRuleFactory> registry;
  return registry;
}

}  // namespace

void register_update_rule(const std::string& name, UpdateRuleFactory factory) {
  rules().add(name, std::move(factory));
}

std::unique_ptr<UpdateRule> make_update_rule(const std::string& name, const std::map<std::string, double>& hparams) {
  return rules().find(name, "server optimizer")(hparams);
}

std::map<std::string, double> resolve_rule(const std::string& rule, const std::map<std::string, double>& given) {
  return make_update_rule(rule, given)->hyperparameters();
}

}  // namespace hybridsync
