// The heartbeat's interface is public (hybridsync/liveness.h): the bindings start it.
#pragma once

#include "hybridsync/liveness.h"
