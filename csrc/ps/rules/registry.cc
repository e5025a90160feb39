// The update-rule registry (each rule's file registers itself) and what every rule shares.
#include <map>
#include <mutex>

#include "hybridsync/ps.h"

namespace hybridsync {
namespace {

// A function-local static, so registrations from other files' static initialisers always find
// it constructed, whatever the initialisation order.
std::map<std::string, UpdateRuleFactory>& registry() {
  static std::map<std::string, UpdateRuleFactory> rules;
  return rules;
}

std::mutex& registry_lock() {
  static std::mutex mu;
  return mu;
}

}  // namespace

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

void register_update_rule(const std::string& name, UpdateRuleFactory factory) {
  std::lock_guard<std::mutex> lock(registry_lock());
  registry()[name] = std::move(factory);
}

std::vector<std::string> update_rule_names() {
  std::lock_guard<std::mutex> lock(registry_lock());
  std::vector<std::string> names;
  for (const auto& entry : registry()) names.push_back(entry.first);
  return names;
}

std::unique_ptr<UpdateRule> make_update_rule(const std::string& name, const std::map<std::string, double>& hparams) {
  UpdateRuleFactory factory;
  {
    std::lock_guard<std::mutex> lock(registry_lock());
    auto it = registry().find(name);
    if (it != registry().end()) factory = it->second;
  }
  if (!factory) {
    std::string known;
    for (const auto& n : update_rule_names()) known += (known.empty() ? "" : ", ") + n;
    throw PSError("unknown server optimizer '" + name + "' (known: " + known + ")");
  }
  return factory(hparams);
}

}  // namespace hybridsync
