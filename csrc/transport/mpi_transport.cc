// The "mpi" transport: nonblocking sends, matched probes, waits that yield the core.
#include "mpi_transport.h"

#include <algorithm>
#include <climits>

#include "fragments.h"
#include "hybridsync/ps.h"
#include "wait.h"

namespace hybridsync {

namespace {
void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw PSTransportError(std::string("hybridsync: ") + call + " failed: " + std::string(text, len));
}

// MPI counts bytes in an int.
constexpr int64_t kMPILimit = INT_MAX;
}  // namespace

MPITransport::MPITransport(MPI_Comm comm, WaitPolicy policy, int64_t max_message_bytes)
    : policy_(policy), limit_(max_message_bytes > 0 ? std::min(max_message_bytes, kMPILimit) : kMPILimit) {
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  if (level != MPI_THREAD_MULTIPLE) {
    // Each rank serves its shards from a thread of its own while Horovod's thread and the
    // caller's use MPI too.
    throw PSError("hybridsync's parameter server needs MPI initialised with MPI_THREAD_MULTIPLE; this process has "
                  "thread level " + std::to_string(level) + " (initialise MPI through hybridsync.init(), or set "
                  "mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI)");
  }
  check_mpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
  // Errors come back as return codes so they become Python exceptions, not aborts.
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

MPITransport::~MPITransport() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || comm_ == MPI_COMM_NULL) return;
  try {
    wait_until([&] { return sends_done(); }, policy_, "sends to complete");
  } catch (...) {
    // A peer is gone; nothing useful to do while tearing down.
  }
  MPI_Comm_free(&comm_);
}

void MPITransport::reap_completed_sends() {
  while (!sends_.empty()) {
    int done = 0;
    check_mpi(MPI_Test(&sends_.front().request, &done, MPI_STATUS_IGNORE), "MPI_Test");
    if (!done) return;
    sends_.pop_front();
  }
}

bool MPITransport::sends_done() {
  reap_completed_sends();
  return sends_.empty();
}

void MPITransport::isend(int dest, int tag, std::vector<char> fragment) {
  sends_.push_back(PendingSend{MPI_REQUEST_NULL, std::move(fragment)});
  PendingSend& s = sends_.back();
  check_mpi(MPI_Isend(s.payload.data(), static_cast<int>(s.payload.size()), MPI_BYTE, dest, tag, comm_, &s.request),
            "MPI_Isend");
  bytes_sent_ += static_cast<int64_t>(s.payload.size());
  largest_sent_ = std::max(largest_sent_, static_cast<int64_t>(s.payload.size()));
  ++messages_sent_;
}

void MPITransport::send(int dest, int tag, std::vector<char> payload) {
  if (dest == rank_) {
    to_self_[tag].push_back(std::move(payload));
    return;
  }
  reap_completed_sends();
  if (static_cast<int64_t>(payload.size()) < limit_) {
    isend(dest, tag, std::move(payload));
    return;
  }
  for (auto& fragment : split_message(std::move(payload), limit_)) isend(dest, tag, std::move(fragment));
}

std::vector<char> MPITransport::mrecv(MPI_Message* message, const MPI_Status& status) {
  int count = 0;
  MPI_Get_count(&status, MPI_BYTE, &count);
  std::vector<char> data(static_cast<size_t>(count));
  check_mpi(MPI_Mrecv(data.data(), count, MPI_BYTE, message, MPI_STATUS_IGNORE), "MPI_Mrecv");
  bytes_received_ += count;
  return data;
}

bool MPITransport::try_recv(int source, int tag, Message* out) {
  if (source == rank_ || source == kAnySource) {
    auto& queue = to_self_[tag];
    if (!queue.empty()) {
      out->source = rank_;
      out->data = std::move(queue.front());
      queue.pop_front();
      return true;
    }
    if (source == rank_) return false;
  }
  MPI_Message message;
  MPI_Status status;
  int found = 0;
  check_mpi(MPI_Improbe(source == kAnySource ? MPI_ANY_SOURCE : source, tag, comm_, &found, &message, &status),
            "MPI_Improbe");
  if (!found) {
    reap_completed_sends();  // let our own sends progress while we poll
    return false;
  }
  out->source = status.MPI_SOURCE;
  out->data = mrecv(&message, status);
  // The rest of a fragmented message is already on its way: wait for it here.
  for (size_t last = out->data.size(); message_continues(last, limit_);) {
    wait_until(
        [&] {
          check_mpi(MPI_Improbe(out->source, tag, comm_, &found, &message, &status), "MPI_Improbe");
          return found != 0;
        },
        policy_, "the rest of a message from rank " + std::to_string(out->source), out->source);
    std::vector<char> more = mrecv(&message, status);
    last = more.size();
    out->data.insert(out->data.end(), more.begin(), more.end());
  }
  return true;
}

namespace {
// "mpi": config.native is the MPI_Comm* to duplicate.
const TransportRegistrar kMPITransport("mpi", [](const TransportConfig& config) -> std::unique_ptr<Transport> {
  if (!config.native) throw PSError("the mpi transport needs a communicator");
  return std::make_unique<MPITransport>(*static_cast<MPI_Comm*>(config.native), config.wait,
                                        config.max_message_bytes);
});
}  // namespace
}  // namespace hybridsync
