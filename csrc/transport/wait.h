// Polling wait shared by transports: spin, then sleep with exponential back-off, warn on
// stalls and give up after the policy's timeout instead of hanging forever.
#pragma once

#include <sched.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "heartbeat.h"
#include "hybridsync/ps.h"
#include "transport.h"

namespace hybridsync {

// Throws when the heartbeat has not heard from `peer` (-1: from any peer) for longer than the
// policy's peer timeout: it is frozen, dead or unreachable, and waiting longer cannot help.
inline void check_peer_alive(int peer, const WaitPolicy& policy, const std::string& what) {
  if (policy.peer_timeout_s <= 0) return;
  for (const SilentPeer& p : silent_peers(policy.peer_timeout_s)) {
    if (peer >= 0 && p.rank != peer) continue;
    throw PSTransportError("hybridsync: rank " + std::to_string(p.rank) + " on host " + p.host +
                           " has not been heard from for " + std::to_string(static_cast<int>(p.seconds)) +
                           " s (frozen, dead or unreachable; HYBRIDSYNC_PEER_TIMEOUT_S=" +
                           std::to_string(static_cast<int>(policy.peer_timeout_s)) + ") while waiting for " + what);
  }
}

// Calls `ready()` until it returns true. `what` names the wait in warnings and errors; `peer`
// is the rank it waits for (-1: any), whose heartbeat is checked while waiting.
template <class Ready>
void wait_until(Ready ready, const WaitPolicy& policy, const std::string& what, int peer = -1) {
  using clock = std::chrono::steady_clock;
  if (ready()) return;
  const auto start = clock::now();
  double sleep_us = 1.0;
  double next_warning_s = policy.stall_warning_s;
  double next_check_s = 0.1;
  while (!ready()) {
    const double waited_us =
        std::chrono::duration<double, std::micro>(clock::now() - start).count();
    if (waited_us < policy.spin_us) {
      sched_yield();  // anything else runnable on this core goes first
      continue;
    }
    if (waited_us > next_check_s * 1e6) {
      check_peer_alive(peer, policy, what);
      next_check_s += 0.1;
    }
    if (policy.timeout_s > 0 && waited_us > policy.timeout_s * 1e6) {
      throw PSTransportError("hybridsync: timed out after " + std::to_string(policy.timeout_s) +
                          " s waiting for " + what +
                          " (a rank died or stopped calling the same operations; "
                          "HYBRIDSYNC_TIMEOUT_S sets the limit)");
    }
    if (policy.stall_warning_s > 0 && waited_us > next_warning_s * 1e6) {
      // The peer still beats: it is slow (e.g. busy in Python), not gone. Say who we wait for.
      const std::string who = peer >= 0 ? " (rank " + std::to_string(peer) + " on host " + host_of(peer) +
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
