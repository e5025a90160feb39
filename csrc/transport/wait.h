// Polling wait shared by transports and the Client: spin, then sleep with exponential back-off,
// warn on stalls, and give up -- naming the peer -- when the peer is silent (frozen, dead,
// unreachable), has left the job, or the policy's timeout passed, instead of hanging forever.
#pragma once

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "heartbeat.h"
#include "hybridsync/ps.h"
#include "transport.h"

namespace hybridsync {

// A peer's goodbye travels apart from the PS messages it sent before it: they may still arrive
// this long after it.
constexpr double kDepartureGraceS = 2.0;

// Throws when `peer` (-1: any peer, for waits every rank takes part in) is silent for longer
// than the policy's peer timeout, or left the job (said goodbye) more than the grace period ago.
inline void check_peer_alive(int peer, const WaitPolicy& policy, const std::string& what) {
  if (policy.peer_timeout_s > 0) {
    for (const SilentPeer& p : silent_peers(policy.peer_timeout_s)) {
      if (peer >= 0 && p.rank != peer) continue;
      throw PSTransportError("hybridsync: rank " + std::to_string(p.rank) + " on host " + p.host +
                             " has not been heard from for " + std::to_string(static_cast<int>(p.seconds)) +
                             " s (frozen, dead or unreachable; HYBRIDSYNC_PEER_TIMEOUT_S=" +
                             std::to_string(static_cast<int>(policy.peer_timeout_s)) + ") while waiting for " + what);
    }
  }
  const int first = peer >= 0 ? peer : 0, last = peer >= 0 ? peer + 1 : heartbeat_size();
  for (int p = first; p < last; ++p) {
    if (departed_for(p) > kDepartureGraceS) {
      throw PSTransportError("hybridsync: rank " + std::to_string(p) + " on host " + host_of(p) +
                             " has left the job (its process ended normally) while this rank waits for " + what +
                             ": the ranks ran different numbers of PS operations (uneven data? every rank must run "
                             "the same steps, or call hvd.join() when it runs out of data)");
    }
  }
}

// Calls `ready()` until it returns true. `what` names the wait in warnings and errors; `peer`
// is the rank it waits for (-1: every rank), whose liveness is checked while waiting;
// `late()`, if given, names the rank that keeps the wait going, for the stall warning.
inline int nobody_late() { return -1; }
template <class Ready, class Late = int (*)()>
void wait_until(Ready ready, const WaitPolicy& policy, const std::string& what, int peer = -1,
                Late late = nobody_late) {
  using clock = std::chrono::steady_clock;
  if (ready()) return;
  const auto start = clock::now();
  double sleep_us = 1.0;
  double next_warning_s = policy.stall_warning_s;
  double next_check_s = 0.1;
  while (!ready()) {
    const double waited_us = std::chrono::duration<double, std::micro>(clock::now() - start).count();
    if (waited_us < policy.spin_us) {
      sched_yield();  // anything else runnable on this core goes first
      continue;
    }
    if (waited_us > next_check_s * 1e6) {
      check_peer_alive(peer, policy, what);
      next_check_s += 0.1;
    }
    if (policy.timeout_s > 0 && waited_us > policy.timeout_s * 1e6) {
      throw PSTransportError("hybridsync: timed out after " + std::to_string(policy.timeout_s) + " s waiting for " +
                             what + " (a rank died or stopped calling the same operations; "
                             "HYBRIDSYNC_TIMEOUT_S sets the limit)");
    }
    if (policy.stall_warning_s > 0 && waited_us > next_warning_s * 1e6) {
      // The peer still beats: it is slow (e.g. busy in Python), not gone. Say who we wait for.
      const int slow = peer >= 0 ? peer : late();
      const std::string who = slow >= 0 ? " (rank " + std::to_string(slow) + " on host " + host_of(slow) +
                                              " is alive: busy, or not calling the same operations)" : "";
      std::fprintf(stderr, "hybridsync: still waiting for %s after %.0f s%s\n", what.c_str(), waited_us / 1e6,
                   who.c_str());
      next_warning_s += policy.stall_warning_s;
    }
    std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(sleep_us));
    sleep_us = std::min(sleep_us * 2.0, policy.max_sleep_us);
  }
}

}  // namespace hybridsync
