// Liveness of the other ranks, independent of Python and of whatever operation is waiting: a
// thread of its own sends every peer a one-byte message every interval on a communicator of its
// own and notes when each peer's last one arrived. It needs neither the GIL nor a spinning core
// (it sleeps between rounds), so a rank busy in Python still beats, and one that is frozen
// (SIGSTOP), dead or cut off from the network falls silent.
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

namespace hybridsync {

// A silent peer, as silent_peers() reports it.
struct SilentPeer {
  int rank;
  std::string host;
  double seconds;
};

// Collective on `comm`: starts the heartbeat (once per process; the host names are exchanged
// here). interval_s: how often every peer is told this rank is alive. abort_after_s > 0 makes
// the thread a watchdog too: a peer silent that long ends the job (MPI_Abort) with a message
// naming it, whatever this rank is blocked in (a Horovod collective, user MPI code).
void start_heartbeat(MPI_Comm comm, double interval_s, double abort_after_s = 0.0);
// Tells every peer this rank is leaving (it is then never reported silent), stops the thread
// and frees its communicator (at shutdown).
void stop_heartbeat();
// Peers not heard from for longer than timeout_s (none when no heartbeat runs).
std::vector<SilentPeer> silent_peers(double timeout_s);
// Peers that shut down (said goodbye) more than min_s ago; `seconds` is how long ago. A rank
// waiting for a collective one of them belongs to can stop waiting: it will never come.
std::vector<SilentPeer> departed_peers(double min_s);
// Seconds since `peer` was last heard from (0 when no heartbeat runs).
double silent_for(int peer);
// The host `peer` runs on ("?" when unknown).
std::string host_of(int peer);

}  // namespace hybridsync
