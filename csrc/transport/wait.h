// Polling wait shared by transports: spin, then sleep with exponential back-off, warn on
// stalls and give up after the policy's timeout instead of hanging forever.
#pragma once

#include <sched.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "hybridsync/ps.h"
#include "transport.h"

namespace hybridsync {

// Calls `ready()` until it returns true. `what` names the wait in warnings and errors.
template <class Ready>
void wait_until(Ready ready, const WaitPolicy& policy, const std::string& what) {
  using clock = std::chrono::steady_clock;
  if (ready()) return;
  const auto start = clock::now();
  double sleep_us = 1.0;
  double next_warning_s = policy.stall_warning_s;
  while (!ready()) {
    const double waited_us =
        std::chrono::duration<double, std::micro>(clock::now() - start).count();
    if (waited_us < policy.spin_us) {
      sched_yield();  // anything else runnable on this core goes first
      continue;
    }
    if (policy.timeout_s > 0 && waited_us > policy.timeout_s * 1e6) {
      throw PSTransportError("hybridsync: timed out after " + std::to_string(policy.timeout_s) +
                          " s waiting for " + what +
                          " (a rank died or stopped calling the same operations; "
                          "HYBRIDSYNC_TIMEOUT_S sets the limit)");
    }
    if (policy.stall_warning_s > 0 && waited_us > next_warning_s * 1e6) {
      std::fprintf(stderr, "hybridsync: still waiting for %s after %.0f s\n", what.c_str(),
                   waited_us / 1e6);
      next_warning_s += policy.stall_warning_s;
    }
    std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(sleep_us));
    sleep_us = std::min(sleep_us * 2.0, policy.max_sleep_us);
  }
}

}  // namespace hybridsync
