// The partitioner, deduplication, row aggregation and the client's routing of ids to shards.
#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <unordered_map>
#include <vector>

#include "check.h"
#include "ps/partitioner.h"
#include "ps/dedup.h"
#include "ps/id_index.h"
#include "ps/routing.h"

using namespace hybridsync;

TEST(partitioners_round_trip_and_cover_every_row_once) {
  for (PartitionKind kind : {PartitionKind::kCyclic, PartitionKind::kBlock}) {
    for (int shards : {1, 3, 4}) {
      Partitioner p(10, shards, kind);
      int64_t total = 0;
      for (int s = 0; s < shards; ++s) total += p.shard_rows(s);
      CHECK(total == 10);
      for (int64_t id = 0; id < 10; ++id) {
        const int s = p.shard_of(id);
        CHECK(s >= 0 && s < shards);
        CHECK(p.local_index(id) < p.shard_rows(s));
        CHECK(p.global_id(s, p.local_index(id)) == id);
      }
    }
  }
  Partitioner cyclic(10, 3, PartitionKind::kCyclic);
  CHECK(cyclic.shard_of(7) == 1 && cyclic.local_index(7) == 2);
  CHECK(cyclic.shard_rows(0) == 4 && cyclic.shard_rows(2) == 3);
  Partitioner block(10, 4, PartitionKind::kBlock);  // blocks of 3: the last shard holds 1
  CHECK(block.shard_of(7) == 2 && block.local_index(7) == 1);
  CHECK(block.shard_rows(3) == 1);
  CHECK_THROWS(Partitioner(10, 0, PartitionKind::kCyclic), PSError, "num_shards must be >= 1");
}

