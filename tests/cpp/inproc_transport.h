// "inproc": ranks as threads of one process, their messages in shared memory. The tests drive
// real Clients -- several ranks at once, each with its own serving thread -- without MPI; and it
// shows what a new transport takes: one class, one registration.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "hybridsync/ps.h"
#include "transport/transport.h"

namespace hybridsync {

// The shared mailboxes of one in-process job; `limit` > 0 fragments longer messages.
struct InprocHub {
  explicit InprocHub(int size, int64_t limit = 0) : size(size), limit(limit) {}
  int size;
  int64_t limit;
  std::mutex mu;
  std::map<std::pair<int, int>, std::deque<std::pair<int, std::vector<char>>>> boxes;  // (dest, tag) -> (source, data)
};

// What TransportConfig::native points at for "inproc".
struct InprocEndpoint {
  InprocHub* hub;
  int rank;
};

// One Client per rank on `hub`.
std::unique_ptr<Client> inproc_client(InprocHub& hub, int rank, bool serve_in_background = true,
                                      WaitPolicy policy = WaitPolicy{0.0, 100.0, 0.0, 20.0, 0.0});

// Runs body(rank, client) on `size` threads, one Client each; returns each rank's exception
// (null where it finished).
std::vector<std::exception_ptr> run_ranks(int size, const std::function<void(int, Client&)>& body,
                                          int64_t limit = 0, bool serve_in_background = true);

}  // namespace hybridsync
