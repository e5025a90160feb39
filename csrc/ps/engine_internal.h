// What the Engine's source files share and no one else needs.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "hybridsync/ps.h"
#include "id_index.h"

namespace hybridsync {

struct Engine::Table {
  TableSpec spec;
  Partitioner part;
  std::unique_ptr<Shard> shard;  // null when this rank holds no shard of the table
  // Server-side scratch for summing a round's gradients over workers, reused every round.
  IdIndex sum_index;
  std::vector<int64_t> sum_rows;
  std::vector<float> sum_grads;
};

// A push whose requests were sent but not yet received and applied by this rank's shards.
struct Engine::Round {
  float scale = 1.0f;
  std::map<int, double> lr;          // table -> learning rate for this round
  bool self_error_reported = false;  // this rank already threw for its own bad input
};

// steady_clock now, in nanoseconds (CLOCK_MONOTONIC on Linux, as Python's perf_counter_ns).
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A request announcing that the sender's input was bad (so no rank waits for its data).
std::vector<char> error_request(const std::string& message);

// Throws the first error a peer announced (this rank's own is thrown by the caller).
void throw_remote(const std::vector<std::string>& errors, int self, const char* op);

// A server's sanity check of row positions a worker sent (they come from our partitioner).
void check_rows(const Shard* shard, const std::string& table, const int64_t* local, int64_t n, const char* op);

// Runs one collective operation; a transport or protocol failure leaves the Engine unusable,
// because peers may be stuck half-way through the operation.
template <class F>
auto guarded(bool& broken, std::string& reason, F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const PSTransportError& e) {
    broken = true;
    reason = e.what();
    throw;
  }
}

}  // namespace hybridsync
