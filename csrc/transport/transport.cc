// The transport registry: transports register by name, the Client's owner makes one by name.
#include "transport.h"

#include "util/registry.h"

namespace hybridsync {
namespace {

// Function-local, so registrations from other files' static initialisers find it constructed.
Registry<TransportFactory>& transports() {
  static Registry<TransportFactory> registry;
  return registry;
}

}  // namespace

void register_transport(const std::string& name, TransportFactory factory) {
  transports().add(name, std::move(factory));
}

std::unique_ptr<Transport> make_transport(const std::string& name, const TransportConfig& config) {
  return transports().find(name, "PS transport")(config);
}

}  // namespace hybridsync
