// Reading hyper-parameters for update rules: defaults, and errors naming unknown keys.
#pragma once

#include <map>
#include <string>

#include "../update_rule.h"

namespace hybridsync {

// Fills defaults and rejects keys the rule does not know, naming them.
inline std::map<std::string, double> resolve_hparams(
    const std::string& rule, const std::map<std::string, double>& given,
    const std::map<std::string, double>& defaults) {
  std::map<std::string, double> out = defaults;
  for (const auto& [key, value] : given) {
    if (!defaults.count(key)) {
      std::string known;
      for (const auto& [k, v] : defaults) known += (known.empty() ? "" : ", ") + k;
      throw PSError("unknown hyper-parameter '" + key + "' for server optimizer '" + rule +
                    "' (known: " + known + ")");
    }
    out[key] = value;
  }
  return out;
}

// Throws unless `value` is > 0 (or >= 0 with allow_zero).
inline void require_positive(const std::string& rule, const std::string& key, double value,
                             bool allow_zero = false) {
  if (value > 0 || (allow_zero && value == 0)) return;
  throw PSError("server optimizer '" + rule + "': " + key + " must be " +
                (allow_zero ? ">= 0" : "> 0") + ", got " + std::to_string(value));
}

}  // namespace hybridsync
