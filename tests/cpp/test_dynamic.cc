// Dynamic tables: the id map, the store's admission / eviction / expiry rules on one shard,
// and Clients whose dynamic tables give the same rows at one rank and at three.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "check.h"
#include "hybridsync/ps.h"
#include "inproc_transport.h"
#include "ps/dynamic_store.h"
#include "ps/partitioner.h"
#include "ps/update_rule.h"

using namespace hybridsync;

namespace {

std::unique_ptr<Shard> arena_for(const DynamicStore& store, int64_t dim, const std::string& rule = "sgd",
                                 std::map<std::string, double> hp = {{"lr", 1.0}}) {
  return std::make_unique<Shard>("dyn", store.arena_rows(), dim, make_update_rule(rule, hp));
}

std::vector<float> row_of(const DynamicStore& store, const Shard& arena, int64_t id, int64_t dim) {
  std::vector<float> out(static_cast<size_t>(dim));
  store.read(arena, &id, 1, out.data(), -1);
  return out;
}

DynamicSpec dyn(int64_t capacity = 0, int64_t admit_after = 1, const std::string& evict = "none", int64_t ttl = 0) {
  DynamicSpec d;
  d.on = true;
  d.capacity = capacity;
  d.admit_after = admit_after;
  d.evict = evict;
  d.ttl_steps = ttl;
  d.seed = 7;
  return d;
}

// One round touching `ids` with gradient rows of ones.
void touch(DynamicStore& store, std::unique_ptr<Shard>& arena, std::vector<int64_t> ids, int64_t dim) {
  std::vector<float> grads(ids.size() * static_cast<size_t>(dim), 1.0f);
  store.step(arena, ids.data(), static_cast<int64_t>(ids.size()), grads.data());
}

bool stored(const DynamicStore& store, const Shard& arena, int64_t id) {
  const DynamicState s = store.state(arena);
  return std::find(s.ids.begin(), s.ids.end(), id) != s.ids.end();
}

}  // namespace

TEST(id_map_matches_a_hash_map_under_random_inserts_and_erases_of_any_int64) {
  IdMap map;
  std::unordered_map<int64_t, bool> ref;
  std::mt19937_64 gen(3);
  std::vector<int64_t> pool = {-1, 0, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()};
  for (int i = 0; i < 300; ++i) pool.push_back(static_cast<int64_t>(gen()));
  for (int op = 0; op < 20000; ++op) {
    const int64_t id = pool[gen() % pool.size()];
    const int64_t pos = map.find(id);
    CHECK((pos >= 0) == (ref.count(id) > 0));
    if (pos < 0) {
      CHECK(map.insert(id) == map.size() - 1);
      ref[id] = true;
    } else if (gen() % 2) {
      map.erase_at(pos);
      ref.erase(id);
    }
  }
  CHECK(map.size() == static_cast<int64_t>(ref.size()));
  for (int64_t p = 0; p < map.size(); ++p) CHECK(map.find(map.id(p)) == p);  // dense, consistent positions
}

TEST(id_map_erase_many_removes_exactly_the_victims_and_keeps_positions_dense) {
  std::mt19937_64 gen(5);
  for (int trial = 0; trial < 50; ++trial) {
    IdMap map;
    const int64_t n = 1 + static_cast<int64_t>(gen() % 400);
    for (int64_t i = 0; i < n; ++i) map.insert(static_cast<int64_t>(gen() % 1000) * 7919 + i * 1000003);  // distinct
    const std::vector<int64_t> before = map.ids();
    std::vector<int64_t> victims;
    for (int64_t p = 0; p < n; ++p) {
      if (gen() % 3 == 0) victims.push_back(p);
    }
    if (trial % 7 == 0) victims.push_back(victims.empty() ? 0 : victims.front());  // a duplicate: removed once
    std::vector<bool> gone(static_cast<size_t>(n), false);
    for (int64_t p : victims) gone[static_cast<size_t>(p)] = true;
    const auto moves = map.erase_many(victims);
    int64_t kept = 0;
    for (int64_t p = 0; p < n; ++p) {
      kept += gone[static_cast<size_t>(p)] ? 0 : 1;
      CHECK((map.find(before[static_cast<size_t>(p)]) >= 0) == !gone[static_cast<size_t>(p)]);
    }
    CHECK(map.size() == kept);
    for (int64_t p = 0; p < map.size(); ++p) CHECK(map.find(map.id(p)) == p);
    for (const auto& [from, to] : moves) CHECK(map.id(to) == before[static_cast<size_t>(from)] && to < kept && from >= kept);
  }
}

TEST(id_map_insert_many_equals_inserts_one_at_a_time_across_growth_and_erases) {
  std::mt19937_64 gen(9);
  IdMap one, many;
  std::vector<int64_t> pool;  // distinct ids, some sharing their home bucket's run (multiples of 2^40)
  for (int64_t i = 0; i < 3000; ++i) pool.push_back(i % 3 == 0 ? i << 40 : static_cast<int64_t>(gen()) | 1);
  size_t next = 0;
  while (next < pool.size()) {
    const auto n = std::min<size_t>(pool.size() - next, 1 + gen() % 300);  // batches that cross rehashes
    for (size_t i = 0; i < n; ++i) one.insert(pool[next + i]);
    many.insert_many(pool.data() + next, static_cast<int64_t>(n));
    next += n;
    CHECK(many.ids() == one.ids());  // the same positions, in order
    std::vector<int64_t> victims;
    for (int64_t p = 0; p < one.size(); ++p) {
      if (gen() % 5 == 0) victims.push_back(p);
    }
    CHECK(many.erase_many(victims) == one.erase_many(victims));
    for (int64_t p = 0; p < many.size(); ++p) CHECK(many.find(many.id(p)) == p);
  }
  many.insert_many(pool.data(), 0);  // (nothing)
  CHECK(many.ids() == one.ids());
  for (const int64_t id : pool) CHECK(many.find(id) == one.find(id));
}

