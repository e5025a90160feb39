// A dynamic table's shard (see dynamic_store.h for the rules).
#include "dynamic_store.h"

#include <algorithm>
#include <cstring>

#include "seeded.h"
#include "update_rule.h"

namespace hybridsync {

// -- IdMap ------------------------------------------------------------------------------------

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
  for (size_t pos = 0; pos < ids_.size(); ++pos) {
    size_t at = home(ids_[pos]);
    while (buckets_[at] >= 0) at = (at + 1) & mask_;
    buckets_[at] = static_cast<int32_t>(pos);
  }
}

void IdMap::reserve(int64_t n) {
  size_t want = 16;
  while (want < static_cast<size_t>(n) * 2) want <<= 1;
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

// -- DynamicStore -----------------------------------------------------------------------------

namespace {

constexpr int64_t kFirstArenaRows = 1024;  // an unbounded shard's arena doubles from here
constexpr int64_t kFreshRowsMax = 1 << 20;   // initial rows cached between rounds, at most

uint32_t bumped(uint32_t count) { return count == UINT32_MAX ? count : count + 1; }

}  // namespace

DynamicStore::DynamicStore(std::string table, const DynamicSpec& spec, int64_t share, int64_t dim)
    : table_(std::move(table)), spec_(spec), share_(share), dim_(dim) {
  if (share_ > 0) {
    rows_.reserve(share_);
    counts_.reserve(static_cast<size_t>(share_));
    last_.reserve(static_cast<size_t>(share_));
  }
}

int64_t DynamicStore::arena_rows() const { return share_ > 0 ? share_ : kFirstArenaRows; }

void DynamicStore::initial_row(int64_t id, float* out) const { initial_rows(&id, 1, out); }

void DynamicStore::initial_rows(const int64_t* ids, int64_t n, float* out) const {
  const auto a = static_cast<float>(spec_.init_a), b = static_cast<float>(spec_.init_b);
  if (spec_.init != "normal") {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < dim_; ++j) {
        out[i * dim_ + j] = uniform_value(element_key(spec_.seed, static_cast<uint64_t>(ids[i]), dim_, j), a, b);
      }
    }
    return;
  }
  // Columns 2k and 2k+1 share the key of column k: one Box-Muller pair each.
  const int64_t pairs = (dim_ + 1) / 2;
  std::vector<uint32_t> u1(static_cast<size_t>(n * pairs)), u2(static_cast<size_t>(n * pairs));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t k = 0; k < pairs; ++k) {
      const uint64_t key = element_key(spec_.seed, static_cast<uint64_t>(ids[i]), dim_, k);
      u1[static_cast<size_t>(i * pairs + k)] = normal_u1_bits(key);
      u2[static_cast<size_t>(i * pairs + k)] = normal_u2_bits(key);
    }
  }
  if (dim_ % 2 == 0) {  // the pairs of row i are its columns
    normal_pairs(u1.data(), u2.data(), n * pairs, a, b, out);
    return;
  }
  std::vector<float> both(static_cast<size_t>(n * pairs * 2));
  normal_pairs(u1.data(), u2.data(), n * pairs, a, b, both.data());
  for (int64_t i = 0; i < n; ++i) std::memcpy(out + i * dim_, both.data() + i * pairs * 2, dim_ * sizeof(float));
}

void DynamicStore::grow(Shard& arena, int64_t rows) {
  // In place: a round admits rows after its rule's begin_step(), and a rule made anew here would
  // apply that round with none of the step's constants (an lr of 0: the round's update lost).
  arena.grow(rows, std::min(stored(), arena.rows()));  // (a row being added may be counted already)
}

int64_t DynamicStore::add_row(std::unique_ptr<Shard>& arena, int64_t id, uint32_t count, int32_t last) {
  const int64_t pos = rows_.insert(id);
  if (pos >= arena->rows()) grow(*arena, std::max<int64_t>(kFirstArenaRows, arena->rows() * 2));
  counts_.push_back(count);
  last_.push_back(last);
  const int64_t cached = fresh_ids_.find(id);
  if (cached >= 0) {
    std::memcpy(arena->row(pos), fresh_rows_.data() + cached * dim_, dim_ * sizeof(float));
  } else {
    initial_row(id, arena->row(pos));
  }
  for (int k = 0; k < arena->num_slots(); ++k) {
    std::fill(arena->row_of(k, pos), arena->row_of(k, pos) + dim_, arena->rule().slot_init(k));
  }
  return pos;
}

