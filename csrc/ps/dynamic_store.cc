// A dynamic table's shard (see dynamic_store.h for the rules).
#include "dynamic_store.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "seeded.h"
#include "update_rule.h"

namespace hybridsync {

// -- DynamicStore -----------------------------------------------------------------------------

namespace {

constexpr int64_t kFirstArenaRows = 1024;  // an unbounded shard's arena doubles from here
constexpr int64_t kFreshRowsMax = 1 << 20;   // initial rows cached between rounds, at most
constexpr int64_t kUnstoredMax = 1 << 17;    // ids known stored nowhere, at most (cleared at the next admission)

uint32_t bumped(uint32_t count) { return count == UINT32_MAX ? count : count + 1; }

// The k entries of 0 .. n-1 that `eligible` admits with the least keys -- (count, last, id) for
// LFU, (last, id) for LRU -- in no particular order. Level by level, a histogram of the key over
// the entries still tied finds the threshold: entries below it go, entries at it stay tied for
// the next level, so no per-entry key array is built (its memory would be the table's) and only
// the last tie (one round's rows) is sorted, by id.
template <class Eligible, class Count, class Last, class Id>
std::vector<int64_t> least(int64_t n, int64_t k, bool lfu, Eligible eligible, Count count, Last last, Id id) {
  std::vector<uint8_t> tied(static_cast<size_t>(n));
  int64_t candidates = 0;
  for (int64_t e = 0; e < n; ++e) candidates += tied[static_cast<size_t>(e)] = eligible(e) ? 1 : 0;
  k = std::min(k, candidates);
  std::vector<int64_t> victims;
  if (k <= 0) return victims;
  // Takes the tied entries below the threshold and leaves those at it tied; false (nothing
  // done) where the keys spread wider than a histogram should (restored counts, say).
  auto level = [&](auto key) {
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t e = 0; e < n; ++e) {
      if (tied[static_cast<size_t>(e)]) {
        lo = std::min<int64_t>(lo, key(e));
        hi = std::max<int64_t>(hi, key(e));
      }
    }
    if (hi - lo >= (int64_t{1} << 24)) return false;
    std::vector<int64_t> hist(static_cast<size_t>(hi - lo + 1), 0);
    for (int64_t e = 0; e < n; ++e) {
      if (tied[static_cast<size_t>(e)]) ++hist[static_cast<size_t>(key(e) - lo)];
    }
    int64_t below = 0, threshold = 0;
    while (below + hist[static_cast<size_t>(threshold)] < k) below += hist[static_cast<size_t>(threshold++)];
    for (int64_t e = 0; e < n; ++e) {
      if (!tied[static_cast<size_t>(e)]) continue;
      const int64_t b = key(e) - lo;
      if (b < threshold) victims.push_back(e);
      tied[static_cast<size_t>(e)] = b == threshold ? 1 : 0;
    }
    k -= below;
    return true;
  };
  if (!lfu || level(count)) level(last);
  std::vector<int64_t> rest;  // what is still tied, in full key order
  for (int64_t e = 0; e < n; ++e) {
    if (tied[static_cast<size_t>(e)]) rest.push_back(e);
  }
  std::nth_element(rest.begin(), rest.begin() + (k - 1), rest.end(), [&](int64_t x, int64_t y) {
    if (lfu && count(x) != count(y)) return count(x) < count(y);
    if (last(x) != last(y)) return last(x) < last(y);
    return id(x) < id(y);
  });
  victims.insert(victims.end(), rest.begin(), rest.begin() + k);
  return victims;
}

}  // namespace

DynamicStore::DynamicStore(std::string table, const DynamicSpec& spec, int64_t share, int64_t dim, int64_t memory,
                           std::unique_ptr<DiskTier> disk)
    : table_(std::move(table)), spec_(spec), share_(share), dim_(dim), memory_(std::max<int64_t>(1, memory)),
      disk_(std::move(disk)) {
  const int64_t held = disk_ ? memory_ : share_;
  if (held > 0) {
    rows_.reserve(held);
    counts_.reserve(static_cast<size_t>(held));
    last_.reserve(static_cast<size_t>(held));
  }
}

