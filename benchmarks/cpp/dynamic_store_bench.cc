// Where a dynamic shard's time goes when new ids arrive (no MPI: one DynamicStore, as a shard's
// server sees it). Per round: a pull of `batch` unique ids (`fresh` of them never seen) and the
// push round that follows, on a shard at its capacity share (LRU), dim 16, Adagrad; and the
// pieces alone: the initial row, the id map's find / insert / erase at the shard's size.
//
//   cmake --build <build dir> --target hybridsync_dynamic_bench && <build dir>/hybridsync_dynamic_bench
//
// Prints ns per id (per new id where the piece only runs for new ids): medians of 5 repeats for the
// pieces, means over the rounds for a round.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include "ps/dynamic_store.h"
#include "ps/seeded.h"
#include "ps/update_rule.h"

using namespace hybridsync;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kDim = 16, kShare = 1'000'000, kBatch = 15'000, kFresh = 5'000, kRounds = 40;

double seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

DynamicSpec spec() {
  DynamicSpec d;
  d.on = true;
  d.capacity = kShare;
  d.evict = "lru";
  d.seed = 1;
  d.init = "normal";
  d.init_a = 0.0;
  d.init_b = 0.01;
  return d;
}

// A round's ids: kBatch - fresh hot ids already stored (the low counters) and `fresh` new ones.
std::vector<int64_t> round_ids(int64_t round, int64_t fresh, int64_t stored_ids) {
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < kBatch - fresh; ++i) ids.push_back(static_cast<int64_t>(mix64(i % stored_ids)));
  for (int64_t i = 0; i < fresh; ++i) ids.push_back(static_cast<int64_t>(mix64((1ull << 40) + round * kBatch + i)));
  return ids;
}

// ns per round of a shard holding kShare rows: pull + push of kBatch ids of which `fresh` are
// new; `share`: the shard's capacity share (kShare: full, each new row evicts one; more: no
// eviction).
double rounds(int64_t fresh, int64_t share = kShare) {
  DynamicStore store("bench", spec(), share, kDim);
  auto arena = std::make_unique<Shard>("bench", store.arena_rows(), kDim,
                                       make_update_rule("adagrad", {{"lr", 0.05}}));
  std::vector<float> grads(kBatch * kDim, 0.01f), out(kBatch * kDim);
  // Fill to the share first (rounds of new ids), then time rounds at capacity.
  std::vector<int64_t> fill;
  for (int64_t i = 0; i < kShare; ++i) {
    fill.push_back(static_cast<int64_t>(mix64(i)));
    if (static_cast<int64_t>(fill.size()) == 100'000) {
      store.step(arena, fill.data(), static_cast<int64_t>(fill.size()), std::vector<float>(fill.size() * kDim).data());
      fill.clear();
    }
  }
  double total = 0, pulls = 0;  // means: eviction runs in a batch every few rounds
  for (int64_t r = 0; r < kRounds; ++r) {
    const std::vector<int64_t> ids = round_ids(r, fresh, kShare / 2);
    const auto t0 = Clock::now();
    store.read(*arena, ids.data(), kBatch, out.data(), -1);
    pulls += seconds(t0) * 1e9;
    store.step(arena, ids.data(), kBatch, grads.data());
    total += seconds(t0) * 1e9;
  }
  std::printf("  (%lld new, share %lld: pull %.0f us, push round %.0f us)\n", static_cast<long long>(fresh),
              static_cast<long long>(share), pulls / kRounds / 1e3, (total - pulls) / kRounds / 1e3);
  return total / kRounds;
}

// ns per round of a fixed-size shard of kShare rows: gather + apply of kBatch distinct rows.
double fixed_rounds() {
  Shard shard("fixed", kShare, kDim, make_update_rule("adagrad", {{"lr", 0.05}}));
  std::vector<float> grads(kBatch * kDim, 0.01f), out(kBatch * kDim);
  std::vector<double> times;
  for (int64_t r = 0; r < kRounds; ++r) {
    std::vector<int64_t> local;
    for (int64_t i = 0; i < kBatch; ++i) local.push_back(static_cast<int64_t>(mix64(i + r * 7) % kShare));
    std::sort(local.begin(), local.end());
    local.erase(std::unique(local.begin(), local.end()), local.end());
    const auto t0 = Clock::now();
    shard.gather(local.data(), static_cast<int64_t>(local.size()), out.data());
    shard.rule().begin_step();
    shard.apply(local.data(), static_cast<int64_t>(local.size()), grads.data());
    times.push_back(seconds(t0) * 1e9 * kBatch / static_cast<double>(local.size()));
  }
  return median(times);
}

}  // namespace

int main() {
  std::vector<float> row(kDim);
  DynamicStore store("bench", spec(), kShare, kDim);
  std::vector<double> init, find_hit, insert, erase;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
    float sink = 0;
    for (int64_t i = 0; i < kShare; ++i) {
      store.initial_row(i + rep * kShare, row.data());
      sink += row[0];
    }
    init.push_back(seconds(t0) * 1e9 / kShare + (sink == 12345.f ? 1 : 0));
    IdMap map;
    map.reserve(kShare);
    t0 = Clock::now();
    for (int64_t i = 0; i < kShare; ++i) map.insert(static_cast<int64_t>(mix64(i + rep)));
    insert.push_back(seconds(t0) * 1e9 / kShare);
    t0 = Clock::now();
    int64_t found = 0;
    for (int64_t i = 0; i < kShare; ++i) found += map.find(static_cast<int64_t>(mix64((i * 7919) % kShare + rep)));
    find_hit.push_back(seconds(t0) * 1e9 / kShare + (found == -1 ? 1 : 0));
    t0 = Clock::now();
    for (int64_t i = 0; i < kShare / 2; ++i) map.erase_at(map.find(static_cast<int64_t>(mix64(2 * i + rep))));
    erase.push_back(seconds(t0) * 1e9 / (kShare / 2));
  }
  std::printf("dim %lld, shard share %lld rows\n", static_cast<long long>(kDim), static_cast<long long>(kShare));
  std::printf("initial row (normal):        %7.1f ns per row\n", median(init));
  std::printf("id map insert (reserved):    %7.1f ns per id\n", median(insert));
  std::printf("id map find (present):       %7.1f ns per id\n", median(find_hit));
  std::printf("id map find + erase:         %7.1f ns per id\n", median(erase));
  const double none = rounds(0), some = rounds(kFresh), fixed = fixed_rounds();
  const double room = rounds(kFresh, 2 * kShare);
  std::printf("round of a fixed shard, %lld rows:      %8.0f us\n", static_cast<long long>(kBatch), fixed / 1e3);
  std::printf("round at capacity, %lld ids, none new: %8.0f us\n", static_cast<long long>(kBatch), none / 1e3);
  std::printf("round at capacity, %lld ids, %lld new:  %8.0f us  -> %.0f ns per new id\n",
              static_cast<long long>(kBatch), static_cast<long long>(kFresh), some / 1e3, (some - none) / kFresh);
  std::printf("round below capacity, %lld ids, %lld new: %8.0f us  -> %.0f ns per new id (no eviction)\n",
              static_cast<long long>(kBatch), static_cast<long long>(kFresh), room / 1e3, (room - none) / kFresh);
  return 0;
}
