#include "transport.h"

#include <map>
#include <mutex>

#include "hybridsync/ps.h"

namespace hybridsync {
namespace {

// A function-local static, so registrations from other files' static initialisers always find
// it constructed, whatever the initialisation order.
std::map<std::string, TransportFactory>& registry() {
  static std::map<std::string, TransportFactory> transports;
  return transports;
}

std::mutex& registry_lock() {
  static std::mutex mu;
  return mu;
}

}  // namespace

void register_transport(const std::string& name, TransportFactory factory) {
  std::lock_guard<std::mutex> lock(registry_lock());
  registry()[name] = std::move(factory);
}

std::vector<std::string> transport_names() {
  std::lock_guard<std::mutex> lock(registry_lock());
  std::vector<std::string> names;
  for (const auto& entry : registry()) names.push_back(entry.first);
  return names;
}

std::unique_ptr<Transport> make_transport(const std::string& name, const TransportOptions& options) {
  TransportFactory factory;
  {
    std::lock_guard<std::mutex> lock(registry_lock());
    auto it = registry().find(name);
    if (it != registry().end()) factory = it->second;
  }
  if (!factory) {
    std::string known;
    for (const auto& n : transport_names()) known += (known.empty() ? "" : ", ") + n;
    throw PSError("unknown PS transport '" + name + "' (known: " + known + ")");
  }
  return factory(options);
}

}  // namespace hybridsync