int64_t DynamicStore::arena_rows() const {
  if (disk_) return memory_;
  return share_ > 0 ? share_ : kFirstArenaRows;
}

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

int64_t DynamicStore::append_row(std::unique_ptr<Shard>& arena, int64_t id, uint32_t count, int32_t last) {
  const int64_t pos = rows_.insert(id);
  if (pos >= arena->rows()) grow(*arena, std::max<int64_t>(kFirstArenaRows, arena->rows() * 2));
  counts_.push_back(count);
  last_.push_back(last);
  if (disk_) {
    tick_.push_back(now_);
    disk_entry_.push_back(-1);
    ++added_since_spill_;
  }
  return pos;
}

int64_t DynamicStore::add_row(std::unique_ptr<Shard>& arena, int64_t id, uint32_t count, int32_t last) {
  if (unstored_.size() > 0) unstored_.clear();  // (a stored row may spill: nothing is known unstored any more)
  const int64_t pos = append_row(arena, id, count, last);
  const int64_t cached = fresh_ids_.find(id);
  if (arena->row_type() == RowType::kFloat32) {
    if (cached >= 0) {
      std::memcpy(arena->row(pos), fresh_rows_.data() + cached * dim_, dim_ * sizeof(float));
    } else {
      initial_row(id, arena->row(pos));
    }
  } else if (cached >= 0) {
    arena->set_row(pos, fresh_rows_.data() + cached * dim_);
  } else {
    std::vector<float> row(static_cast<size_t>(dim_));
    initial_row(id, row.data());
    arena->set_row(pos, row.data());
  }
  arena->reset_slots(pos);
  return pos;
}

void DynamicStore::remove_row(Shard& arena, int64_t pos, std::vector<int64_t>* orphans) {
  if (disk_ && disk_entry_[static_cast<size_t>(pos)] >= 0) orphans->push_back(disk_entry_[static_cast<size_t>(pos)]);
  const int64_t moved = rows_.erase_at(pos);
  if (moved >= 0) {
    arena.copy_row(moved, pos);
    counts_[pos] = counts_[moved];
    last_[pos] = last_[moved];
    if (disk_) {
      tick_[pos] = tick_[moved];
      disk_entry_[pos] = disk_entry_[moved];
    }
  }
  counts_.pop_back();
  last_.pop_back();
  if (disk_) {
    tick_.pop_back();
    disk_entry_.pop_back();
  }
}

void DynamicStore::remove_rows(Shard& arena, std::vector<int64_t> positions) {
  std::vector<int64_t> orphans;  // released disk entries of rows removed for good
  if (disk_) {
    for (const int64_t p : positions) {
      if (disk_entry_[static_cast<size_t>(p)] >= 0) orphans.push_back(disk_entry_[static_cast<size_t>(p)]);
    }
  }
  const auto moves = rows_.erase_many(std::move(positions));
  const auto row_bytes = static_cast<size_t>(arena.row_size()), slot_bytes = static_cast<size_t>(dim_) * sizeof(float);
  constexpr size_t ahead = 8;
  for (size_t j = 0; j < moves.size(); ++j) {
    if (j + ahead < moves.size()) {  // the destinations are scattered; the sources run in order
      const int64_t to = moves[j + ahead].second;
      __builtin_prefetch(arena.raw_row(to), 1);
      for (int k = 0; k < arena.num_slots(); ++k) __builtin_prefetch(arena.row_of(k, to), 1);
      __builtin_prefetch(&counts_[static_cast<size_t>(to)], 1);
      __builtin_prefetch(&last_[static_cast<size_t>(to)], 1);
    }
    const auto [from, to] = moves[j];
    std::memcpy(arena.raw_row(to), arena.raw_row(from), row_bytes);
    for (int k = 0; k < arena.num_slots(); ++k) std::memcpy(arena.row_of(k, to), arena.row_of(k, from), slot_bytes);
    counts_[static_cast<size_t>(to)] = counts_[static_cast<size_t>(from)];
    last_[static_cast<size_t>(to)] = last_[static_cast<size_t>(from)];
    if (disk_) {
      tick_[static_cast<size_t>(to)] = tick_[static_cast<size_t>(from)];
      disk_entry_[static_cast<size_t>(to)] = disk_entry_[static_cast<size_t>(from)];
    }
  }
  counts_.resize(static_cast<size_t>(rows_.size()));
  last_.resize(static_cast<size_t>(rows_.size()));
  if (disk_) {
    tick_.resize(static_cast<size_t>(rows_.size()));
    disk_entry_.resize(static_cast<size_t>(rows_.size()));
    if (!orphans.empty()) remove_on_disk(std::move(orphans));
  }
}

