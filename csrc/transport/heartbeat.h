// The heartbeat's interface is public (hybridsync/liveness.h): the bindings start it.
#pragma once

#include "hybridsync/liveness.h"

namespace hybridsync {

// What the watchdog does just before a lost-host abort (set_lost_host_last_words), on its own:
// the unit tests check the detached backstop (tests/unit/test_lost_hosts.py).
void say_lost_host_last_words();

}  // namespace hybridsync
