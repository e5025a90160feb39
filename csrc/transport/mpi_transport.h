// Transport over MPI point-to-point calls on a communicator of the PS's own.
#pragma once

#include <mpi.h>

#include <deque>
#include <map>

#include "transport.h"

namespace hybridsync {

class MPITransport : public Transport {
 public:
  // Duplicates `comm`, so PS traffic never matches messages of Horovod or of the caller.
  MPITransport(MPI_Comm comm, WaitPolicy policy, int64_t max_message_bytes);
  ~MPITransport() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void send(int dest, int tag, std::vector<char> payload) override;
  bool try_recv(int source, int tag, Message* out) override;
  bool sends_done() override;
  int64_t max_message_bytes() const override { return limit_; }
  WaitPolicy wait_policy() const override { return policy_; }
  int64_t bytes_sent() const override { return bytes_sent_; }
  int64_t bytes_received() const override { return bytes_received_; }
  int64_t messages_sent() const override { return messages_sent_; }
  int64_t largest_message_sent() const override { return largest_sent_; }
  void reset_counters() override { bytes_sent_ = bytes_received_ = messages_sent_ = largest_sent_ = 0; }

 private:
  struct PendingSend {
    MPI_Request request;
    std::vector<char> payload;
  };
  void isend(int dest, int tag, std::vector<char> fragment);
  std::vector<char> mrecv(MPI_Message* message, const MPI_Status& status);
  void reap_completed_sends();
  // Messages a rank sends itself skip MPI (and are not counted as traffic).
  std::map<int, std::deque<std::vector<char>>> to_self_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  WaitPolicy policy_;
  int64_t limit_;
  std::deque<PendingSend> sends_;
  int64_t bytes_sent_ = 0, bytes_received_ = 0, messages_sent_ = 0, largest_sent_ = 0;
};

}  // namespace hybridsync