TEST(id_map_reserved_for_n_holds_them_at_a_quarter_load_through_spill_like_churn) {
  // A tiered shard's memory map sits at its reserved size: erasing an eighth and inserting as
  // many (a spill and the loads after it) keeps it consistent, and never above a load of 1/4.
  const int64_t n = 5000;
  IdMap map;
  map.reserve(n);
  const int64_t reserved_bytes = map.bytes();
  CHECK(reserved_bytes >= n * static_cast<int64_t>(4 * sizeof(int32_t) + sizeof(int64_t)));
  std::mt19937_64 gen(13);
  std::unordered_map<int64_t, bool> ref;
  auto fill = [&] {
    while (map.size() < n) {
      const auto id = static_cast<int64_t>(gen());
      if (ref.count(id)) continue;
      map.insert(id);
      ref[id] = true;
    }
  };
  fill();
  for (int round = 0; round < 20; ++round) {
    std::vector<int64_t> victims;
    for (int64_t p = 0; p < n; ++p) {
      if (gen() % 8 == 0) victims.push_back(p);
    }
    for (const int64_t p : victims) ref.erase(map.id(p));
    map.erase_many(victims);
    fill();
    CHECK(map.bytes() == reserved_bytes);  // (no rehash: the reserved buckets hold them)
  }
  for (const auto& [id, present] : ref) CHECK(map.find(id) >= 0 && map.id(map.find(id)) == id);
  for (int64_t p = 0; p < map.size(); ++p) CHECK(ref.count(map.id(p)) == 1);
}

TEST(initial_rows_in_a_batch_equal_those_made_one_at_a_time) {
  for (int64_t dim : {1, 5, 16}) {
    DynamicStore store("dyn", dyn(), 0, dim);
    std::vector<int64_t> ids;
    std::mt19937_64 gen(11);
    for (int i = 0; i < 1000; ++i) ids.push_back(static_cast<int64_t>(gen()));
    std::vector<float> batch(ids.size() * dim), one(dim);
    store.initial_rows(ids.data(), static_cast<int64_t>(ids.size()), batch.data());
    for (size_t i = 0; i < ids.size(); ++i) {
      store.initial_row(ids[i], one.data());
      CHECK(std::equal(one.begin(), one.end(), batch.begin() + i * dim));  // bit for bit
    }
  }
}

TEST(initial_rows_depend_only_on_seed_and_id_and_absent_ids_read_them) {
  DynamicStore a("dyn", dyn(), 0, 4), b("dyn", dyn(100), 100, 4);
  auto arena_a = arena_for(a, 4), arena_b = arena_for(b, 4);
  const int64_t id = -1234567890123LL;
  CHECK(row_of(a, *arena_a, id, 4) == row_of(b, *arena_b, id, 4));
  CHECK(row_of(a, *arena_a, id, 4) != row_of(a, *arena_a, id + 1, 4));
  CHECK(a.stored() == 0);  // a read creates nothing
  // The same generator as a fixed table's init_normal: element (id, j) under the seed.
  const std::vector<float> first = row_of(a, *arena_a, 5, 4);
  touch(a, arena_a, {5}, 4);  // sgd lr 1, gradient 1: initial - 1
  const std::vector<float> after = row_of(a, *arena_a, 5, 4);
  for (int j = 0; j < 4; ++j) CHECK_NEAR(after[j], first[j] - 1.0f, 1e-6);
}

TEST(admission_counts_touches_and_applies_nothing_before_admit_after) {
  DynamicStore store("dyn", dyn(0, 3), 0, 2);
  auto arena = arena_for(store, 2);
  const std::vector<float> initial = row_of(store, *arena, 42, 2);
  touch(store, arena, {42}, 2);
  touch(store, arena, {42}, 2);
  CHECK(!stored(store, *arena, 42));
  CHECK(row_of(store, *arena, 42, 2) == initial);
  CHECK(store.stats(*arena).pending == 1);
  touch(store, arena, {42}, 2);  // third touch: admitted, and this round's gradient applied
  CHECK(stored(store, *arena, 42));
  CHECK_NEAR(row_of(store, *arena, 42, 2)[0], initial[0] - 1.0f, 1e-6);
  const DynamicStats s = store.stats(*arena);
  CHECK(s.admitted == 1 && s.rejected == 2 && s.pending == 0);
}

TEST(lru_eviction_keeps_the_share_and_removes_the_least_recent_first) {
  DynamicStore store("dyn", dyn(8, 1, "lru"), 8, 2);
  auto arena = arena_for(store, 2);
  for (int64_t id = 0; id < 8; ++id) touch(store, arena, {id * 1000}, 2);  // rounds 1..8, one id each
  CHECK(store.stored() == 8);
  touch(store, arena, {0}, 2);       // round 9: id 0 is recent again
  touch(store, arena, {-5, -6}, 2);  // round 10: 8 stored + 2 new > 8
  // Evicted down to 7/8 of the share less the 2 new, 5: the 3 least recent, 1000, 2000 and 3000.
  CHECK(store.stored() == 7);
  CHECK(!stored(store, *arena, 1000) && !stored(store, *arena, 2000) && !stored(store, *arena, 3000));
  CHECK(stored(store, *arena, 0) && stored(store, *arena, 4000) && stored(store, *arena, -5));
  CHECK(store.stats(*arena).evicted == 3 && store.stats(*arena).last_evicted == 3);
}