void DynamicStore::remove_on_disk(std::vector<int64_t> entries) {
  for (const auto& [from, to] : disk_->remove(std::move(entries))) {
    disk_counts_[static_cast<size_t>(to)] = disk_counts_[static_cast<size_t>(from)];
    disk_last_[static_cast<size_t>(to)] = disk_last_[static_cast<size_t>(from)];
    if (disk_->released(to)) {  // (its row, in memory, follows it)
      const int64_t owner = rows_.find(disk_->key(to));
      if (owner < 0) throw std::logic_error("table '" + table_ + "': a released disk entry has no row (a bug)");
      disk_entry_[static_cast<size_t>(owner)] = to;
    }
  }
  disk_counts_.resize(static_cast<size_t>(disk_->entries()));
  disk_last_.resize(static_cast<size_t>(disk_->entries()));
}

void DynamicStore::drop_released() {
  if (!disk_ || disk_->released_count() == 0) return;
  std::vector<int64_t> entries;
  for (int64_t& e : disk_entry_) {
    if (e < 0) continue;
    entries.push_back(e);
    e = -1;
  }
  remove_on_disk(std::move(entries));
}

bool DynamicStore::spill(Shard& arena, int64_t incoming, SpillMode mode) {
  if (!disk_) return false;
  const int64_t held = rows_.size(), over = held + incoming - memory_;
  // A spill is the slowest part of a round, and at 2+ ranks every pull waits for the slowest
  // shard: shards spilling in different rounds would each slow a round of every rank. So at a
  // round that is a multiple of kSpillPeriod (the rule's step: the same on every shard) a shard
  // also makes room for the next period's inflow, measured since its last spill, with a quarter
  // to spare; ids hash evenly, so the shards' inflows are alike and they spill in the same rounds.
  // (Which rows spill, and when, changes no value: a row moves bit for bit.)
  const int64_t round = arena.rule().step();
  int64_t k = 0;
  if (last_spill_round_ >= 0 && round > last_spill_round_ && round % kSpillPeriod == 0) {
    const int64_t ahead = added_since_spill_ * kSpillPeriod * 5 / (4 * (round - last_spill_round_));
    if (over + ahead > 0) k = std::max(over + ahead, memory_ / 64);
  }
  if (k == 0) {
    if (over <= 0) return false;
    k = std::max(over, memory_ / 8);  // (an eighth at least, so a full arena does not spill a few rows every round)
  }
  std::vector<int64_t> victims = least(
      held, k, spec_.evict == "lfu", [&](int64_t p) { return tick_[static_cast<size_t>(p)] != now_; },
      [&](int64_t p) { return static_cast<int64_t>(counts_[static_cast<size_t>(p)]); },
      [&](int64_t p) { return static_cast<int64_t>(last_[static_cast<size_t>(p)]); },
      [&](int64_t p) { return rows_.id(p); });
  if (victims.empty()) return false;
  std::vector<int64_t> ids, entries;  // entries: a row read back from disk goes to its entry again
  std::vector<char> records(victims.size() * static_cast<size_t>(arena.record_size()));
  for (size_t v = 0; v < victims.size(); ++v) {
    ids.push_back(rows_.id(victims[v]));
    entries.push_back(disk_entry_[static_cast<size_t>(victims[v])]);
    arena.get_record(victims[v], records.data() + v * arena.record_size());
  }
  try {
    disk_->store(ids.data(), entries.data(), static_cast<int64_t>(ids.size()), records.data());  // all or nothing
  } catch (const PSError&) {
    if (mode == SpillMode::kMust) throw;
    return false;  // (nothing was added: the rows stay in memory)
  }
  for (size_t v = 0; v < victims.size(); ++v) {
    const auto p = static_cast<size_t>(victims[v]);
    if (entries[v] >= 0) {
      disk_counts_[static_cast<size_t>(entries[v])] = counts_[p];
      disk_last_[static_cast<size_t>(entries[v])] = last_[p];
      disk_entry_[p] = -1;  // (its entry holds the row now: not an orphan of the removal below)
    } else {
      disk_counts_.push_back(counts_[p]);
      disk_last_.push_back(last_[p]);
    }
  }
  remove_rows(arena, std::move(victims));
  added_since_spill_ = 0;
  last_spill_round_ = round;
  return true;
}

