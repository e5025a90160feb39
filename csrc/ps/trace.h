// Server-side work (serving pulls, applying pushes) recorded for timelines while tracing is on.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "hybridsync/ps.h"

namespace hybridsync {

// steady_clock now, in nanoseconds (CLOCK_MONOTONIC on Linux, as Python's perf_counter_ns).
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class Tracer {
 public:
  void set_on(bool on) { on_ = on; }
  // The start time of a piece of work (0 when off: nothing is recorded).
  int64_t start() const { return on_ ? now_ns() : 0; }
  // Records `name` from `start_ns` to now.
  void record(const char* name, int64_t start_ns, int64_t rows) {
    if (on_) events_.push_back(TraceEvent{name, start_ns, now_ns(), rows});
  }
  std::vector<TraceEvent> take() { return std::exchange(events_, {}); }

 private:
  bool on_ = false;
  std::vector<TraceEvent> events_;
};

}  // namespace hybridsync