TEST(lfu_eviction_removes_the_least_frequent_and_no_policy_refuses_new_rows_when_full) {
  DynamicStore lfu("dyn", dyn(4, 1, "lfu"), 4, 1);
  auto arena = arena_for(lfu, 1);
  touch(lfu, arena, {1, 2, 3, 4}, 1);
  touch(lfu, arena, {1, 2, 4}, 1);
  touch(lfu, arena, {5}, 1);  // full: 4 + 1 > 4; evict to 4 - 0 - 1 = 3 -> one: id 3 (count 1)
  CHECK(!stored(lfu, *arena, 3) && stored(lfu, *arena, 5) && lfu.stored() == 4);

  DynamicStore none("dyn", dyn(2), 2, 1);
  auto arena2 = arena_for(none, 1);
  touch(none, arena2, {9, 8, 7}, 1);  // room for two: the lowest ids, 7 and 8
  CHECK(stored(none, *arena2, 7) && stored(none, *arena2, 8) && !stored(none, *arena2, 9));
  CHECK(none.stats(*arena2).rejected == 1 && none.stats(*arena2).pending == 1);
}

TEST(rows_untouched_for_more_than_ttl_steps_expire_at_a_step_boundary) {
  DynamicStore store("dyn", dyn(0, 1, "none", 2), 0, 1);
  auto arena = arena_for(store, 1);
  touch(store, arena, {10, 11}, 1);  // round 1
  touch(store, arena, {11}, 1);      // round 2
  touch(store, arena, {}, 1);        // round 3: 10 is 2 rounds old, kept
  CHECK(stored(store, *arena, 10));
  touch(store, arena, {}, 1);  // round 4: 10 untouched for 3 > 2 rounds
  CHECK(!stored(store, *arena, 10) && stored(store, *arena, 11));
  touch(store, arena, {}, 1);  // round 5: 11 (last round 2) expires
  CHECK(store.stored() == 0 && store.stats(*arena).expired == 2);
}

TEST(an_unbounded_store_grows_its_arena_and_keeps_rows_and_slots) {
  DynamicStore store("dyn", dyn(), 0, 3);
  auto arena = arena_for(store, 3, "adagrad", {{"lr", 0.1}, {"initial_accumulator_value", 0.1}});
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 5000; ++i) ids.push_back(i * 7919 - 20000);
  touch(store, arena, ids, 3);
  CHECK(store.stored() == 5000 && arena->rows() >= 5000);
  std::vector<float> acc(3);
  const int64_t id = ids[4321];
  store.read(*arena, &id, 1, acc.data(), 0);  // adagrad's accumulator: initial 0.1 + 1
  CHECK_NEAR(acc[2], 1.1, 1e-5);
}

TEST(a_round_that_grows_the_arena_applies_the_rule_as_one_that_does_not) {
  // The arena grows while a round admits rows, after the rule's begin_step(): the round's
  // update must still use that step's constants (lr, bias corrections), for every rule.
  const std::vector<std::pair<std::string, std::map<std::string, double>>> rules = {
      {"sgd", {{"lr", 0.5}}}, {"adagrad", {{"lr", 0.1}, {"initial_accumulator_value", 0.1}}}, {"adam", {{"lr", 0.05}}}};
  const int64_t dim = 2;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 3000; ++i) ids.push_back(i * 104729 - 7);
  for (const auto& [rule, hp] : rules) {
    DynamicStore growing("dyn", dyn(), 0, dim), roomy("dyn", dyn(), 0, dim);
    auto small = arena_for(growing, dim, rule, hp);
    auto big = std::make_unique<Shard>("dyn", 8192, dim, make_update_rule(rule, hp));
    for (int round = 0; round < 3; ++round) {  // 1000 new rows a round: the arena grows twice
      const std::vector<int64_t> part(ids.begin(), ids.begin() + 1000 * (round + 1));
      touch(growing, small, part, dim);
      touch(roomy, big, part, dim);
    }
    CHECK(small->rows() < 8192 && small->rows() >= 3000);
    std::vector<float> got(ids.size() * dim), want(ids.size() * dim);
    growing.read(*small, ids.data(), static_cast<int64_t>(ids.size()), got.data(), -1);
    roomy.read(*big, ids.data(), static_cast<int64_t>(ids.size()), want.data(), -1);
    CHECK(got == want);
  }
}