void DynamicStore::load(std::unique_ptr<Shard>& arena, const int64_t* ids, int64_t n, SpillMode mode,
                        std::vector<int64_t>* positions, bool distinct) {
  ++now_;
  std::vector<int64_t> at(static_cast<size_t>(n));
  rows_.find_many(ids, n, at.data());
  std::vector<int64_t> absent;  // (stored on disk, or not stored)
  constexpr int64_t ahead = 8;  // (ticks are scattered over the share, beyond the near caches)
  for (int64_t i = 0; i < n; ++i) {  // (ids may repeat: a row counts once, its tick tells)
    if (i + ahead < n && at[static_cast<size_t>(i + ahead)] >= 0) {
      __builtin_prefetch(&tick_[static_cast<size_t>(at[static_cast<size_t>(i + ahead)])], 1);
    }
    const int64_t pos = at[static_cast<size_t>(i)];
    if (pos < 0) {
      absent.push_back(ids[i]);
    } else if (tick_[static_cast<size_t>(pos)] != now_) {
      tick_[static_cast<size_t>(pos)] = now_;
      ++hits_;
    }
  }
  if (absent.empty()) {
    if (positions) *positions = std::move(at);
    return;
  }
  if (!distinct) {  // (a round's ids are distinct already: a pull's repeat across ranks)
    std::sort(absent.begin(), absent.end());
    absent.erase(std::unique(absent.begin(), absent.end()), absent.end());
  }
  std::vector<int64_t> maybe_on_disk;  // (a round's new ids were looked up by its pull's prefetch)
  maybe_on_disk.reserve(absent.size());
  for (const int64_t id : absent) {
    if (!known_unstored(id)) maybe_on_disk.push_back(id);
  }
  std::vector<int64_t> entry(maybe_on_disk.size()), found;
  disk_->find_many(maybe_on_disk.data(), static_cast<int64_t>(maybe_on_disk.size()), entry.data());
  for (const int64_t e : entry) {
    if (e >= 0) found.push_back(e);
  }
  // Absent ids not stored may be admitted by the round: room for them too. Spilling and
  // reading come before anything changes: a failure leaves the shard as it was.
  const bool spilled = spill(*arena, static_cast<int64_t>(absent.size()), mode);
  const int64_t size = arena->record_size();
  std::vector<char> records(found.size() * static_cast<size_t>(size));
  disk_->read(found.data(), static_cast<int64_t>(found.size()), records.data());
  for (size_t k = 0; k < found.size(); ++k) {
    if (k + ahead < found.size()) {  // (a disk entry's counters: arrays of the table's size)
      __builtin_prefetch(&disk_counts_[static_cast<size_t>(found[k + ahead])]);
      __builtin_prefetch(&disk_last_[static_cast<size_t>(found[k + ahead])]);
    }
    const auto e = static_cast<size_t>(found[k]);
    const int64_t pos = append_row(arena, disk_->key(found[k]), disk_counts_[e], disk_last_[e]);
    arena->set_record(pos, records.data() + k * size);
    disk_entry_[static_cast<size_t>(pos)] = found[k];
  }
  loads_ += static_cast<int64_t>(found.size());
  const bool loaded = !found.empty();
  disk_->release(found.data(), static_cast<int64_t>(found.size()));
  const auto nowhere = static_cast<int64_t>(std::count(entry.begin(), entry.end(), int64_t{-1}));
  if (unstored_.size() + nowhere > kUnstoredMax) unstored_.clear();
  for (size_t k = 0; nowhere <= kUnstoredMax && k < entry.size(); ++k) {
    if (entry[k] < 0) unstored_.insert(maybe_on_disk[k]);  // (distinct, and not known before)
  }
  if (!positions) return;
  if (spilled) {  // (a spill moves rows within the arena: every id is looked up again)
    positions->resize(static_cast<size_t>(n));
    rows_.find_many(ids, n, positions->data());
    return;
  }
  if (loaded) {  // (rows loaded were appended, the others stayed: only the absent ids may have come in)
    std::vector<int64_t> again, again_at;
    for (int64_t i = 0; i < n; ++i) {
      if (at[static_cast<size_t>(i)] < 0) {
        again.push_back(ids[i]);
        again_at.push_back(i);
      }
    }
    std::vector<int64_t> now_at(again.size());
    rows_.find_many(again.data(), static_cast<int64_t>(again.size()), now_at.data());
    for (size_t k = 0; k < again.size(); ++k) at[static_cast<size_t>(again_at[k])] = now_at[k];
  }
  *positions = std::move(at);
}

