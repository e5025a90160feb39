// The squared norm of a float buffer in double precision, for the adaptive batch's gradient
// statistics: every dense gradient is measured twice a step (before and after the all-reduce).
#pragma once

#include <cstdint>

namespace hybridsync {

// sum of x[i]^2, each term and the sums in double. The order of the additions is fixed (eight
// running sums over interleaved elements, combined pairwise at the end), so every build and
// every CPU -- the AVX-512, AVX2 and baseline clones alike -- returns the same double.
double buffer_squared_norm(const float* x, int64_t n);

}  // namespace hybridsync
