// Rows stored in 16 bits: IEEE half (float16) and bfloat16, converted to and from float32.
// Rounding is round-to-nearest-even, or stochastic from 32 random bits the caller draws (see
// rounding_bits: a pure function of (seed, id, step, column), so rows never depend on the
// sharding). Mirrored by hybridsync/storage.py (round_rows; tested against each other).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "seeded.h"

namespace hybridsync {

// How a table stores its rows (its optimizer slots are always float32).
enum class RowType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline int64_t row_type_bytes(RowType t) { return t == RowType::kFloat32 ? 4 : 2; }

inline const char* row_type_name(RowType t) {
  return t == RowType::kFloat32 ? "float32" : t == RowType::kFloat16 ? "float16" : "bfloat16";
}

// The type named `name`; false for an unknown name.
inline bool parse_row_type(const std::string& name, RowType* out) {
  if (name == "float32") *out = RowType::kFloat32;
  else if (name == "float16") *out = RowType::kFloat16;
  else if (name == "bfloat16") *out = RowType::kBFloat16;
  else return false;
  return true;
}

namespace half_detail {

inline uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

inline float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

}  // namespace half_detail

inline float half_to_float(uint16_t h) {
  using namespace half_detail;
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0x1F) return float_of(sign | 0x7F800000u | (mant << 13));  // inf, nan
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return float_of(sign | bits_of(v));
  }
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Half of |f| below 2^-14 (a subnormal or zero): adding 0.5 rounds |f| to a multiple of 2^-24
// in float arithmetic (round-to-nearest-even), and 0.5's mantissa then holds the half's bits.
inline uint16_t half_subnormal_rne(uint32_t abs) {
  using namespace half_detail;
  return static_cast<uint16_t>(bits_of(float_of(abs) + 0.5f) - 0x3F000000u);
}

inline uint16_t float_to_half(float f) {
  using namespace half_detail;
  const uint32_t x = bits_of(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return sign | 0x7E00u;             // nan (quiet)
  if (abs >= 0x477FF000u) return sign | 0x7C00u;            // >= 65520: rounds to inf
  if (abs < 0x38800000u) return sign | half_subnormal_rne(abs);
  abs += 0xFFFu + ((abs >> 13) & 1u);                        // round the 13 bits dropped, ties to even
  return static_cast<uint16_t>(sign | ((abs - (112u << 23)) >> 13));
}

// Stochastic: rounds away from zero with probability equal to the fraction dropped.
inline uint16_t float_to_half_stochastic(float f, uint32_t random) {
  using namespace half_detail;
  const uint32_t x = bits_of(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return sign | 0x7E00u;
  if (abs >= 0x47800000u) return sign | 0x7C00u;  // >= 65536: beyond the largest half
  if (abs < 0x38800000u) {
    const float units = float_of(abs) * 16777216.0f;  // in units of 2^-24, exact
    auto q = static_cast<uint32_t>(units);
    if (static_cast<float>(random >> 8) * (1.0f / 16777216.0f) < units - static_cast<float>(q)) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  abs += random & 0x1FFFu;
  const uint32_t h = (abs - (112u << 23)) >> 13;
  return static_cast<uint16_t>(sign | (h >= 0x7C00u ? 0x7C00u : h));
}

inline float bf16_to_float(uint16_t h) { return half_detail::float_of(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t x = half_detail::bits_of(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // nan stays nan
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline uint16_t float_to_bf16_stochastic(float f, uint32_t random) {
  uint32_t x = half_detail::bits_of(f);
  if ((x & 0x7FFFFFFFu) >= 0x7F800000u) return float_to_bf16(f);  // inf and nan as they are
  x += random & 0xFFFFu;
  return static_cast<uint16_t>(x >> 16);
}

// The per-round part of stochastic rounding's key: one value per (seed, step).
inline uint64_t rounding_round_key(uint64_t seed, int64_t step) {
  return mix64(seed ^ mix64(static_cast<uint64_t>(step)));
}

// The random bits element `col` of row `id` (of a `dim`-wide table) rounds with in that round.
inline uint32_t rounding_bits(uint64_t round_key, uint64_t id, int64_t dim, int64_t col) {
  return static_cast<uint32_t>(mix64(round_key ^ (id * static_cast<uint64_t>(dim) + static_cast<uint64_t>(col))) >> 32);
}

// n values of a 16-bit row type into float32.
inline void decode_row(RowType t, const uint16_t* src, float* dst, int64_t n) {
  if (t == RowType::kBFloat16) {
    for (int64_t j = 0; j < n; ++j) dst[j] = bf16_to_float(src[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = half_to_float(src[j]);
  }
}

// n float32 values into a 16-bit row type, rounding to nearest even.
inline void encode_row(RowType t, const float* src, uint16_t* dst, int64_t n) {
  if (t == RowType::kBFloat16) {
    for (int64_t j = 0; j < n; ++j) dst[j] = float_to_bf16(src[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = float_to_half(src[j]);
  }
}

// The same, rounding stochastically with the bits of (round_key, id, column).
inline void encode_row_stochastic(RowType t, const float* src, uint16_t* dst, int64_t n, uint64_t round_key,
                                  uint64_t id) {
  if (t == RowType::kBFloat16) {
    for (int64_t j = 0; j < n; ++j) dst[j] = float_to_bf16_stochastic(src[j], rounding_bits(round_key, id, n, j));
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = float_to_half_stochastic(src[j], rounding_bits(round_key, id, n, j));
  }
}

}  // namespace hybridsync
