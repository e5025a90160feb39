// The vectorized part of the counter-based initial values (see seeded.h).
#include "seeded.h"

#include <cmath>
#include <cstring>

namespace hybridsync {

namespace {

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

}  // namespace

// Branch-free (u1 and u2 are random: a branch on them mispredicts half the time), so the loop
// vectorizes; on x86-64 an AVX2 clone runs where the CPU has it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void normal_pairs(const uint32_t* a, const uint32_t* b, int64_t n, float mean, float stddev, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float u1 = (static_cast<float>(static_cast<int32_t>(a[i])) + 0.5f) * (1.0f / 16777216.0f);
    const float u2 = static_cast<float>(static_cast<int32_t>(b[i])) * (1.0f / 16777216.0f);
    // log(u1): u1 = m * 2^e with m in [sqrt(1/2), sqrt(2)), a polynomial in m - 1.
    const uint32_t bits = float_to_bits(u1);
    float e = static_cast<float>(static_cast<int32_t>((bits >> 23) & 0xFF) - 126);
    float m = bits_to_float((bits & 0x807FFFFFu) | 0x3F000000u);
    const uint32_t low = 0u - static_cast<uint32_t>(m < 0.70710678f);
    e -= bits_to_float(float_to_bits(1.0f) & low);
    m = (m + bits_to_float(float_to_bits(m) & low)) - 1.0f;
    const float z = m * m;
    float y = 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z - 2.12194440e-4f * e - 0.5f * z;
    const float r = std::sqrt(-2.0f * (m + y + 0.693359375f * e));
    // cos and sin of the angle: the nearest quarter turn off (pi/2 in three exact parts), then
    // polynomials on [-pi/4, pi/4]; k odd swaps them, cos is negated for k = 1, 2, sin for 2, 3.
    const float angle = 6.2831853f * u2;
    const auto q = static_cast<int32_t>(angle * 0.63661977f + 0.5f);
    const float fq = static_cast<float>(q);
    const float x = ((angle - fq * 1.5703125f) - fq * 4.837512969970703125e-4f) - fq * 7.54978995489188216e-8f;
    const float xx = x * x;
    const float sx = ((-1.9515295891e-4f * xx + 8.3321608736e-3f) * xx - 1.6666654611e-1f) * xx * x + x;
    const float cx =
        ((2.443315711809948e-5f * xx - 1.388731625493765e-3f) * xx + 4.166664568298827e-2f) * xx * xx - 0.5f * xx + 1.0f;
    const auto k = static_cast<uint32_t>(q) & 3u;
    const uint32_t swap = 0u - (k & 1u), cb = float_to_bits(cx), sb = float_to_bits(sx);
    const float c = bits_to_float(((cb & ~swap) | (sb & swap)) ^ (((k + 1u) & 2u) << 30));
    const float s = bits_to_float(((sb & ~swap) | (cb & swap)) ^ ((k & 2u) << 30));
    out[2 * i] = mean + stddev * (r * c);
    out[2 * i + 1] = mean + stddev * (r * s);
  }
}

}  // namespace hybridsync
