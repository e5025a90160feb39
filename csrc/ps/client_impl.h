// What the Client's source files share and no one else needs: its tables, the push rounds
// waiting to be applied, the operation in flight, and the lock that serialises callers.
#pragma once

#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../transport/transport.h"
#include "dedup.h"
#include "hybridsync/ps.h"
#include "routing.h"
#include "trace.h"

namespace hybridsync {

// A registered table and this rank's part of it.
struct Table {
  TableSpec spec;
  Partitioner part;
  std::unique_ptr<Shard> shard;  // null when this rank holds no shard of the table
  RowAggregator sums;            // server side: a round's gradients summed over workers
  bool dropped = false;          // drop_table(): the handle stays taken, its use throws
};

// A push whose requests were sent but not yet received and applied by this rank's shards.
struct Round {
  float scale = 1.0f;
  std::map<int, double> lr;          // table -> learning rate for this round
  bool self_error_reported = false;  // this rank already threw for its own bad input
};

// One batch of a worker's operation, routed; for a push, `rows` are its unique ids' gradients.
struct Routed {
  int table;
  int64_t dim;
  Routing routing;
  const float* rows = nullptr;
  std::vector<float> summed;  // gradients of duplicate ids added up (only when there are some)
  float* out = nullptr;       // a pull's rows in input order (TableBatch::out)
};

// An operation between its start (requests sent) and its completion (replies collected).
struct InFlight {
  Client::Handle handle = -1;
  bool is_push = false;
  bool return_updates = false;
  std::vector<Routed> routed;
  std::vector<int> tables;  // push: the batches' tables, in order
  std::string local_error;
  bool index_error = false;
  bool applied = false;  // a push a world of one applied at once: nothing sent, nothing to queue
  Round round;
};

// An operation completed before its owner's Wait() (another caller needed the wire): what
// Wait() hands over, rows or the exception.
struct Finished {
  Completion done;
  std::exception_ptr error;
};

struct Client::Impl {
  std::unique_ptr<Transport> transport;
  std::vector<std::unique_ptr<Table>> tables;
  std::deque<Round> pending;            // pushes applied at the start of the next operation
  std::unique_ptr<InFlight> in_flight;  // at most one operation between start and Wait
  std::map<Handle, Finished> finished;  // completed early, not yet waited for
  Handle next_handle = 0;
  bool broken = false;
  std::string broken_reason;
  Tracer tracer;
  // Serialises every method; taken once per call, never inside a loop.
  mutable std::mutex mu;

  int rank() const { return transport->rank(); }
  int size() const { return transport->size(); }
  Table& table_at(int table) const;
  void check_usable() const;
  // What every collective does first: completes the operation in flight (keeping its outcome
  // for its Wait) and applies the pending pushes, so the wire carries one operation at a time.
  void begin_collective();
  // Before a local read or write of shard state: applies the pushes (and completes the
  // operation) already started, so a local write is never overwritten by an older push and a
  // read sees every step. Needs only what the peers sent when they started those operations.
  void settle() { guarded([&] { begin_collective(); }); }
  // Step 1 of a pull or push: routes the batches and sends every rank its request.
  std::unique_ptr<InFlight> start_pull(const std::vector<TableBatch>& batches, const std::string& error);
  std::unique_ptr<InFlight> start_push(const std::vector<TableBatch>& batches, float scale, bool return_updates,
                                       const std::string& error);
  // Serves the peers and collects the replies (steps 2 and 3); throws what the operation met.
  Completion finish(InFlight& op);
  Completion finish_pull(InFlight& op);
  Completion finish_push(InFlight& op);
  // Receives and applies one push round; with `updates`, also exchanges the changed rows.
  void apply_round(const Round& round, std::map<int, RowUpdates>* updates);
  // A world of one's push, applied from the caller's rows at once (throws on bad input, then
  // having changed no row).
  void apply_local(const std::vector<TableBatch>& batches, const Round& round);

  // Runs one collective step; a transport or protocol failure leaves the Client unusable,
  // because peers may be stuck half-way through the operation.
  template <class F>
  auto guarded(F&& body) -> decltype(body()) {
    check_usable();
    try {
      return body();
    } catch (const PSTransportError& e) {
      broken = true;
      broken_reason = e.what();
      throw;
    }
  }
};

// A request announcing that the sender's input was bad (so no rank waits for its data).
std::vector<char> error_request(const std::string& message);

// Throws the first error a peer announced (this rank's own is thrown by the caller).
void throw_remote(const std::vector<std::string>& errors, int self, const char* op);

// A server's sanity check of row positions a worker sent (they come from our partitioner).
void check_rows(const Shard* shard, const std::string& table, const int64_t* local, int64_t n, const char* op);

}  // namespace hybridsync
