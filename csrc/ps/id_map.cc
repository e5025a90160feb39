// The id map of dynamic shards and disk tiers (see id_map.h).
#include "id_map.h"

#include <algorithm>

#include "hybridsync/ps.h"

namespace hybridsync {

size_t IdMap::home(int64_t id) const {
  // Fibonacci hashing, top bits: independent of the low-bit hash that picked the shard.
  return static_cast<size_t>((static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> shift_);
}

void IdMap::rehash(size_t buckets) {
  int bits = 0;
  while ((size_t{1} << bits) < buckets) ++bits;
  buckets_.assign(size_t{1} << bits, -1);
  mask_ = buckets_.size() - 1;
  shift_ = 64 - bits;
  // Every id goes to a random bucket of an array far larger than the caches: the buckets of
  // ids a few ahead are requested meanwhile (growing a disk tier's map of 8M ids took a
  // whole step of seconds without).
  constexpr size_t ahead = 16;
  for (size_t pos = 0; pos < ids_.size(); ++pos) {
    if (pos + ahead < ids_.size()) __builtin_prefetch(&buckets_[home(ids_[pos + ahead])], 1);
    size_t at = home(ids_[pos]);
    while (buckets_[at] >= 0) at = (at + 1) & mask_;
    buckets_[at] = static_cast<int32_t>(pos);
  }
}

void IdMap::reserve(int64_t n) {
  // A map reserved for n entries is one that sits full (a bounded shard's, a disk tier's memory
  // share): it holds them at a load factor of 1/4 at most, where growing maps range over 1/4 to
  // 1/2. Linear probing's runs are shorter there, and every probe past the first is a cache
  // miss in a map this size: an eighth of a 1M-entry share erased and inserted again (a spill)
  // took 25 ms at 1/2 and 17 ms at 1/4, lookups 20% less (benchmarks: docs/storage.md).
  size_t want = 16;
  while (want < static_cast<size_t>(n) * 4) want <<= 1;
  if (want > buckets_.size()) rehash(want);
  ids_.reserve(static_cast<size_t>(n));
}

int64_t IdMap::find(int64_t id) const {
  if (buckets_.empty()) return -1;
  for (size_t at = home(id);; at = (at + 1) & mask_) {
    const int32_t pos = buckets_[at];
    if (pos < 0) return -1;
    if (ids_[pos] == id) return pos;
  }
}

void IdMap::find_many(const int64_t* ids, int64_t n, int64_t* out) const {
  if (buckets_.empty()) {
    std::fill(out, out + n, -1);
    return;
  }
  // Two stages ahead: the bucket of entry i + 2k, then the id its bucket points at for i + k.
  constexpr int64_t k = 8;
  auto bucket = [&](int64_t i) { __builtin_prefetch(&buckets_[home(ids[i])]); };
  auto id_of = [&](int64_t i) {
    const int32_t pos = buckets_[home(ids[i])];
    if (pos >= 0) __builtin_prefetch(&ids_[static_cast<size_t>(pos)]);
  };
  for (int64_t i = 0; i < std::min(n, 2 * k); ++i) bucket(i);
  for (int64_t i = 0; i < n; ++i) {
    if (i + 2 * k < n) bucket(i + 2 * k);
    if (i + k < n) id_of(i + k);
    out[i] = find(ids[i]);
  }
}

size_t IdMap::bucket_of(int64_t id) const {
  size_t at = home(id);
  while (ids_[buckets_[at]] != id) at = (at + 1) & mask_;
  return at;
}

int64_t IdMap::insert(int64_t id) {
  if ((ids_.size() + 1) * 2 > buckets_.size()) rehash(std::max<size_t>(16, buckets_.size() * 2));
  if (ids_.size() >= static_cast<size_t>(INT32_MAX)) throw PSError("a dynamic shard holds at most 2^31 - 1 ids");
  const auto pos = static_cast<int32_t>(ids_.size());
  ids_.push_back(id);
  size_t at = home(id);
  while (buckets_[at] >= 0) at = (at + 1) & mask_;
  buckets_[at] = pos;
  return pos;
}

void IdMap::insert_many(const int64_t* ids, int64_t n) {
  if (n <= 0) return;
  const size_t total = ids_.size() + static_cast<size_t>(n);
  if (total > static_cast<size_t>(INT32_MAX)) throw PSError("a dynamic shard holds at most 2^31 - 1 ids");
  if (total * 2 > buckets_.size()) {
    size_t want = std::max<size_t>(16, buckets_.size());
    while (total * 2 > want) want <<= 1;
    rehash(want);
  }
  constexpr int64_t ahead = 8;
  for (int64_t i = 0; i < n; ++i) {
    if (i + ahead < n) __builtin_prefetch(&buckets_[home(ids[i + ahead])], 1);
    const auto pos = static_cast<int32_t>(ids_.size());
    ids_.push_back(ids[i]);
    size_t at = home(ids[i]);
    while (buckets_[at] >= 0) at = (at + 1) & mask_;
    buckets_[at] = pos;
  }
}

void IdMap::unlink(size_t gap) {
  // Backward-shift deletion (no tombstones): later entries of the probe run move up into the
  // gap unless their home lies cyclically in (gap, their bucket].
  for (size_t j = (gap + 1) & mask_; buckets_[j] >= 0; j = (j + 1) & mask_) {
    const size_t k = home(ids_[buckets_[j]]);
    const bool stays = gap <= j ? (gap < k && k <= j) : (gap < k || k <= j);
    if (!stays) {
      buckets_[gap] = buckets_[j];
      gap = j;
    }
  }
  buckets_[gap] = -1;
}

int64_t IdMap::erase_at(int64_t pos) {
  unlink(bucket_of(ids_[pos]));
  const int64_t last = size() - 1;
  if (pos == last) {
    ids_.pop_back();
    return -1;
  }
  buckets_[bucket_of(ids_[last])] = static_cast<int32_t>(pos);
  ids_[pos] = ids_[last];
  ids_.pop_back();
  return last;
}

std::vector<std::pair<int64_t, int64_t>> IdMap::erase_many(std::vector<int64_t> victims) {
  std::sort(victims.begin(), victims.end());
  victims.erase(std::unique(victims.begin(), victims.end()), victims.end());
  const auto k = static_cast<int64_t>(victims.size()), n = size(), keep = n - k;
  constexpr int64_t ahead = 8;
  // 1. Out of the buckets (ids_ stays as it is, so probe runs still compare).
  for (int64_t i = 0; i < k; ++i) {
    if (i + 2 * ahead < k) __builtin_prefetch(&ids_[static_cast<size_t>(victims[i + 2 * ahead])]);
    if (i + ahead < k) __builtin_prefetch(&buckets_[home(ids_[static_cast<size_t>(victims[i + ahead])])]);
    unlink(bucket_of(ids_[static_cast<size_t>(victims[i])]));
  }
  // 2. The survivors above `keep` fill the victims' positions below it, both in order.
  std::vector<std::pair<int64_t, int64_t>> moves;
  size_t v = 0, tail = std::lower_bound(victims.begin(), victims.end(), keep) - victims.begin();
  for (int64_t from = keep; from < n; ++from) {
    if (tail < victims.size() && victims[tail] == from) {
      ++tail;
      continue;
    }
    moves.emplace_back(from, victims[v++]);
  }
  for (size_t j = 0; j < moves.size(); ++j) {
    if (j + ahead < moves.size()) __builtin_prefetch(&buckets_[home(ids_[static_cast<size_t>(moves[j + ahead].first)])]);
    const auto [from, to] = moves[j];
    buckets_[bucket_of(ids_[static_cast<size_t>(from)])] = static_cast<int32_t>(to);
    ids_[static_cast<size_t>(to)] = ids_[static_cast<size_t>(from)];
  }
  ids_.resize(static_cast<size_t>(keep));
  return moves;
}

int64_t IdMap::bytes() const {
  return static_cast<int64_t>(buckets_.capacity() * sizeof(int32_t) + ids_.capacity() * sizeof(int64_t));
}

}  // namespace hybridsync
