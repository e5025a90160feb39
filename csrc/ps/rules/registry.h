// How update rules join the registry: each rule's .cc file adds its factory with one static
// UpdateRuleRegistrar, so a new rule is one file; make_update_rule (ps.h) looks names up.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "../update_rule.h"

namespace hybridsync {

// Makes a rule from its hyper-parameters (throws PSError naming unknown keys or bad values).
using UpdateRuleFactory = std::function<std::unique_ptr<UpdateRule>(const std::map<std::string, double>&)>;

// Adds a rule under `name`.
void register_update_rule(const std::string& name, UpdateRuleFactory factory);

// A static object whose construction registers a rule.
struct UpdateRuleRegistrar {
  UpdateRuleRegistrar(const char* name, UpdateRuleFactory factory) { register_update_rule(name, std::move(factory)); }
};

}  // namespace hybridsync