TEST(shards_with_a_disk_tier_spill_in_the_same_rounds) {
  // Two shards of one dynamic table with a disk tier, new ids arriving at slightly different
  // rates (as hashing deals them) and some old ones coming back from disk: once both have
  // spilled, they spill only at rounds whose prefetch sees a step that is a multiple of 8 (the
  // same rounds), neither holds more than its memory after a round, and no row is lost.
  const int64_t dim = 4, memory = 1000;
  char tmpl[] = "/tmp/hybridsync-spill-test-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const int64_t record = Shard("dyn", 1, dim, make_update_rule("sgd", {{"lr", 0.1}})).record_size();
  std::vector<std::vector<int64_t>> spills(2);
  {
    std::vector<std::unique_ptr<DynamicStore>> stores;
    std::vector<std::unique_ptr<Shard>> arenas;
    for (int s = 0; s < 2; ++s) {
      stores.push_back(std::make_unique<DynamicStore>("dyn", dyn(), 0, dim, memory,
                                                      std::make_unique<DiskTier>("dyn", dir, s, record, nullptr)));
      arenas.push_back(arena_for(*stores.back(), dim, "sgd", {{"lr", 0.1}}));
    }
    std::mt19937_64 gen(5);
    std::vector<std::vector<int64_t>> seen(2);
    for (int64_t round = 1; round <= 240; ++round) {
      for (int s = 0; s < 2; ++s) {
        std::vector<int64_t> ids;
        const int64_t fresh = 55 + 4 * s + static_cast<int64_t>(gen() % 11);
        for (int64_t i = 0; i < fresh; ++i) ids.push_back(static_cast<int64_t>(gen() >> 1));
        for (int i = 0; i < 8 && seen[s].size() > 2000; ++i) {  // old rows, most of them on disk by now
          const int64_t old = seen[s][gen() % (seen[s].size() - 1000)];
          if (std::find(ids.begin(), ids.end(), old) == ids.end()) ids.push_back(old);
        }
        seen[s].insert(seen[s].end(), ids.begin(), ids.begin() + fresh);
        const int64_t before = stores[s]->disk()->size();
        stores[s]->prefetch(arenas[s], ids.data(), static_cast<int64_t>(ids.size()));
        if (stores[s]->disk()->size() > before) spills[s].push_back(round);
        touch(*stores[s], arenas[s], ids, dim);
        CHECK(stores[s]->resident() <= memory);
        CHECK(stores[s]->stored() == static_cast<int64_t>(seen[s].size()));  // (nothing lost)
      }
    }
  }
  rmdir(dir.c_str());
  // Memory fills at slightly different rounds, so the first spills differ; from the first
  // period boundary after them on, every spill of either shard is on a boundary, in both.
  CHECK(!spills[0].empty() && !spills[1].empty());
  int64_t aligned_from = std::max(spills[0].front(), spills[1].front()) + 1;
  while ((aligned_from - 1) % 8 != 0) ++aligned_from;
  std::vector<std::vector<int64_t>> later(2);
  for (int s = 0; s < 2; ++s) {
    for (const int64_t round : spills[s]) {
      if (round >= aligned_from) later[s].push_back(round);
    }
  }
  CHECK(later[0].size() >= 20);
  CHECK(later[0] == later[1]);
  for (const int64_t round : later[0]) CHECK((round - 1) % 8 == 0);
}