void DynamicStore::prefetch(std::unique_ptr<Shard>& arena, const int64_t* ids, int64_t n,
                            std::vector<int64_t>* positions) {
  if (!disk_) return;
  load(arena, ids, n, SpillMode::kMust, positions);  // (every rank's ids of one pull: duplicates, which load counts once)
}

void DynamicStore::new_rule(Shard& arena) {
  if (!disk_) return;
  drop_released();
  disk_->relayout(arena.row_size(), arena.fresh_slots());
}

void DynamicStore::rescale_accumulators(Shard& arena, float factor) {
  arena.rescale_accumulators(rows_.size(), factor);
  if (disk_) disk_->edit_records([&](char* records, int64_t n) { arena.rescale_record_accumulators(records, n, factor); });
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
    std::vector<int64_t> on_disk, orphans;  // entries, removed together below
    // An id may be listed twice for one round (a write() after the round's step lists the ids it
    // creates): the second finds the first's entry, removed only below.
    for (const int64_t id : touched_.front()) {  // an id touched again since is listed again later
      const int64_t pos = rows_.find(id);
      if (pos >= 0 && last_[pos] == round) {
        remove_row(arena, pos, &orphans);  // (with its released entry, if any)
        ++counters_.last_expired;
        continue;
      }
      const int64_t e = pos < 0 && disk_ ? disk_->find(id) : -1;
      if (e >= 0 && !disk_->released(e) && disk_last_[static_cast<size_t>(e)] == round) {
        on_disk.push_back(e);
        continue;
      }
      const int64_t p = pending_.find(id);
      if (p >= 0 && pending_last_[p] == round) remove_pending(p);
    }
    std::sort(on_disk.begin(), on_disk.end());
    on_disk.erase(std::unique(on_disk.begin(), on_disk.end()), on_disk.end());
    counters_.last_expired += static_cast<int64_t>(on_disk.size());
    on_disk.insert(on_disk.end(), orphans.begin(), orphans.end());
    if (!on_disk.empty()) remove_on_disk(std::move(on_disk));
    touched_.pop_front();
    ++touched_first_;
  }
}

