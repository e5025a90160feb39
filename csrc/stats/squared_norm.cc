#include "stats/squared_norm.h"

#include "ps/row_kernels.h"

namespace hybridsync {

namespace {
constexpr int kLanes = 8;
}

// Eight independent sums, one per lane of x: the loop vectorizes without reassociating any sum
// (a single running sum could not: float addition in another order gives another result). Built
// with -ffp-contract=off, no clone fuses the square into the addition.
HYBRIDSYNC_CLONED double buffer_squared_norm(const float* x, int64_t n) {
  double lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const double v = x[i + j];
      lane[j] += v * v;
    }
  }
  double tail = 0.0;
  for (; i < n; ++i) {
    const double v = x[i];
    tail += v * v;
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7])) + tail;
}

}  // namespace hybridsync