TEST(an_id_index_reused_over_many_resets_numbers_ids_as_a_fresh_map_would) {
  // reset() clears only the positions the previous use filled: no id of an earlier use may be
  // found again, whatever the sizes (smaller, larger, more ids than expected so the table grows)
  // and ids (-1, the empty marker, included).
  std::mt19937_64 rng(7);
  IdIndex index;
  for (int use = 0; use < 300; ++use) {
    const size_t expected = 1 + rng() % 2000;
    const int64_t n = static_cast<int64_t>(rng() % (3 * expected));  // up to 3x: grows past the sizing
    const int64_t span = 1 + static_cast<int64_t>(rng() % 5000);
    index.reset(expected);
    std::unordered_map<int64_t, int64_t> reference;
    std::vector<int64_t> ids(static_cast<size_t>(n));
    for (auto& id : ids) id = rng() % 7 == 0 ? -1 : static_cast<int64_t>(rng() % span) * 1000003;
    std::vector<std::pair<int64_t, bool>> got;
    if (use % 2) {  // by turns one at a time and in batches (of up to 3 parts: the table grows between)
      for (int64_t id : ids) got.push_back(index.insert(id));
    } else {
      for (int64_t at = 0; at < n;) {
        const int64_t part = std::min<int64_t>(n - at, 1 + static_cast<int64_t>(rng() % (n / 2 + 1)));
        index.insert_all(ids.data() + at, part,
                         [&](int64_t, int64_t slot, bool inserted) { got.emplace_back(slot, inserted); });
        at += part;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      const auto [it, fresh] = reference.emplace(ids[i], static_cast<int64_t>(reference.size()));
      if (got[i].first != it->second || got[i].second != fresh) {
        CHECK(got[i].first == it->second);
        CHECK(got[i].second == fresh);
        return;
      }
    }
    CHECK(index.size() == reference.size());
  }
}

TEST(an_id_index_numbers_extreme_ids_alike_one_at_a_time_and_in_batches) {
  const int64_t lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();
  const std::vector<int64_t> ids = {hi, lo, -1, 0, hi - 1, lo + 1, -2, hi, lo, -1, 1, -1};
  std::unordered_map<int64_t, int64_t> reference;
  std::vector<std::pair<int64_t, bool>> expected;
  for (int64_t id : ids) {
    const auto [it, fresh] = reference.emplace(id, static_cast<int64_t>(reference.size()));
    expected.emplace_back(it->second, fresh);
  }
  IdIndex never_reset;  // first use without reset(): the smallest table, grown as ids come
  std::vector<std::pair<int64_t, bool>> got;
  never_reset.insert_all(ids.data(), static_cast<int64_t>(ids.size()),
                         [&](int64_t, int64_t slot, bool inserted) { got.emplace_back(slot, inserted); });
  CHECK(got == expected);
  IdIndex index;
  for (int use = 0; use < 4; ++use) {  // reused, by turns one at a time and in a batch
    index.reset(use % 2 ? 4 : 0);      // expected below the ids' count: grown as they come
    got.clear();
    if (use % 2) {
      for (int64_t id : ids) got.push_back(index.insert(id));
    } else {
      int64_t next = 0;
      index.insert_all(ids.data(), static_cast<int64_t>(ids.size()), [&](int64_t i, int64_t slot, bool inserted) {
        CHECK(i == next++);
        got.emplace_back(slot, inserted);
      });
    }
    CHECK(got == expected);
    CHECK(index.size() == 8);
  }
  index.reset(16);  // one id many times: one slot
  const std::vector<int64_t> same(1000, 7);
  int64_t fresh = 0;
  index.insert_all(same.data(), 1000, [&](int64_t, int64_t slot, bool inserted) {
    CHECK(slot == 0);
    fresh += inserted;
  });
  CHECK(fresh == 1 && index.size() == 1);
  index.insert_all(same.data(), 0, [&](int64_t, int64_t, bool) { CHECK(!"an empty batch visits nothing"); });
}

// The two-pass reference: deduplicate() then sum_duplicates().
static std::vector<float> two_pass_sums(const std::vector<int64_t>& ids, const std::vector<float>& grads, int64_t dim,
                                        int64_t num_rows, Dedup* dedup) {
  *dedup = deduplicate("emb", ids.data(), static_cast<int64_t>(ids.size()), num_rows);
  GradientBuffer sums;
  sum_duplicates(*dedup, grads.data(), dim, &sums);
  return std::vector<float>(sums.begin(), sums.end());
}

TEST(deduplicate_and_sum_gives_the_two_pass_ids_and_floats_bit_for_bit) {
  // One Dedup and one buffer reused over many batches (sizes up and down, repeats early, late
  // or never, one id throughout, empty), a dynamic table's ids (any int64) included.
  std::mt19937_64 rng(3);
  std::vector<int64_t> unique;
  GradientBuffer sums;
  const int64_t lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();
  for (int use = 0; use < 400; ++use) {
    const int64_t dim = std::vector<int64_t>{1, 7, 16, 32, 37, 64, 128}[use % 7];  // (16-128: widths built apart)
    const int64_t n = use % 50 == 0 ? 0 : static_cast<int64_t>(1 + rng() % 600);
    const bool dynamic = use % 3 == 0;
    const int64_t num_rows = dynamic ? -1 : 1000;
    const int shape = use % 5;  // 0: random, 1: all distinct, 2: one id, 3: repeat only at the end, 4: at 1
    std::vector<int64_t> ids(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      int64_t id = static_cast<int64_t>(rng() % (shape == 1 ? 1000 : 1 + rng() % 1000));
      if (shape == 1 || shape == 3) id = (i * 7919 + use) % 1000;  // distinct (n <= 600 < 1000)
      if (shape == 2) id = 5;
      if (dynamic && rng() % 4 == 0) id = std::vector<int64_t>{lo, hi, -1, lo + 1, hi - 1}[rng() % 5];
      ids[static_cast<size_t>(i)] = id;
    }
    if (shape == 3 && n > 1) ids.back() = ids.front();
    if (shape == 4 && n > 1) ids[1] = ids[0];
    std::vector<float> grads(static_cast<size_t>(n * dim));
    for (auto& g : grads) g = static_cast<float>(static_cast<int64_t>(rng() % 20001) - 10000) * 1.37e-4f;
    Dedup expected_dedup;
    const std::vector<float> expected = two_pass_sums(ids, grads, dim, num_rows, &expected_dedup);
    const float* got = deduplicate_and_sum("emb", ids.data(), n, num_rows, grads.data(), dim, &unique, &sums);
    CHECK(unique == expected_dedup.unique);
    const bool repeats = unique.size() < ids.size();
    CHECK((got == grads.data()) == !repeats);  // no repeat: the input rows themselves, nothing copied
    if (!std::equal(expected.begin(), expected.end(), got,
                    [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; })) {
      CHECK(!"deduplicate_and_sum's floats differ from the two-pass sums");
      return;
    }
  }
}

TEST(deduplicate_and_sum_names_a_bad_id_before_touching_anything) {
  std::vector<int64_t> unique;
  GradientBuffer sums;
  const std::vector<int64_t> ids = {1, 1, 10};
  const std::vector<float> grads = {1, 2, 3};
  CHECK_THROWS(deduplicate_and_sum("emb", ids.data(), 3, 10, grads.data(), 1, &unique, &sums), PSIndexError,
               "table 'emb': id 10 is out of range [0, 10)");
  const std::vector<int64_t> negative = {-3};
  CHECK_THROWS(deduplicate_and_sum("emb", negative.data(), 1, 10, grads.data(), 1, &unique, &sums), PSIndexError,
               "id -3");
}

TEST(row_aggregator_reads_a_lone_unrepeated_source_in_place_and_copies_otherwise) {
  // Reference: per row, the sources' gradients in source order (first copied, then added), times
  // the scale -- the floats the aggregator gave before it read sources in place.
  auto reference = [](const std::vector<GradientRows>& sources, int64_t dim, float scale, std::vector<int64_t>* rows) {
    std::unordered_map<int64_t, size_t> at;
    std::vector<float> sums;
    rows->clear();
    for (const GradientRows& s : sources) {
      for (int64_t k = 0; k < s.n; ++k) {
        const auto [it, fresh] = at.emplace(s.rows[k], rows->size());
        if (fresh) {
          rows->push_back(s.rows[k]);
          sums.insert(sums.end(), s.grads + k * dim, s.grads + (k + 1) * dim);
        } else {
          for (int64_t j = 0; j < dim; ++j) sums[it->second * dim + j] += s.grads[k * dim + j];
        }
      }
    }
    if (scale != 1.0f) {
      for (float& v : sums) v *= scale;
    }
    return sums;
  };
  const int64_t dim = 3;
  const std::vector<int64_t> distinct = {4, 0, 9}, repeated = {4, 0, 4}, other = {0, 2};
  std::vector<float> g3(9), g2(6);
  for (size_t i = 0; i < g3.size(); ++i) g3[i] = 0.1f * static_cast<float>(i) + 0.013f;
  for (size_t i = 0; i < g2.size(); ++i) g2[i] = -0.7f * static_cast<float>(i) + 0.31f;
  RowAggregator agg;
  struct Case {
    std::vector<GradientRows> sources;
    float scale;
    bool in_place;
  };
  const std::vector<Case> cases = {
      {{GradientRows{distinct.data(), 3, g3.data()}}, 1.0f, true},
      {{GradientRows{distinct.data(), 3, g3.data()}}, 0.5f, false},  // the scale rewrites a copy
      {{GradientRows{repeated.data(), 3, g3.data()}}, 1.0f, false},
      {{GradientRows{distinct.data(), 3, g3.data()}, GradientRows{other.data(), 2, g2.data()}}, 1.0f, false},
      {{GradientRows{other.data(), 0, g2.data()}, GradientRows{repeated.data(), 3, g3.data()}}, 0.25f, false},
      {{GradientRows{distinct.data(), 3, g3.data()}}, 1.0f, true},  // again, after copies: in place
      {{}, 1.0f, false},
  };
  for (const Case& c : cases) {
    std::vector<int64_t> rows;
    const std::vector<float> expected = reference(c.sources, dim, c.scale, &rows);
    agg.sum(dim, c.sources, c.scale);
    CHECK(std::vector<int64_t>(agg.rows(), agg.rows() + agg.size()) == rows);
    CHECK((agg.sums() == g3.data()) == c.in_place);
    CHECK(expected.empty() || std::memcmp(agg.sums(), expected.data(), expected.size() * sizeof(float)) == 0);
  }
}

TEST(deduplicate_keeps_first_seen_order_and_names_bad_ids) {
  const std::vector<int64_t> ids = {5, 2, 5, 9, 2};
  Dedup d = deduplicate("emb", ids.data(), 5, 10);
  CHECK((d.unique == std::vector<int64_t>{5, 2, 9}));
  CHECK((d.inverse == std::vector<int64_t>{0, 1, 0, 2, 1}));
  const std::vector<int64_t> bad = {1, 10};
  CHECK_THROWS(deduplicate("emb", bad.data(), 2, 10), PSIndexError, "table 'emb': id 10 is out of range [0, 10)");
  const int64_t negative = -1;
  CHECK_THROWS(deduplicate("emb", &negative, 1, 10), PSIndexError, "id -1");
}

TEST(a_worker_sums_the_gradients_of_duplicate_ids_before_sending) {
  const std::vector<int64_t> ids = {7, 3, 7, 7};
  const std::vector<float> grads = {1, 10, 2, 20, 4, 40, 8, 80};  // dim 2
  const Dedup d = deduplicate("emb", ids.data(), 4, 10);
  GradientBuffer sums;
  sum_duplicates(d, grads.data(), 2, &sums);
  CHECK((std::vector<float>(sums.begin(), sums.end()) == std::vector<float>{13, 130, 2, 20}));
  // The buffer reused for another batch: its old values are overwritten, never added to.
  const std::vector<int64_t> again = {3, 5, 3};
  const std::vector<float> more = {0.5f, 1, 2, 3, 4, 5};
  sum_duplicates(deduplicate("emb", again.data(), 3, 10), more.data(), 2, &sums);
  CHECK((std::vector<float>(sums.begin(), sums.end()) == std::vector<float>{4.5f, 6, 2, 3}));
}

TEST(row_aggregator_sums_duplicates_across_workers_then_applies_once_per_row) {
  Shard s("emb", 3, 1, make_update_rule("sgd", {{"lr", 1.0}}));
  RowAggregator sums;
  const std::vector<int64_t> a = {2, 0, 2}, b = {2};
  const std::vector<float> ga = {1, 3, 1}, gb = {5};
  sums.step(s, {GradientRows{a.data(), 3, ga.data()}, GradientRows{b.data(), 1, gb.data()}}, 0.5f);
  CHECK(sums.size() == 2);
  CHECK(sums.rows()[0] == 2 && sums.rows()[1] == 0);  // first-seen order
  CHECK_NEAR(*s.row(2), -3.5, 1e-6);  // scaled sums: row 2 -> (1 + 1 + 5) / 2, row 0 -> 3 / 2
  CHECK_NEAR(*s.row(0), -1.5, 1e-6);
  CHECK_NEAR(*s.row(1), 0.0, 0.0);
  CHECK(s.rule().step() == 1);  // one step for the whole round
  sums.step(s, {GradientRows{b.data(), 1, gb.data()}}, 1.0f);  // buffers reused: only this round counts
  CHECK(sums.size() == 1);
  CHECK_NEAR(*s.row(2), -8.5, 1e-6);
  CHECK_NEAR(*s.row(0), -1.5, 1e-6);
}

TEST(row_aggregator_statistics_match_double_sums_and_are_skipped_when_off) {
  // Two sources over dims with and without a tail past the norms' float lanes; the reference
  // sums every square in double.
  for (int64_t dim : {1, 16, 37, 128}) {
    const std::vector<int64_t> a = {4, 1, 4, 7}, b = {1, 9};
    std::vector<float> ga(a.size() * dim), gb(b.size() * dim);
    for (size_t i = 0; i < ga.size(); ++i) ga[i] = 0.37f * static_cast<float>((i * 7919) % 101) - 18.0f;
    for (size_t i = 0; i < gb.size(); ++i) gb[i] = 1e-3f * static_cast<float>((i * 104729) % 89) - 0.04f;
    double local = 0.0;
    for (float g : ga) local += static_cast<double>(g) * g;
    for (float g : gb) local += static_cast<double>(g) * g;
    std::vector<double> summed(10 * dim, 0.0);  // by row id
    for (size_t i = 0; i < a.size(); ++i) {
      for (int64_t j = 0; j < dim; ++j) summed[a[i] * dim + j] += ga[i * dim + j];
    }
    for (size_t i = 0; i < b.size(); ++i) {
      for (int64_t j = 0; j < dim; ++j) summed[b[i] * dim + j] += gb[i * dim + j];
    }
    double combined = 0.0;
    for (double v : summed) combined += v * v;
    const std::vector<GradientRows> sources = {GradientRows{a.data(), 4, ga.data()}, GradientRows{b.data(), 2, gb.data()}};
    RowAggregator sums;
    sums.sum(dim, sources, 0.5f);
    CHECK(sums.size() == 4);
    CHECK_NEAR(sums.local_sq(), 0.0, 0.0);  // off by default: nothing reads them
    CHECK_NEAR(sums.combined_sq(), 0.0, 0.0);
    sums.set_statistics(true);
    sums.sum(dim, sources, 0.5f);
    CHECK_NEAR(sums.local_sq(), local, 1e-6 * local);  // before the scale
    CHECK_NEAR(sums.combined_sq(), combined, 1e-6 * combined);
  }
}

TEST(routing_groups_unique_ids_by_destination_with_their_local_rows) {
  Partitioner p(12, 3, PartitionKind::kCyclic);
  const std::vector<int64_t> ids = {4, 3, 4, 8, 0, 11};
  Routing r = route_ids("emb", p, ids.data(), 6, 3);
  CHECK((r.dedup.unique == std::vector<int64_t>{4, 3, 8, 0, 11}));
  CHECK(r.count(0) == 2 && r.count(1) == 1 && r.count(2) == 2);
  for (int d = 0; d < 3; ++d) {
    for (int64_t k = r.offset[d]; k < r.offset[d + 1]; ++k) {
      const int64_t id = r.dedup.unique[r.order[k]];
      CHECK(p.shard_of(id) == d);
      CHECK(r.local[k] == p.local_index(id));
    }
  }
  const std::vector<int64_t> bad = {12};
  CHECK_THROWS(route_ids("emb", p, bad.data(), 1, 3), PSIndexError, "id 12");
}