void DynamicStore::remove_row(Shard& arena, int64_t pos) {
  const int64_t moved = rows_.erase_at(pos);
  if (moved >= 0) {
    std::memcpy(arena.row(pos), arena.row(moved), dim_ * sizeof(float));
    for (int k = 0; k < arena.num_slots(); ++k) {
      std::memcpy(arena.row_of(k, pos), arena.row_of(k, moved), dim_ * sizeof(float));
    }
    counts_[pos] = counts_[moved];
    last_[pos] = last_[moved];
  }
  counts_.pop_back();
  last_.pop_back();
}

void DynamicStore::remove_rows(Shard& arena, std::vector<int64_t> positions) {
  const auto moves = rows_.erase_many(std::move(positions));
  const size_t row_bytes = static_cast<size_t>(dim_) * sizeof(float);
  constexpr size_t ahead = 8;
  for (size_t j = 0; j < moves.size(); ++j) {
    if (j + ahead < moves.size()) {  // the destinations are scattered; the sources run in order
      const int64_t to = moves[j + ahead].second;
      __builtin_prefetch(arena.row(to), 1);
      for (int k = 0; k < arena.num_slots(); ++k) __builtin_prefetch(arena.row_of(k, to), 1);
      __builtin_prefetch(&counts_[static_cast<size_t>(to)], 1);
      __builtin_prefetch(&last_[static_cast<size_t>(to)], 1);
    }
    const auto [from, to] = moves[j];
    std::memcpy(arena.row(to), arena.row(from), row_bytes);
    for (int k = 0; k < arena.num_slots(); ++k) std::memcpy(arena.row_of(k, to), arena.row_of(k, from), row_bytes);
    counts_[static_cast<size_t>(to)] = counts_[static_cast<size_t>(from)];
    last_[static_cast<size_t>(to)] = last_[static_cast<size_t>(from)];
  }
  counts_.resize(static_cast<size_t>(stored()));
  last_.resize(static_cast<size_t>(stored()));
}

void DynamicStore::remove_pending(int64_t pos) {
  const int64_t moved = pending_.erase_at(pos);
  if (moved >= 0) {
    pending_counts_[pos] = pending_counts_[moved];
    pending_last_[pos] = pending_last_[moved];
  }
  pending_counts_.pop_back();
  pending_last_.pop_back();
}

std::vector<int64_t>& DynamicStore::touch_list(int32_t round) {
  if (touched_.empty()) touched_first_ = round;
  while (touched_first_ + static_cast<int64_t>(touched_.size()) <= round) touched_.emplace_back();
  return touched_[static_cast<size_t>(round - touched_first_)];
}

void DynamicStore::expire(Shard& arena, int32_t now) {
  while (!touched_.empty() && touched_first_ <= now - spec_.ttl_steps - 1) {
    const auto round = static_cast<int32_t>(touched_first_);
    for (const int64_t id : touched_.front()) {  // an id touched again since is listed again later
      const int64_t pos = rows_.find(id);
      if (pos >= 0 && last_[pos] == round) {
        remove_row(arena, pos);
        ++counters_.last_expired;
        continue;
      }
      const int64_t p = pending_.find(id);
      if (p >= 0 && pending_last_[p] == round) remove_pending(p);
    }
    touched_.pop_front();
    ++touched_first_;
  }
}

