// Liveness of the other ranks, independent of Python and of whatever operation is waiting: a
// thread of its own tells every peer this rank is alive and notes when each peer was last heard
// from, so a peer that is frozen, dead or cut off is named instead of hanging the job, and a
// peer that leaves normally says goodbye. Implemented in csrc/transport/heartbeat.cc.
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
// Seconds since `peer` was last heard from (0 when no heartbeat runs).
double silent_for(int peer);
// The host `peer` runs on ("?" when unknown).
std::string host_of(int peer);
// Seconds since `peer` said goodbye (its process is ending normally), or a negative number while
// it has not (or no heartbeat runs).
double departed_for(int peer);
// Number of peers the heartbeat knows (0 when none runs).
int heartbeat_size();

}  // namespace hybridsync
