// The "mpi" transport: nonblocking sends, matched probes, waits that yield the core.
#include "mpi_transport.h"

#include <climits>

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
}  // namespace

MPITransport::MPITransport(MPI_Comm comm, WaitPolicy policy) : policy_(policy) {
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
    wait_sends();
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

void MPITransport::send(int dest, int tag, std::vector<char> payload) {
  if (payload.size() > static_cast<size_t>(INT_MAX)) {
    throw PSError("hybridsync: a single PS message of " + std::to_string(payload.size()) +
                  " bytes exceeds MPI's 2 GiB limit; use more partitions or smaller batches");
  }
  if (dest == rank_) {
    to_self_[tag].push_back(std::move(payload));
    return;
  }
  reap_completed_sends();
  sends_.push_back(PendingSend{MPI_REQUEST_NULL, std::move(payload)});
  PendingSend& s = sends_.back();
  check_mpi(MPI_Isend(s.payload.data(), static_cast<int>(s.payload.size()), MPI_BYTE, dest, tag,
                      comm_, &s.request),
            "MPI_Isend");
  bytes_sent_ += static_cast<int64_t>(s.payload.size());
  ++messages_sent_;
}

std::vector<char> MPITransport::recv(int source, int tag) {
  if (source == rank_) {
    auto& queue = to_self_[tag];
    if (queue.empty()) throw PSTransportError("hybridsync: expected a message from this rank to itself");
    std::vector<char> data = std::move(queue.front());
    queue.pop_front();
    return data;
  }
  MPI_Message message;
  MPI_Status status;
  int found = 0;
  wait_until(
      [&] {
        check_mpi(MPI_Improbe(source, tag, comm_, &found, &message, &status), "MPI_Improbe");
        if (!found) reap_completed_sends();  // let our own sends progress while we wait
        return found != 0;
      },
      policy_, "a message from rank " + std::to_string(source), source);
  int count = 0;
  MPI_Get_count(&status, MPI_BYTE, &count);
  std::vector<char> data(static_cast<size_t>(count));
  check_mpi(MPI_Mrecv(data.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE), "MPI_Mrecv");
  bytes_received_ += count;
  return data;
}

void MPITransport::wait_sends() {
  wait_until(
      [&] {
        reap_completed_sends();
        return sends_.empty();
      },
      policy_, "sends to complete");
}

namespace {
// "mpi": config.native is the MPI_Comm* to duplicate.
const TransportRegistrar kMPITransport("mpi", [](const TransportConfig& config) -> std::unique_ptr<Transport> {
  if (!config.native) throw PSError("the mpi transport needs a communicator");
  return std::make_unique<MPITransport>(*static_cast<MPI_Comm*>(config.native), config.wait);
});
}  // namespace
}  // namespace hybridsync