int64_t DynamicStore::evict_to(Shard& arena, int64_t target, int32_t now) {
  // Victims: rows not touched this round, in memory or on disk alike (entries R.. are the disk's;
  // a released one's row is in memory, so it is no candidate: its row is, and takes it along).
  const int64_t held = rows_.size(), n = held + (disk_ ? disk_->entries() : 0);
  auto count = [&](int64_t e) -> int64_t {
    return e < held ? counts_[static_cast<size_t>(e)] : disk_counts_[static_cast<size_t>(e - held)];
  };
  auto last = [&](int64_t e) -> int64_t {
    return e < held ? last_[static_cast<size_t>(e)] : disk_last_[static_cast<size_t>(e - held)];
  };
  auto id = [&](int64_t e) { return e < held ? rows_.id(e) : disk_->key(e - held); };
  auto eligible = [&](int64_t e) { return (e < held || !disk_->released(e - held)) && last(e) != now; };
  std::vector<int64_t> victims = least(n, stored() - target, spec_.evict == "lfu", eligible, count, last, id);
  const auto removed = static_cast<int64_t>(victims.size());
  std::vector<int64_t> in_memory, on_disk;
  for (const int64_t e : victims) (e < held ? in_memory : on_disk).push_back(e < held ? e : e - held);
  if (!on_disk.empty()) remove_on_disk(std::move(on_disk));
  if (!in_memory.empty()) remove_rows(arena, std::move(in_memory));
  return removed;
}

void DynamicStore::step(std::unique_ptr<Shard>& arena, const int64_t* ids, int64_t n, const float* grads) {
  // Disk tier: the stored rows this round touches come back into memory first (a file that
  // cannot be read fails it before anything changes; a full disk leaves rows in memory, see
  // SpillMode); the rules below then find every touched stored row in the arena.
  std::vector<int64_t> at(static_cast<size_t>(n));  // positions in the arena, -1: not stored
  if (disk_) {
    load(arena, ids, n, SpillMode::kIfRoom, &at, /*distinct=*/true);
  } else {
    rows_.find_many(ids, n, at.data());
  }
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
  std::vector<int64_t> applied_ids;  // (stochastic rounding draws from the ids)
  if (arena->rounding().stochastic) {
    for (const int64_t p : local) applied_ids.push_back(rows_.id(p));
  }
  arena->apply(local.data(), applied, applied_grads, applied_ids.empty() ? nullptr : applied_ids.data());
  counters_.rejected += n - applied;
  fresh_ids_.clear();  // the next round's pulls start a new cache
  fresh_rows_.clear();
  counters_.admitted += counters_.last_admitted;
  counters_.evicted += counters_.last_evicted;
  counters_.expired += counters_.last_expired;
}