TEST(a_prefetchs_positions_and_ids_it_found_stored_nowhere_read_as_lookups_do) {
  // A pull's prefetch leaves the arena positions of its ids, which the reads that follow use
  // instead of looking them up, and the ids it found stored nowhere, which reads and the round
  // skip on disk. Both must read what a lookup reads: rows in memory, rows brought back from
  // disk, ids stored nowhere (repeated, as every rank's ids of a pull are) -- and once such an
  // id is admitted and then spills, a lookup must find it on disk again.
  const int64_t dim = 3, memory = 40;
  char tmpl[] = "/tmp/hybridsync-positions-test-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const int64_t record = Shard("dyn", 1, dim, make_update_rule("sgd", {{"lr", 0.1}})).record_size();
  {
    DynamicStore store("dyn", dyn(), 0, dim, memory, std::make_unique<DiskTier>("dyn", dir, 0, record, nullptr));
    DynamicStore reference("dyn", dyn(), 0, dim);  // all in memory
    auto arena = arena_for(store, dim, "sgd", {{"lr", 0.1}});
    auto reference_arena = arena_for(reference, dim, "sgd", {{"lr", 0.1}});
    auto both = [&](const std::vector<int64_t>& ids) {
      store.prefetch(arena, ids.data(), static_cast<int64_t>(ids.size()));
      touch(store, arena, ids, dim);
      touch(reference, reference_arena, ids, dim);
    };
    for (int64_t round = 0; round < 10; ++round) {  // 200 rows stored, most of them on disk
      std::vector<int64_t> ids;
      for (int64_t i = 0; i < 20; ++i) ids.push_back(1000 + round * 20 + i);
      both(ids);
    }
    CHECK(store.disk()->size() > 100);
    // Rows on disk, rows in memory, new ids, and repeats among them.
    const std::vector<int64_t> pull = {1000, 1001, 1195, 1196, 5, 6, 1000, 5, 1100, 1150, 7, 1199};
    const auto n = static_cast<int64_t>(pull.size());
    std::vector<int64_t> positions;
    store.prefetch(arena, pull.data(), n, &positions);
    CHECK(static_cast<int64_t>(positions.size()) == n);
    std::vector<float> given(static_cast<size_t>(n * dim)), looked_up(given.size()), want(given.size());
    store.read(*arena, pull.data(), n, given.data(), -1, positions.data());
    store.read(*arena, pull.data(), n, looked_up.data(), -1);
    reference.read(*reference_arena, pull.data(), n, want.data(), -1);
    CHECK(given == want && looked_up == want);
    // The round (its ids distinct, as the pushes' sum leaves them) admits 5, 6 and 7; later
    // rounds spill them; lookups find them on disk.
    std::vector<int64_t> round_ids = pull;
    std::sort(round_ids.begin(), round_ids.end());
    round_ids.erase(std::unique(round_ids.begin(), round_ids.end()), round_ids.end());
    touch(store, arena, round_ids, dim);
    touch(reference, reference_arena, round_ids, dim);
    for (int64_t round = 0; round < 6; ++round) {
      std::vector<int64_t> ids;
      for (int64_t i = 0; i < 20; ++i) ids.push_back(5000 + round * 20 + i);
      both(ids);
    }
    const std::vector<int64_t> admitted = {5, 6, 7};
    for (const int64_t id : admitted) CHECK(store.disk()->holds(id));  // (spilled: a lookup must go to disk)
    std::vector<float> got(9), expected(9);
    store.read(*arena, admitted.data(), 3, got.data(), -1);
    reference.read(*reference_arena, admitted.data(), 3, expected.data(), -1);
    CHECK(got == expected);
    CHECK(store.resident() <= memory && store.stored() == reference.stored());
    // A prefetch that brings rows back without spilling (memory has room after a spill at a
    // period's start): positions of rows already in memory are kept, the loaded ones looked up.
    int64_t next = 6000;
    for (int guard = 0; guard < 40 && !(memory - store.resident() >= 4 && arena->rule().step() % 8 != 0); ++guard) {
      std::vector<int64_t> ids;
      for (int64_t i = 0; i < 20; ++i) ids.push_back(next++);
      both(ids);
    }
    CHECK(memory - store.resident() >= 4 && arena->rule().step() % 8 != 0);
    std::vector<int64_t> back_from_disk;
    for (int64_t id = 1000; id < 1200 && back_from_disk.size() < 2; ++id) {
      if (store.disk()->holds(id)) back_from_disk.push_back(id);
    }
    CHECK(back_from_disk.size() == 2);
    const int64_t in_memory = next - 1;
    const std::vector<int64_t> mixed = {back_from_disk[0], in_memory, 424242, back_from_disk[1], in_memory, 424242};
    const int64_t disk_before = store.disk()->size(), resident_before = store.resident();
    std::vector<int64_t> mixed_at;
    store.prefetch(arena, mixed.data(), 6, &mixed_at);
    CHECK(store.disk()->size() == disk_before - 2 && store.resident() == resident_before + 2);  // (loaded, none spilled)
    CHECK(mixed_at[2] < 0 && mixed_at[5] < 0 && mixed_at[0] >= 0 && mixed_at[1] == mixed_at[4]);
    std::vector<float> mixed_given(18), mixed_looked_up(18), mixed_want(18);
    store.read(*arena, mixed.data(), 6, mixed_given.data(), -1, mixed_at.data());
    store.read(*arena, mixed.data(), 6, mixed_looked_up.data(), -1);
    reference.read(*reference_arena, mixed.data(), 6, mixed_want.data(), -1);
    CHECK(mixed_given == mixed_want && mixed_looked_up == mixed_want);
    // The same, where the prefetch that found them stored nowhere is followed by writes.
    const std::vector<int64_t> written = {9001, 9002};
    std::vector<int64_t> at;
    store.prefetch(arena, written.data(), 2, &at);
    CHECK(at[0] < 0 && at[1] < 0);
    const std::vector<float> values = {1, 2, 3, 4, 5, 6};
    store.write(arena, written.data(), 2, values.data(), -1);
    for (int64_t round = 0; round < 6; ++round) {
      std::vector<int64_t> ids;
      for (int64_t i = 0; i < 20; ++i) ids.push_back(7000 + round * 20 + i);
      store.prefetch(arena, ids.data(), static_cast<int64_t>(ids.size()));
      touch(store, arena, ids, dim);
    }
    std::vector<float> back(6);
    store.read(*arena, written.data(), 2, back.data(), -1);
    CHECK(back == values);
    CHECK(store.disk()->holds(9001));  // (read back from disk, not from memory)
  }
  rmdir(dir.c_str());
}

