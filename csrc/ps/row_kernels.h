// Loops over float rows that the hot paths share (gradient sums, squared norms, prefetching),
// written so the compiler vectorizes them, and how the hot loops are built for the machine.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

// HYBRIDSYNC_CLONED on a function builds it once per instruction set -- AVX-512, AVX2 and the
// baseline x86-64 -- and the dynamic loader picks the best one the CPU has, once (an ifunc): the
// library itself stays baseline x86-64 and runs on any x86-64 machine, while the loops over rows
// run 8 or 16 floats wide where they can. Only functions that loop over many rows carry it (a
// clone is not inlined into its callers). Elementwise float math gives the same floats at any
// width, and the core is built with -ffp-contract=off, so no clone fuses a multiply and an add
// into one FMA (rounded once instead of twice): every clone computes the same floats.
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute) && !defined(HYBRIDSYNC_NO_CLONES)
#if __has_attribute(target_clones)
#define HYBRIDSYNC_CLONED __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef HYBRIDSYNC_CLONED
#define HYBRIDSYNC_CLONED
#endif

// HYBRIDSYNC_INLINE_COPIES on a function that calls copy_row keeps its copies inline: GCC would
// otherwise recognise copy_row's loop as a copy and call memmove for every row anyway.
#if defined(__GNUC__) && !defined(__clang__)
#define HYBRIDSYNC_INLINE_COPIES __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define HYBRIDSYNC_INLINE_COPIES
#endif

namespace hybridsync {

// How far ahead of its turn a row's cache lines are requested, and into which cache: a step's
// rows are scattered over a table much larger than the caches, so each one is a memory miss
// otherwise waited for. The distance is in bytes (of rows, and slots where a loop touches them),
// not rows: what the prefetches must cover -- a memory latency's worth of the loop's work -- grows
// with the bytes a row costs. The lines go to L2 only (prefetcht1), not L1: the core tracks few
// L1 misses at once (a few dozen lines: 4 KiB ahead already filled them) but many more in L2, so
// 16 KiB ahead into L2 keeps about four times the misses in flight, and the row's own loads then
// hit L2. Measured on the Zen 4 this was tuned on (issue 39: 32-float gather 71 -> 30 us per
// 4,300-row request, 128-float 232 -> 141; 4 KiB into L1 before; 8-32 KiB into L2 all within 10%).
// At least kPrefetchMinRows rows, so rows with big slots still overlap a few misses.
constexpr int64_t kPrefetchBytes = 16384;
constexpr int64_t kPrefetchMinRows = 4;

// The distance in rows for a loop that touches `bytes_per_row` bytes per row.
inline int64_t prefetch_rows_ahead(int64_t bytes_per_row) {
  const int64_t rows = kPrefetchBytes / (bytes_per_row > 0 ? bytes_per_row : 1);
  return rows > kPrefetchMinRows ? rows : kPrefetchMinRows;
}

// Requests the cache lines of `floats` floats at p into L2 (see kPrefetchBytes; for writing: the
// write hint, where the instruction set has one).
inline void prefetch_row(const float* p, int64_t floats, bool write) {
  for (int64_t j = 0; j < floats; j += 64 / static_cast<int64_t>(sizeof(float))) {
    if (write) {
      __builtin_prefetch(p + j, 1, 2);
    } else {
      __builtin_prefetch(p + j, 0, 2);
    }
  }
}

// dst[j] = src[j] for j < dim, inline: 64 bytes at a time as one vector value (moves as wide as
// the clone has: one zmm, two ymm or four xmm), then the rest. A call to memcpy costs more than a
// short row's copy. (Moves, not float arithmetic: every bit pattern is kept.) Callers carry
// HYBRIDSYNC_INLINE_COPIES.
inline void copy_row(float* __restrict dst, const float* __restrict src, int64_t dim) {
  typedef float Line __attribute__((vector_size(64), aligned(4), may_alias));
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(float));
  int64_t j = 0;
  for (; j + kLine <= dim; j += kLine) *reinterpret_cast<Line*>(dst + j) = *reinterpret_cast<const Line*>(src + j);
  if (j < dim) std::memcpy(dst + j, src + j, sizeof(float) * static_cast<size_t>(dim - j));
}

// Calls body(width) with width a std::integral_constant<int64_t, W>: W == dim for the common row
// widths, so a loop over rows that inlines its per-row work builds it for a known width (unrolled
// into a few vector operations, no trip-count or remainder code per row), and W == 0 for any other
// width (body then reads the runtime dim). Always inlined: a HYBRIDSYNC_CLONED caller gets every
// width built for its instruction set. The floats are the same at any width (elementwise math).
template <class Body>
__attribute__((always_inline)) inline auto with_row_width(int64_t dim, Body&& body) {
  switch (dim) {
    case 16:
      return body(std::integral_constant<int64_t, 16>{});
    case 32:
      return body(std::integral_constant<int64_t, 32>{});
    case 64:
      return body(std::integral_constant<int64_t, 64>{});
    case 128:
      return body(std::integral_constant<int64_t, 128>{});
    default:
      return body(std::integral_constant<int64_t, 0>{});
  }
}

// dst[j] += src[j] for j < dim.
inline void add_row(float* __restrict dst, const float* __restrict src, int64_t dim) {
  for (int64_t j = 0; j < dim; ++j) dst[j] += src[j];
}

// |x|^2 of a row, in double. The squares are summed in float over kLanes independent lanes (a
// vector's worth of adds in flight, not one chain of dependent double adds) and the lanes folded
// into double once per row: a row's few dozen to few hundred squares lose nothing a noise-scale
// estimate can see, and the total over thousands of rows is kept in double.
inline double squared_norm(const float* __restrict x, int64_t dim) {
  constexpr int kLanes = 16;
  float lane[kLanes] = {};
  const int64_t whole = dim - dim % kLanes;  // (two loops over known bounds: no tail code for a known dim)
  for (int64_t j = 0; j < whole; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) lane[k] += x[j + k] * x[j + k];
  }
  double total = 0.0;
  for (int64_t j = whole; j < dim; ++j) total += static_cast<double>(x[j]) * x[j];
  for (int k = 0; k < kLanes; ++k) total += lane[k];
  return total;
}

}  // namespace hybridsync
