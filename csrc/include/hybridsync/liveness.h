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
// What the watchdog does just before it aborts the job over a peer on another host (a lost host,
// whose launcher daemon may keep mpirun waiting long after the abort): writes `advice` to stderr
// when it is not empty and first_on_this_host(advice_claim) (one rank per host says it), then
// starts `backstop` (argv, absolute path first; skipped when empty) detached, in a session of its
// own with stdio on /dev/null and no other descriptor, and if it started and the advice was
// written, writes `backstop_note`. Done here, not from Python: the rank is then blocked where
// Python may never run again, and the rank that aborts first must be the one that says it.
void set_lost_host_last_words(const std::string& advice, const std::string& advice_claim,
                              const std::vector<std::string>& backstop, const std::string& backstop_note);
// Whether this process is the first on its host (network namespace) to claim `name` (at most 100
// characters): an abstract Unix socket bound under it, held until the process ends, so the claim
// leaves no file behind. A second claim, by any process there, is refused.
bool first_on_this_host(const std::string& name);
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