TEST(rows_read_back_and_spilled_again_reuse_their_disk_entries_and_train_as_all_in_memory) {
  // A row read back from disk keeps its (released) disk entry and goes to it again when it
  // spills; a row removed from memory for good (evicted, expired) takes its entry along. Against
  // the same table all in memory, under Adagrad: ids coming back from disk again and again,
  // rescaled accumulators (every record on disk rewritten, the file compacted), the whole state
  // compared every few rounds (it walks the disk's entries), and either LRU eviction at capacity
  // (it walks them too) or expiry after a few rounds (rows in memory, read back or not, and on
  // disk). An entry left behind by a removed row fails the state's check (released entries
  // remain) or a later read of the id (a released entry is never read).
  const int64_t dim = 32;
  char tmpl[] = "/tmp/hybridsync-reuse-test-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::map<std::string, double> hp = {{"lr", 0.1}};
  const int64_t record = Shard("dyn", 1, dim, make_update_rule("adagrad", hp)).record_size();
  // memory rows, capacity (0: none, else LRU), ttl_steps, old ids drawn from the newest `window`
  // seen; bursts: 3 rounds in 10 bring 150 new ids (spills), the others 10, so that rows read
  // back in calm rounds stay in memory until they expire.
  auto run = [&](int64_t memory, int64_t capacity, int64_t ttl, size_t window, bool bursts) {
    const DynamicSpec spec = dyn(capacity, 1, capacity > 0 ? "lru" : "none", ttl);
    DynamicStore store("dyn", spec, capacity, dim, memory, std::make_unique<DiskTier>("dyn", dir, 0, record, nullptr));
    DynamicStore reference("dyn", spec, capacity, dim);
    auto arena = arena_for(store, dim, "adagrad", hp);
    auto reference_arena = arena_for(reference, dim, "adagrad", hp);
    std::mt19937_64 gen(3);
    std::vector<int64_t> seen;
    int64_t next = 1, probe = -1, probe_entry = -1;
    auto same_state = [&] {
      store.drop_released();
      CHECK(store.disk()->released_count() == 0);
      const DynamicState got = store.state(*arena), want = reference.state(*reference_arena);
      std::map<int64_t, std::vector<float>> got_rows, want_rows;
      for (const auto* st : {&got, &want}) {
        auto& rows = st == &got ? got_rows : want_rows;
        for (size_t i = 0; i < st->ids.size(); ++i) {
          const auto at = static_cast<int64_t>(i) * dim;
          std::vector<float> r(st->rows.begin() + at, st->rows.begin() + at + dim);
          for (const auto& slot : st->slots) r.insert(r.end(), slot.begin() + at, slot.begin() + at + dim);
          r.push_back(static_cast<float>(st->counts[i]));
          r.push_back(static_cast<float>(st->last_touch[i]));
          rows[st->ids[i]] = r;
        }
      }
      CHECK(!got_rows.empty() && got_rows == want_rows);
    };
    for (int64_t round = 1; round <= 400; ++round) {
      std::vector<int64_t> ids;
      const int64_t fresh = !bursts ? 40 : round % 10 < 3 ? 150 : 10;
      for (int64_t i = 0; i < fresh; ++i) ids.push_back(next++);
      for (int64_t i = 0; i < 30 && !seen.empty(); ++i) {  // old ids: many on disk, some read back before
        const size_t from = seen.size() > window ? seen.size() - window : 0;
        const int64_t old = seen[from + static_cast<size_t>(gen() % (seen.size() - from))];
        if (std::find(ids.begin(), ids.end(), old) == ids.end()) ids.push_back(old);
      }
      seen.insert(seen.end(), ids.begin(), ids.begin() + fresh);
      if (round == 12 && capacity > 0) {  // (before any eviction: no entry moves)
        for (const int64_t id : seen) {
          if (store.disk()->holds(id) && std::find(ids.begin(), ids.end(), id) == ids.end()) {
            probe = id;
            break;
          }
        }
        CHECK(probe >= 0);
        ids.push_back(probe);
        probe_entry = store.disk()->find(probe);
      }
      std::vector<int64_t> pull = ids;  // (a pull's ids repeat across ranks)
      pull.insert(pull.end(), ids.begin(), ids.begin() + 10);
      store.prefetch(arena, pull.data(), static_cast<int64_t>(pull.size()));
      std::vector<float> grads(ids.size() * static_cast<size_t>(dim));
      for (float& g : grads) g = static_cast<float>(static_cast<int64_t>(gen() % 200) - 100) / 64;
      store.step(arena, ids.data(), static_cast<int64_t>(ids.size()), grads.data());
      reference.step(reference_arena, ids.data(), static_cast<int64_t>(ids.size()), grads.data());
      CHECK(store.stored() == reference.stored());
      CHECK(store.resident() + store.disk()->size() == store.stored());
      if (probe >= 0 && round == 12) {  // read back: its entry released, kept
        CHECK(store.disk()->find(probe) == probe_entry && store.disk()->released(probe_entry));
      }
      if (probe >= 0 && round == 18) {  // spilled again, to the same entry
        CHECK(store.disk()->holds(probe) && store.disk()->find(probe) == probe_entry);
      }
      if (round % 50 == 0) {
        store.rescale_accumulators(*arena, 0.5f);
        reference.rescale_accumulators(*reference_arena, 0.5f);
      }
      if (round % 20 == 0) same_state();
      std::vector<float> got(ids.size() * static_cast<size_t>(dim)), want(got.size());
      store.read(*arena, ids.data(), static_cast<int64_t>(ids.size()), got.data(), 0);
      reference.read(*reference_arena, ids.data(), static_cast<int64_t>(ids.size()), want.data(), 0);
      CHECK(got == want);
    }
    same_state();
    CHECK(store.loads() > 1000);
    return std::make_pair(store.stats(*arena), store.disk()->compactions());
  };
  const auto [evicting, evicting_compactions] = run(120, 900, 0, 700, false);
  CHECK(evicting.evicted > 0 && evicting_compactions > 0);
  const auto [expiring, expiring_compactions] = run(300, 0, 3, 400, true);
  CHECK(expiring.expired > 0);
  (void)expiring_compactions;
  rmdir(dir.c_str());
}