int64_t DynamicStore::evict_to(Shard& arena, int64_t target, int32_t now) {
  // Victims: rows not touched this round, least (count, last, id) for LFU, (last, id) for LRU.
  // Level by level, a histogram of the key over the rows still tied finds the threshold: rows
  // below it go, rows at it stay tied for the next level, so no per-row key array is built (its
  // memory would be the table's) and only the last tie (one round's rows) is sorted, by id.
  const int64_t n = stored();
  std::vector<uint8_t> tied(static_cast<size_t>(n));
  int64_t untouched = 0;
  for (int64_t pos = 0; pos < n; ++pos) untouched += tied[pos] = last_[pos] != now ? 1 : 0;
  int64_t k = std::min<int64_t>(n - target, untouched);
  if (k <= 0) return 0;
  std::vector<int64_t> victims;  // positions
  // Takes the tied rows below the threshold and leaves those at it tied; false (nothing done)
  // where the keys spread wider than a histogram should (restored counts, say).
  auto level = [&](auto key) {
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t pos = 0; pos < n; ++pos) {
      if (tied[pos]) {
        lo = std::min<int64_t>(lo, key(pos));
        hi = std::max<int64_t>(hi, key(pos));
      }
    }
    if (hi - lo >= (int64_t{1} << 24)) return false;
    std::vector<int64_t> hist(static_cast<size_t>(hi - lo + 1), 0);
    for (int64_t pos = 0; pos < n; ++pos) {
      if (tied[pos]) ++hist[static_cast<size_t>(key(pos) - lo)];
    }
    int64_t below = 0, threshold = 0;
    while (below + hist[static_cast<size_t>(threshold)] < k) below += hist[static_cast<size_t>(threshold++)];
    for (int64_t pos = 0; pos < n; ++pos) {
      if (!tied[pos]) continue;
      const int64_t b = key(pos) - lo;
      if (b < threshold) victims.push_back(pos);
      tied[pos] = b == threshold ? 1 : 0;
    }
    k -= below;
    return true;
  };
  const bool lfu = spec_.evict == "lfu";
  if (!lfu || level([&](int64_t pos) { return static_cast<int64_t>(counts_[pos]); })) {
    level([&](int64_t pos) { return static_cast<int64_t>(last_[pos]); });
  }
  std::vector<int64_t> rest;  // what is still tied, in full key order
  for (int64_t pos = 0; pos < n; ++pos) {
    if (tied[pos]) rest.push_back(pos);
  }
  std::nth_element(rest.begin(), rest.begin() + (k - 1), rest.end(), [&](int64_t x, int64_t y) {
    if (lfu && counts_[x] != counts_[y]) return counts_[x] < counts_[y];
    if (last_[x] != last_[y]) return last_[x] < last_[y];
    return rows_.id(x) < rows_.id(y);
  });
  victims.insert(victims.end(), rest.begin(), rest.begin() + k);
  const auto removed = static_cast<int64_t>(victims.size());
  remove_rows(arena, std::move(victims));
  return removed;
}

void DynamicStore::step(std::unique_ptr<Shard>& arena, const int64_t* ids, int64_t n, const float* grads) {
  arena->rule().begin_step();
  const auto now = static_cast<int32_t>(arena->rule().step());
  counters_.last_admitted = counters_.last_evicted = counters_.last_expired = 0;
  std::vector<int64_t>* listed = spec_.ttl_steps > 0 ? &touch_list(now) : nullptr;
  // 1. Counts and last touches; ids reaching admit_after become candidates.
  struct Candidate {
    int64_t id;
    uint32_t count;
    int64_t index;  // in ids
  };
  std::vector<Candidate> candidates;
  int64_t touched_stored = 0;
  std::vector<int64_t> at(static_cast<size_t>(n));  // positions in the arena, -1: not stored
  rows_.find_many(ids, n, at.data());
  constexpr int64_t ahead = 8;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    if (listed) listed->push_back(id);
    if (i + ahead < n && at[i + ahead] >= 0) {
      __builtin_prefetch(&counts_[static_cast<size_t>(at[i + ahead])], 1);
      __builtin_prefetch(&last_[static_cast<size_t>(at[i + ahead])], 1);
    }
    const int64_t pos = at[i];
    if (pos >= 0) {
      counts_[pos] = bumped(counts_[pos]);
      last_[pos] = now;
      ++touched_stored;
      continue;
    }
    int64_t p = pending_.find(id);
    const uint32_t count = bumped(p >= 0 ? pending_counts_[p] : 0);
    if (count >= static_cast<uint64_t>(spec_.admit_after)) {
      candidates.push_back(Candidate{id, count, i});
      continue;
    }
    if (p < 0) {
      p = pending_.insert(id);
      pending_counts_.push_back(0);
      pending_last_.push_back(0);
    }
    pending_counts_[p] = count;
    pending_last_[p] = now;
  }
  // 2. Expiry of what was not touched for more than ttl_steps rounds.
  if (spec_.ttl_steps > 0) expire(*arena, now);
  // 3-4. Room for the candidates, by eviction down to 7/8 of the share.
  const auto wanted = static_cast<int64_t>(candidates.size());
  if (share_ > 0 && stored() + wanted > share_ && spec_.evict != "none") {
    const int64_t low = share_ - share_ / 8;
    const int64_t target = std::max<int64_t>(touched_stored, low - wanted);
    counters_.last_evicted = evict_to(*arena, target, now);
  }
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& x, const Candidate& y) { return x.id < y.id; });
  const int64_t room = share_ > 0 ? std::max<int64_t>(0, share_ - stored()) : wanted;
  for (int64_t c = 0; c < wanted; ++c) {
    const Candidate& cand = candidates[c];
    const int64_t p = pending_.find(cand.id);
    if (c < room) {
      if (p >= 0) remove_pending(p);
      at[static_cast<size_t>(cand.index)] = add_row(arena, cand.id, cand.count, now);
      ++counters_.last_admitted;
      continue;
    }
    int64_t q = p;  // no room: it waits, its count kept
    if (q < 0) {
      q = pending_.insert(cand.id);
      pending_counts_.push_back(0);
      pending_last_.push_back(0);
    }
    pending_counts_[q] = cand.count;
    pending_last_[q] = now;
  }
  // 5. The rule, on every stored touched row. Removals moved rows: find them again.
  if (counters_.last_expired > 0 || counters_.last_evicted > 0) rows_.find_many(ids, n, at.data());
  std::vector<int64_t> local;
  std::vector<float> kept;  // the gradients of the rows applied, where some were not
  const float* applied_grads = grads;
  for (int64_t i = 0; i < n; ++i) {
    if (at[i] >= 0) local.push_back(at[i]);
  }
  const auto applied = static_cast<int64_t>(local.size());
  if (applied < n) {
    kept.reserve(static_cast<size_t>(applied * dim_));
    for (int64_t i = 0; i < n; ++i) {
      if (at[i] >= 0) kept.insert(kept.end(), grads + i * dim_, grads + (i + 1) * dim_);
    }
    applied_grads = kept.data();
  }
  arena->apply(local.data(), applied, applied_grads);
  counters_.rejected += n - applied;
  fresh_ids_.clear();  // the next round's pulls start a new cache
  fresh_rows_.clear();
  counters_.admitted += counters_.last_admitted;
  counters_.evicted += counters_.last_evicted;
  counters_.expired += counters_.last_expired;
}

