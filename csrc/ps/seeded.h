// Counter-based pseudo-random values: element (id, column) of a table under a seed is a pure
// function of the three, so rows never depend on the sharding or on when they were created.
// Mirrored by hybridsync/dynamic.py (initial_rows; tested against each other).
#pragma once

#include <cmath>
#include <cstdint>

namespace hybridsync {

// splitmix64's finaliser: a bijection of 64-bit values with good avalanche.
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// In (0, 1): 53 random bits, never exactly 0 (a log of it stays finite).
inline double uniform01(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) / 9007199254740992.0; }

// The bits element (id, col) of a `dim`-wide table draws under `seed`.
inline uint64_t element_key(uint64_t seed, uint64_t id, int64_t dim, int64_t col) {
  return mix64(seed ^ mix64(id * static_cast<uint64_t>(dim) + static_cast<uint64_t>(col)));
}

// Box-Muller from one key: N(mean, stddev).
inline float normal_value(uint64_t key, float mean, float stddev) {
  const double two_pi = 6.283185307179586;
  const double u1 = uniform01(key), u2 = uniform01(mix64(key));
  return mean + stddev * static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi * u2));
}

// N(mean, stddev) values in pairs, Box-Muller's cosine and sine in float: pair i draws u1 from
// the 24-bit integer a[i] (plus a half, never 0) and u2 from b[i], and writes out[2i], out[2i+1].
// Its log, sine and cosine are polynomials (Cephes'), in a loop the compiler vectorizes: rows
// are created while training runs, a pair costs a few ns instead of a few tens (within 5e-7 of
// libm's float functions; hybridsync/dynamic.py mirrors it with NumPy's, tested within 1e-6).
void normal_pairs(const uint32_t* a, const uint32_t* b, int64_t n, float mean, float stddev, float* out);

// The two 24-bit integers of a key normal_pairs takes.
inline uint32_t normal_u1_bits(uint64_t key) { return static_cast<uint32_t>(key >> 40); }
inline uint32_t normal_u2_bits(uint64_t key) { return static_cast<uint32_t>((key >> 16) & 0xFFFFFF); }

inline float uniform_value(uint64_t key, float low, float high) {
  return low + (high - low) * static_cast<float>(uniform01(key));
}

// The values a fixed table's rows start from (init_normal / init_uniform, or zeros): element
// (id, col) is a pure function of (seed, id, col), so a row never written needs no storage.
struct RowInit {
  enum class Kind : int { kZeros = 0, kNormal = 1, kUniform = 2 };
  Kind kind = Kind::kZeros;
  uint64_t seed = 0;
  float a = 0.0f, b = 0.0f;  // normal: mean, stddev; uniform: low, high

  float value(uint64_t id, int64_t dim, int64_t col) const {
    if (kind == Kind::kZeros) return 0.0f;
    const uint64_t key = element_key(seed, id, dim, col);
    return kind == Kind::kNormal ? normal_value(key, a, b) : uniform_value(key, a, b);
  }
  void fill(uint64_t id, int64_t dim, float* out) const {
    for (int64_t j = 0; j < dim; ++j) out[j] = value(id, dim, j);
  }
};

}  // namespace hybridsync