TEST(an_id_listed_twice_for_a_round_and_rows_restored_onto_disk_expire_as_all_in_memory) {
  // Expiry with a disk tier, against the same table all in memory. (1) An id a write() creates
  // after the round's step that left it pending is listed twice for that round; its row spills,
  // a pull reads it back (its disk entry released), and the round that expires it must remove
  // it once (the second listing finds the released entry). (2) A shard restored with a small
  // memory holds most rows on disk, and they expire at the rounds their last touches say.
  const int64_t dim = 2, ttl = 2;
  char tmpl[] = "/tmp/hybridsync-expiry-test-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const int64_t record = Shard("dyn", 1, dim, make_update_rule("sgd", {{"lr", 0.1}})).record_size();
  auto same = [&](DynamicStore& store, Shard& arena, DynamicStore& reference, Shard& reference_arena) {
    store.drop_released();
    CHECK(store.disk()->released_count() == 0);
    CHECK(store.stored() == reference.stored());
    CHECK(store.stats(arena).expired == reference.stats(reference_arena).expired);
    const DynamicState got = store.state(arena), want = reference.state(reference_arena);
    std::map<int64_t, std::pair<int64_t, std::vector<float>>> a, b;
    for (size_t i = 0; i < got.ids.size(); ++i) {
      a[got.ids[i]] = {got.last_touch[i], {got.rows.begin() + i * dim, got.rows.begin() + (i + 1) * dim}};
    }
    for (size_t i = 0; i < want.ids.size(); ++i) {
      b[want.ids[i]] = {want.last_touch[i], {want.rows.begin() + i * dim, want.rows.begin() + (i + 1) * dim}};
    }
    CHECK(a == b);
  };
  {
    const DynamicSpec spec = dyn(0, 2, "none", ttl);  // (admitted at the second touch)
    DynamicStore store("dyn", spec, 0, dim, 4, std::make_unique<DiskTier>("dyn", dir, 0, record, nullptr));
    DynamicStore reference("dyn", spec, 0, dim);
    auto arena = arena_for(store, dim, "sgd", {{"lr", 0.1}});
    auto reference_arena = arena_for(reference, dim, "sgd", {{"lr", 0.1}});
    auto both_step = [&](const std::vector<int64_t>& ids) {
      store.prefetch(arena, ids.data(), static_cast<int64_t>(ids.size()));
      touch(store, arena, ids, dim);
      touch(reference, reference_arena, ids, dim);
    };
    auto both_write = [&](const std::vector<int64_t>& ids) {
      const std::vector<float> values(ids.size() * dim, 0.25f);
      store.write(arena, ids.data(), static_cast<int64_t>(ids.size()), values.data(), -1);
      reference.write(reference_arena, ids.data(), static_cast<int64_t>(ids.size()), values.data(), -1);
    };
    const int64_t x = 42;
    both_step({x});                                   // round 1: x pending, listed for round 1
    both_write({x});                                  // created, listed for round 1 again
    both_write({100, 101, 102, 103, 104, 105});       // rows of round 1 too
    both_step({100, 101, 102, 103, 104, 105, 106});   // round 2: x spills
    CHECK(store.disk()->holds(x));
    store.prefetch(arena, &x, 1);                     // read back, not pushed: its entry released
    CHECK(store.disk()->find(x) >= 0 && !store.disk()->holds(x) && store.resident() > 0);
    both_step({104});                                 // round 3 (rows in memory: nothing spills)
    CHECK(store.disk()->find(x) >= 0 && !store.disk()->holds(x));
    both_step({105});                                 // round 4 expires round 1: x among them
    CHECK(store.stats(*arena).expired > 0);
    same(store, *arena, reference, *reference_arena);
  }
  {
    const DynamicSpec spec = dyn(0, 1, "none", 3);
    DynamicStore saved("dyn", spec, 0, dim);
    auto saved_arena = arena_for(saved, dim, "sgd", {{"lr", 0.1}});
    for (int64_t round = 0; round < 4; ++round) {  // rows last touched at rounds 1 .. 4
      std::vector<int64_t> ids;
      for (int64_t i = 0; i < 30; ++i) ids.push_back(1000 * (round + 1) + i);
      touch(saved, saved_arena, ids, dim);
    }
    const DynamicState state = saved.state(*saved_arena);
    DynamicStore store("dyn", spec, 0, dim, 8, std::make_unique<DiskTier>("dyn", dir, 0, record, nullptr));
    DynamicStore reference("dyn", spec, 0, dim);
    auto arena = arena_for(store, dim, "sgd", {{"lr", 0.1}});
    auto reference_arena = arena_for(reference, dim, "sgd", {{"lr", 0.1}});
    arena->rule().set_step(4);
    reference_arena->rule().set_step(4);
    store.restore(arena, state, [](int64_t) { return true; });
    reference.restore(reference_arena, state, [](int64_t) { return true; });
    CHECK(store.disk()->size() > 100 && store.stored() == 120);
    for (int64_t round = 5; round <= 8; ++round) {  // rounds 5 .. 8 expire rounds 1 .. 4's rows
      const std::vector<int64_t> ids = {round};
      store.prefetch(arena, ids.data(), 1);
      touch(store, arena, ids, dim);
      touch(reference, reference_arena, ids, dim);
      CHECK(store.stored() == reference.stored());
    }
    CHECK(reference.stored() <= 4);  // (all 120 restored rows expired)
    same(store, *arena, reference, *reference_arena);
  }
  rmdir(dir.c_str());
}