void DynamicStore::read(const Shard& arena, const int64_t* ids, int64_t n, float* out, int slot) const {
  std::vector<int64_t> pos(static_cast<size_t>(n));
  rows_.find_many(ids, n, pos.data());
  std::vector<int64_t> fresh;  // positions in ids of rows not stored nor cached: computed together
  constexpr int64_t ahead = 8;
  for (int64_t i = 0; i < n; ++i) {
    if (i + ahead < n && pos[i + ahead] >= 0) __builtin_prefetch(arena.row_of(slot, pos[i + ahead]));
    float* dst = out + i * dim_;
    if (pos[i] >= 0) {
      std::memcpy(dst, arena.row_of(slot, pos[i]), dim_ * sizeof(float));
    } else if (slot < 0) {
      const int64_t cached = fresh_ids_.find(ids[i]);
      if (cached >= 0) {
        std::memcpy(dst, fresh_rows_.data() + cached * dim_, dim_ * sizeof(float));
      } else {
        fresh.push_back(i);
      }
    } else {
      std::fill(dst, dst + dim_, arena.rule().slot_init(slot));
    }
  }
  if (fresh.empty()) return;
  std::vector<int64_t> fresh_ids(fresh.size());
  for (size_t k = 0; k < fresh.size(); ++k) fresh_ids[k] = ids[fresh[k]];
  std::vector<float> rows(fresh.size() * static_cast<size_t>(dim_));
  initial_rows(fresh_ids.data(), static_cast<int64_t>(fresh.size()), rows.data());
  for (size_t k = 0; k < fresh.size(); ++k) {
    const float* row = rows.data() + k * dim_;
    std::memcpy(out + fresh[k] * dim_, row, dim_ * sizeof(float));
    // The push that follows admits these ids: it copies them from here.
    if (fresh_ids_.size() < kFreshRowsMax && fresh_ids_.find(fresh_ids[k]) < 0) {
      fresh_ids_.insert(fresh_ids[k]);
      fresh_rows_.insert(fresh_rows_.end(), row, row + dim_);
    }
  }
}