void DynamicStore::read(const Shard& arena, const int64_t* ids, int64_t n, float* out, int slot,
                        const int64_t* positions) const {
  std::vector<int64_t> pos(static_cast<size_t>(n));
  if (positions) {  // (a prefetch's: every stored row is in memory)
    std::copy(positions, positions + n, pos.begin());
  } else {
    rows_.find_many(ids, n, pos.data());
  }
  // Disk tier: rows stored on disk, read together (memory does not change).
  std::vector<int64_t> entry, on_disk;
  if (!positions && disk_ && disk_->size() > 0) {
    // The ids memory lacks, looked up on disk together: the disk's index is the table's size,
    // far beyond the caches, and a lookup at a time waits on memory for each (find_many
    // prefetches). Ids the pull's prefetch found stored nowhere are not looked up again.
    std::vector<int64_t> missing, missing_at;
    for (int64_t i = 0; i < n; ++i) {
      if (pos[static_cast<size_t>(i)] >= 0 || known_unstored(ids[i])) continue;
      missing.push_back(ids[i]);
      missing_at.push_back(i);
    }
    std::vector<int64_t> found(missing.size());
    disk_->find_many(missing.data(), static_cast<int64_t>(missing.size()), found.data());
    entry.assign(static_cast<size_t>(n), -1);
    for (size_t k = 0; k < found.size(); ++k) {
      entry[static_cast<size_t>(missing_at[k])] = found[k];
      if (found[k] >= 0) on_disk.push_back(found[k]);
    }
  }
  const int64_t size = arena.record_size();
  std::vector<char> records(on_disk.size() * static_cast<size_t>(size));
  if (!on_disk.empty()) disk_->read(on_disk.data(), static_cast<int64_t>(on_disk.size()), records.data());
  size_t next_record = 0;
  std::vector<int64_t> fresh;  // positions in ids of rows not stored nor cached: computed together
  constexpr int64_t ahead = 8;
  const bool raw_floats = slot >= 0 || arena.row_type() == RowType::kFloat32;
  for (int64_t i = 0; i < n; ++i) {
    if (i + ahead < n && pos[i + ahead] >= 0) __builtin_prefetch(arena.raw_row(pos[i + ahead]));
    float* dst = out + i * dim_;
    if (pos[i] >= 0) {
      if (raw_floats) {
        std::memcpy(dst, arena.row_of(slot, pos[i]), dim_ * sizeof(float));
      } else {
        arena.get_row(pos[i], dst);
      }
    } else if (!entry.empty() && entry[static_cast<size_t>(i)] >= 0) {
      const char* record = records.data() + (next_record++) * size;
      if (slot >= 0) {
        std::memcpy(dst, record + arena.row_size() + slot * dim_ * static_cast<int64_t>(sizeof(float)),
                    dim_ * sizeof(float));
      } else if (raw_floats) {
        std::memcpy(dst, record, dim_ * sizeof(float));
      } else {
        decode_row(arena.row_type(), reinterpret_cast<const uint16_t*>(record), dst, dim_);
      }
    } else if (slot < 0) {
      const int64_t cached = fresh_ids_.find(ids[i]);
      if (cached >= 0) {
        std::memcpy(dst, fresh_rows_.data() + cached * dim_, dim_ * sizeof(float));
        if (!raw_floats) round_trip(arena, dst);
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
    float* dst = out + fresh[k] * dim_;
    std::memcpy(dst, row, dim_ * sizeof(float));
    if (!raw_floats) round_trip(arena, dst);  // a 16-bit row reads as it will be stored
    // The push that follows admits these ids: it copies them from here.
    if (fresh_ids_.size() < kFreshRowsMax && fresh_ids_.find(fresh_ids[k]) < 0) {
      fresh_ids_.insert(fresh_ids[k]);
      fresh_rows_.insert(fresh_rows_.end(), row, row + dim_);
    }
  }
}

void DynamicStore::round_trip(const Shard& arena, float* row) const {
  std::vector<uint16_t> bits(static_cast<size_t>(dim_));
  encode_row(arena.row_type(), row, bits.data(), dim_);
  decode_row(arena.row_type(), bits.data(), row, dim_);
}

void DynamicStore::read_raw(const Shard& arena, const int64_t* ids, int64_t n, char* out,
                            const int64_t* positions) const {
  if (arena.row_type() == RowType::kFloat32) {
    read(arena, ids, n, reinterpret_cast<float*>(out), -1, positions);
    return;
  }
  std::vector<float> rows(static_cast<size_t>(n * dim_));
  read(arena, ids, n, rows.data(), -1, positions);
  encode_row(arena.row_type(), rows.data(), reinterpret_cast<uint16_t*>(out), n * dim_);  // exact: 16-bit values
}

void DynamicStore::write(std::unique_ptr<Shard>& arena, const int64_t* ids, int64_t n, const float* values, int slot) {
  if (disk_) load(arena, ids, n);  // (rows on disk come back, to be overwritten)
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
    if (slot < 0) {
      arena->set_row(pos, values + i * dim_);
    } else {
      std::memcpy(arena->row_of(slot, pos), values + i * dim_, dim_ * sizeof(float));
    }
  }
  if (disk_ && rows_.size() > 2 * memory_) settle(*arena);
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
  unstored_.clear();
  tick_.clear();
  disk_entry_.clear();
  added_since_spill_ = 0;
  last_spill_round_ = -1;
  if (disk_) {
    disk_->clear();
    disk_counts_.clear();
    disk_last_.clear();
  }
}

DynamicState DynamicStore::state(const Shard& arena) const {
  DynamicState s = range(arena, false, 0, stored(), true, true);
  const DynamicState p = range(arena, true, 0, pending(), false, false);
  s.pending_ids = p.pending_ids;
  s.pending_counts = p.pending_counts;
  s.pending_last = p.pending_last;
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
  // Stored rows in memory (positions 0 .. R-1), then on disk (entries, as R ..): positions
  // [lo, mid) of the range are in memory, [disk_from, to) on disk (either may be empty).
  const auto held = static_cast<size_t>(rows_.size());
  const size_t lo = std::min(from, held), mid = std::max(lo, std::min(held, to)), disk_from = std::max(from, held);
  s.ids.assign(rows_.ids().begin() + lo, rows_.ids().begin() + mid);
  s.counts.assign(counts_.begin() + lo, counts_.begin() + mid);
  s.last_touch.assign(last_.begin() + lo, last_.begin() + mid);
  const int64_t in_memory = static_cast<int64_t>(mid - lo);
  if (rows) s.rows.resize(static_cast<size_t>(n * dim_));
  if (slots) s.slots.assign(static_cast<size_t>(arena.num_slots()), std::vector<float>(static_cast<size_t>(n * dim_)));
  for (int64_t k = 0; k < in_memory; ++k) {
    const int64_t p = static_cast<int64_t>(lo) + k;
    if (rows) arena.get_row(p, s.rows.data() + k * dim_);
    for (int j = 0; slots && j < arena.num_slots(); ++j) {
      std::memcpy(s.slots[j].data() + k * dim_, arena.row_of(j, p), dim_ * sizeof(float));
    }
  }
  if (disk_from >= to) return s;
  const int64_t first = static_cast<int64_t>(disk_from - held), count = static_cast<int64_t>(to - disk_from);
  if (disk_->released_count() > 0) {
    throw std::logic_error("table '" + table_ + "': its stored rows were read with released disk entries (a bug)");
  }
  std::vector<int64_t> entries(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k) {
    entries[static_cast<size_t>(k)] = first + k;
    s.ids.push_back(disk_->key(first + k));
    s.counts.push_back(disk_counts_[static_cast<size_t>(first + k)]);
    s.last_touch.push_back(disk_last_[static_cast<size_t>(first + k)]);
  }
  if (!rows && !slots) return s;
  const int64_t size = arena.record_size();
  std::vector<char> records(static_cast<size_t>(count * size));
  disk_->read(entries.data(), count, records.data());
  for (int64_t k = 0; k < count; ++k) {
    const char* record = records.data() + k * size;
    const int64_t at = (in_memory + k) * dim_;
    if (rows && arena.row_type() == RowType::kFloat32) {
      std::memcpy(s.rows.data() + at, record, dim_ * sizeof(float));
    } else if (rows) {
      decode_row(arena.row_type(), reinterpret_cast<const uint16_t*>(record), s.rows.data() + at, dim_);
    }
    for (int j = 0; slots && j < arena.num_slots(); ++j) {
      std::memcpy(s.slots[j].data() + at, record + arena.row_size() + j * dim_ * static_cast<int64_t>(sizeof(float)),
                  dim_ * sizeof(float));
    }
  }
  return s;
}

void DynamicStore::write_slots(std::unique_ptr<Shard>& arena_ptr, const std::vector<int64_t>& ids,
                               const std::vector<std::vector<float>>& slots) {
  Shard& arena = *arena_ptr;
  if (static_cast<int>(slots.size()) != arena.num_slots()) {
    throw PSError("table '" + table_ + "': " + std::to_string(slots.size()) + " optimizer slots cannot load into " +
                  std::to_string(arena.num_slots()));
  }
  if (disk_) load(arena_ptr, ids.data(), static_cast<int64_t>(ids.size()));  // (those on disk come back)
  std::vector<int64_t> at(ids.size());
  rows_.find_many(ids.data(), static_cast<int64_t>(ids.size()), at.data());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (at[i] < 0) continue;
    for (int k = 0; k < arena.num_slots(); ++k) {
      std::memcpy(arena.row_of(k, at[i]), slots[k].data() + i * dim_, dim_ * sizeof(float));
    }
  }
  if (disk_ && rows_.size() > 2 * memory_) settle(arena);
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
  if (disk_) {
    s.map_bytes += disk_->index_bytes() + static_cast<int64_t>((disk_counts_.capacity() + disk_last_.capacity()) * 4 +
                                                               tick_.capacity() * 4 + disk_entry_.capacity() * 8);
  }
  s.row_bytes = rows_.size() * arena.record_size();  // (in memory; rows on disk cost only their index)
  return s;
}

}  // namespace hybridsync