TEST(a_dynamic_table_trains_alike_at_one_rank_and_three) {
  const int64_t dim = 3;
  std::vector<std::vector<int64_t>> steps;
  std::mt19937_64 gen(11);
  std::vector<int64_t> pool;
  for (int i = 0; i < 40; ++i) pool.push_back(static_cast<int64_t>(gen()));
  for (int s = 0; s < 6; ++s) {
    std::vector<int64_t> ids;
    for (int i = 0; i < 12; ++i) ids.push_back(pool[gen() % pool.size()]);
    steps.push_back(ids);
  }
  auto train = [&](int ranks) {
    std::vector<float> result(pool.size() * dim);
    auto errors = run_ranks(ranks, [&](int rank, Client& c) {
      TableSpec spec{"dyn", 0, dim, 0, PartitionKind::kCyclic, "adam", {{"lr", 0.05}}, {}};
      spec.dynamic = dyn(24, 2, "lru");
      const int t = c.add_table(spec);
      for (const auto& ids : steps) {
        // Rank r pushes every ranks-th position, so all ranks' gradients together are the step's.
        std::vector<int64_t> mine;
        std::vector<float> grads;
        for (size_t i = rank; i < ids.size(); i += ranks) {
          mine.push_back(ids[i]);
          for (int j = 0; j < dim; ++j) grads.push_back(0.1f * static_cast<float>(i + j));
        }
        c.pull({TableBatch{t, mine.data(), static_cast<int64_t>(mine.size())}});
        c.push({TableBatch{t, mine.data(), static_cast<int64_t>(mine.size()), grads.data()}}, 1.0f);
      }
      c.barrier();
      if (rank == 0) c.read_rows(t, -1, pool.data(), static_cast<int64_t>(pool.size()), result.data());
      c.barrier();
    });
    for (auto& e : errors) CHECK(!e);
    return result;
  };
  // Eviction is per shard, so a bounded table matches only itself: compare one rank unbounded
  // to three unbounded, and three ranks to three.
  const std::vector<float> three = train(3), again = train(3);
  CHECK(three == again);
  auto unbounded = [&](int ranks) {
    std::vector<float> result(pool.size() * dim);
    auto errors = run_ranks(ranks, [&](int rank, Client& c) {
      TableSpec spec{"dyn", 0, dim, 0, PartitionKind::kCyclic, "adam", {{"lr", 0.05}}, {}};
      spec.dynamic = dyn(0, 2);
      const int t = c.add_table(spec);
      for (const auto& ids : steps) {
        std::vector<int64_t> mine;
        std::vector<float> grads;
        for (size_t i = rank; i < ids.size(); i += ranks) {
          mine.push_back(ids[i]);
          for (int j = 0; j < dim; ++j) grads.push_back(0.1f * static_cast<float>(i + j));
        }
        c.push({TableBatch{t, mine.data(), static_cast<int64_t>(mine.size()), grads.data()}}, 1.0f);
      }
      c.barrier();
      if (rank == 0) c.read_rows(t, -1, pool.data(), static_cast<int64_t>(pool.size()), result.data());
      c.barrier();
    });
    for (auto& e : errors) CHECK(!e);
    return result;
  };
  const std::vector<float> one = unbounded(1), spread = unbounded(3);
  for (size_t i = 0; i < one.size(); ++i) CHECK_NEAR(one[i], spread[i], 1e-6);
}

TEST(dynamic_state_saved_at_two_ranks_restores_at_one) {
  const int64_t dim = 2;
  std::vector<int64_t> ids = {-9, 3, std::numeric_limits<int64_t>::min(), 77, 123456789012345LL};
  std::vector<DynamicState> saved(2);
  std::vector<float> before(ids.size() * dim), after(ids.size() * dim);
  TableSpec spec{"dyn", 0, dim, 0, PartitionKind::kCyclic, "adagrad", {{"lr", 0.5}, {"initial_accumulator_value", 0.1}}, {}};
  spec.dynamic = dyn();
  auto errors = run_ranks(2, [&](int rank, Client& c) {
    const int t = c.add_table(spec);
    std::vector<float> grads(ids.size() * dim, 0.5f);
    if (rank == 0) c.push({TableBatch{t, ids.data(), static_cast<int64_t>(ids.size()), grads.data()}}, 1.0f);
    else c.push({TableBatch{t, nullptr, 0, nullptr}}, 1.0f);
    c.barrier();
    saved[rank] = c.dynamic_state(t);
    if (rank == 0) c.read_rows(t, -1, ids.data(), static_cast<int64_t>(ids.size()), before.data());
    c.barrier();
  });
  for (auto& e : errors) CHECK(!e);
  CHECK(saved[0].ids.size() + saved[1].ids.size() == ids.size());
  run_ranks(1, [&](int, Client& c) {
    const int t = c.add_table(spec);
    c.set_step(t, 1);
    for (const auto& s : saved) c.dynamic_restore(t, s);
    c.read_rows(t, -1, ids.data(), static_cast<int64_t>(ids.size()), after.data());
    CHECK(c.shard_rows(t) == static_cast<int64_t>(ids.size()));
    std::vector<float> acc(ids.size() * dim);
    c.read_rows(t, 0, ids.data(), static_cast<int64_t>(ids.size()), acc.data());
    for (float a : acc) CHECK_NEAR(a, 0.1 + 0.25, 1e-6);  // adagrad's accumulator came along
  });
  CHECK(before == after);
}

TEST(bad_dynamic_options_fail_on_every_rank_and_fixed_only_operations_refuse_dynamic_tables) {
  auto errors = run_ranks(3, [&](int, Client& c) {
    TableSpec spec{"dyn", 0, 2, 0, PartitionKind::kCyclic, "sgd", {{"lr", 1.0}}, {}};
    spec.dynamic = dyn(2);  // 3 shards
    CHECK_THROWS(c.add_table(spec), PSError, "capacity 2 is below one row per shard (3 shards)");
    spec.dynamic = dyn(30, 1, "mru");
    CHECK_THROWS(c.add_table(spec), PSError, "evict must be none, 'lru' or 'lfu'");
    spec.dynamic = dyn(0, 1, "lru");
    CHECK_THROWS(c.add_table(spec), PSError, "needs a capacity");
    spec.dynamic = dyn(30);
    const int t = c.add_table(spec);
    std::vector<float> out(10);
    CHECK_THROWS(c.read_table(t, -1, out.data()), PSError, "table 'dyn' is dynamic");
    std::vector<int64_t> ids = {1};
    std::vector<float> g = {1, 1};
    CHECK_THROWS(c.push({TableBatch{t, ids.data(), 1, g.data()}}, 1.0f, true), PSError, "cannot be replicated");
  });
  for (auto& e : errors) CHECK(!e);
}