void DynamicStore::write(std::unique_ptr<Shard>& arena, const int64_t* ids, int64_t n, const float* values, int slot) {
  const auto now = static_cast<int32_t>(arena->rule().step());
  for (int64_t i = 0; i < n; ++i) {
    int64_t pos = rows_.find(ids[i]);
    if (pos < 0) {
      if (share_ > 0 && stored() >= share_) {
        throw PSError("table '" + table_ + "': cannot create the row of id " + std::to_string(ids[i]) +
                      ": its shard is full (" + std::to_string(share_) + " rows, its share of capacity)");
      }
      const int64_t p = pending_.find(ids[i]);
      if (p >= 0) remove_pending(p);
      pos = add_row(arena, ids[i], 0, now);
      if (spec_.ttl_steps > 0) touch_list(now).push_back(ids[i]);
    }
    std::memcpy(arena->row_of(slot, pos), values + i * dim_, dim_ * sizeof(float));
  }
}

void DynamicStore::clear() {
  rows_.clear();
  counts_.clear();
  last_.clear();
  pending_.clear();
  pending_counts_.clear();
  pending_last_.clear();
  touched_.clear();
  touched_first_ = 0;
  fresh_ids_.clear();
  fresh_rows_.clear();
}

DynamicState DynamicStore::state(const Shard& arena) const {
  DynamicState s;
  s.dim = dim_;
  const int64_t n = stored();
  s.ids = rows_.ids();
  s.counts.assign(counts_.begin(), counts_.end());
  s.last_touch.assign(last_.begin(), last_.end());
  const auto floats = static_cast<size_t>(n * dim_);
  if (n) s.rows.assign(arena.row(0), arena.row(0) + floats);
  for (int k = 0; k < arena.num_slots(); ++k) s.slots.emplace_back(arena.slot(k), arena.slot(k) + floats);
  s.pending_ids = pending_.ids();
  s.pending_counts.assign(pending_counts_.begin(), pending_counts_.end());
  s.pending_last.assign(pending_last_.begin(), pending_last_.end());
  return s;
}

DynamicState DynamicStore::range(const Shard& arena, bool pending, int64_t begin, int64_t n, bool rows,
                                 bool slots) const {
  DynamicState s;
  s.dim = dim_;
  const auto from = static_cast<size_t>(begin), to = static_cast<size_t>(begin + n);
  if (pending) {
    s.pending_ids.assign(pending_.ids().begin() + from, pending_.ids().begin() + to);
    s.pending_counts.assign(pending_counts_.begin() + from, pending_counts_.begin() + to);
    s.pending_last.assign(pending_last_.begin() + from, pending_last_.begin() + to);
    return s;
  }
  s.ids.assign(rows_.ids().begin() + from, rows_.ids().begin() + to);
  s.counts.assign(counts_.begin() + from, counts_.begin() + to);
  s.last_touch.assign(last_.begin() + from, last_.begin() + to);
  const auto floats = static_cast<size_t>(n * dim_);
  if (rows && n) s.rows.assign(arena.row(begin), arena.row(begin) + floats);
  for (int k = 0; slots && k < arena.num_slots(); ++k) {
    s.slots.emplace_back(n ? arena.row_of(k, begin) : nullptr, n ? arena.row_of(k, begin) + floats : nullptr);
  }
  return s;
}

void DynamicStore::write_slots(Shard& arena, const std::vector<int64_t>& ids,
                               const std::vector<std::vector<float>>& slots) {
  if (static_cast<int>(slots.size()) != arena.num_slots()) {
    throw PSError("table '" + table_ + "': " + std::to_string(slots.size()) + " optimizer slots cannot load into " +
                  std::to_string(arena.num_slots()));
  }
  std::vector<int64_t> at(ids.size());
  rows_.find_many(ids.data(), static_cast<int64_t>(ids.size()), at.data());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (at[i] < 0) continue;
    for (int k = 0; k < arena.num_slots(); ++k) {
      std::memcpy(arena.row_of(k, at[i]), slots[k].data() + i * dim_, dim_ * sizeof(float));
    }
  }
}

DynamicStats DynamicStore::stats(const Shard& arena) const {
  DynamicStats s = counters_;
  s.stored = stored();
  s.capacity = share_;
  s.pending = pending_.size();
  int64_t listed = 0;
  for (const auto& l : touched_) listed += static_cast<int64_t>(l.capacity());
  s.map_bytes = rows_.bytes() + pending_.bytes() +
                static_cast<int64_t>((counts_.capacity() + last_.capacity() + pending_counts_.capacity() +
                                      pending_last_.capacity()) * 4) +
                listed * static_cast<int64_t>(sizeof(int64_t));
  s.row_bytes = stored() * dim_ * static_cast<int64_t>(sizeof(float)) * (1 + arena.num_slots());
  return s;
}

}  // namespace hybridsync
