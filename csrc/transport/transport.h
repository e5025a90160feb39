// Point-to-point messaging for the Client. A transport delivers messages between ranks in
// order per (source, tag), of any size: a message longer than the transport's limit travels as
// fragments of the limit's size, so no single message of the underlying network ever exceeds
// it. Transports are made by name: adding one (e.g. TCP) is one .cc file implementing
// Transport plus one static TransportRegistrar line in it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hybridsync/ps.h"

namespace hybridsync {

// Message channels: requests flow worker -> server, replies server -> worker, control between
// workers (table setup).
enum Tag : int { kTagRequest = 101, kTagReply = 102, kTagControl = 104 };
// try_recv from whichever rank has a message.
constexpr int kAnySource = -1;

// A received message and who sent it.
struct Message {
  int source = -1;
  std::vector<char> data;
};

// The Client's only view of the network, so the PS core does not depend on MPI.
class Transport {
 public:
  virtual ~Transport() = default;
  // This rank and the number of ranks.
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Starts sending `payload` to `dest`; the transport keeps the buffer until it is delivered.
  virtual void send(int dest, int tag, std::vector<char> payload) = 0;
  // The next whole message from `source` (or kAnySource) on `tag`, if one has arrived.
  virtual bool try_recv(int source, int tag, Message* out) = 0;
  // Lets sends started so far make progress; true when all have completed.
  virtual bool sends_done() = 0;
  // The largest message the network carries whole (longer ones are fragmented).
  virtual int64_t max_message_bytes() const = 0;
  // How waits on this transport behave.
  virtual WaitPolicy wait_policy() const = 0;
  // Traffic counters (messages a rank sends itself may be left out), for benchmarks and tests.
  virtual int64_t bytes_sent() const = 0;
  virtual int64_t bytes_received() const = 0;
  virtual int64_t messages_sent() const = 0;
  virtual int64_t largest_message_sent() const = 0;  // one network message (a fragment)
  virtual void reset_counters() = 0;
};

// What a transport is made from: the caller's native endpoint (an MPI_Comm* for "mpi"), how
// its waits behave and its message size limit (<= 0: the network's own).
struct TransportConfig {
  void* native = nullptr;
  WaitPolicy wait;
  int64_t max_message_bytes = 0;
};

// Makes one transport from its config (registered under a name).
using TransportFactory = std::function<std::unique_ptr<Transport>(const TransportConfig&)>;

// Adds a transport under `name`; each transport's .cc file does so with one static
// TransportRegistrar, so a new transport is one file and no list to edit.
void register_transport(const std::string& name, TransportFactory factory);
struct TransportRegistrar {
  TransportRegistrar(const char* name, TransportFactory factory) { register_transport(name, std::move(factory)); }
};

// Makes the transport registered as `name`; unknown names throw PSError listing the known ones.
std::unique_ptr<Transport> make_transport(const std::string& name, const TransportConfig& config);

}  // namespace hybridsync
