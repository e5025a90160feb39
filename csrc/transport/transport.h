// Point-to-point messaging for the Client. A transport delivers messages between ranks in
// order per (source, tag). Transports are made by name: adding one (e.g. TCP) is one .cc file
// implementing Transport plus one static TransportRegistrar line in it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace hybridsync {

// Message channels: requests (pulls, pushes) flow worker -> server in operation order,
// replies server -> worker, updates server -> replicas, control for table setup and state.
enum Tag : int { kTagRequest = 101, kTagReply = 102, kTagUpdates = 103, kTagControl = 104 };

// How waiting behaves: poll (yielding the core) for a while, then sleep with back-off, so an
// idle or waiting rank does not burn a core another rank needs. Spinning pays off when every
// rank has a core of its own; oversubscribed ranks should sleep at once (see hybridsync/ps.py).
struct WaitPolicy {
  double spin_us = 50.0;          // poll this long first
  double max_sleep_us = 200.0;    // back-off cap between polls
  double stall_warning_s = 60.0;  // print a warning naming the peer after this long
  double timeout_s = 600.0;       // give up (throw) after this long; <= 0 waits forever
  double peer_timeout_s = 60.0;   // a peer the heartbeat has not heard from this long fails the wait
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
  // Waits for the next message from `source` on `tag`, whatever its size.
  virtual std::vector<char> recv(int source, int tag) = 0;
  // Waits until every send started so far has completed.
  virtual void wait_sends() = 0;
  // Traffic counters (messages a rank sends itself may be left out), for benchmarks.
  virtual int64_t bytes_sent() const = 0;
  virtual int64_t bytes_received() const = 0;
  virtual int64_t messages_sent() const = 0;
  virtual void reset_counters() = 0;
};

// What a transport is made from: the caller's native endpoint (an MPI_Comm* for "mpi") and
// how its waits behave.
struct TransportConfig {
  void* native = nullptr;
  WaitPolicy wait;
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
