// A name -> factory table filled by static initialisers, one registration line per
// implementation (transports, update rules), so adding one never means editing a list.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "hybridsync/ps.h"

namespace hybridsync {

template <class Factory>
class Registry {
 public:
  // Adds (or replaces) `name`.
  void add(const std::string& name, Factory factory) {
    std::lock_guard<std::mutex> lock(mu_);
    entries_[name] = std::move(factory);
  }
  // The factory of `name`; unknown names throw PSError "unknown <what> 'name' (known: a, b)".
  Factory find(const std::string& name, const std::string& what) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(name);
    if (it != entries_.end()) return it->second;
    std::string known;
    for (const auto& entry : entries_) known += (known.empty() ? "" : ", ") + entry.first;
    throw PSError("unknown " + what + " '" + name + "' (known: " + known + ")");
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, Factory> entries_;  // ordered: the known names print sorted
};

}  // namespace hybridsync
