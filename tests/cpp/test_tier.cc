// A shard's disk tier (DiskTier) against a plain map of key -> record: random adds and removes,
// compactions (automatic and explicit), reads through the file's mapping and through pread, a
// full disk that compaction makes room on or that fails with nothing changed, and a file cut
// short under the tier.
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "../../csrc/ps/tier.h"
#include "check.h"
#include "hybridsync/ps.h"

using namespace hybridsync;

namespace {

// A new directory, removed at the end of the test (declared before the tiers in it: they remove
// their files first).
struct ScratchDir {
  std::string path;
  ScratchDir() {
    char tmpl[] = "/tmp/hybridsync-tier-test-XXXXXX";
    const char* made = mkdtemp(tmpl);
    CHECK(made != nullptr);
    path = made ? made : "/tmp";
  }
  ~ScratchDir() { rmdir(path.c_str()); }
};

// A record that says whose it is and when it was written: key, version, then filler bytes.
std::vector<char> record_of(int64_t key, int64_t version, int64_t bytes) {
  std::vector<char> r(static_cast<size_t>(bytes));
  for (int64_t b = 0; b < bytes; ++b) r[static_cast<size_t>(b)] = static_cast<char>((key * 131 + version * 7 + b) & 0xff);
  return r;
}

int64_t file_size(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

// Every entry of the tier reads back as `expected` says, through the mapping and through pread.
// Released entries (see DiskTier::release) hold no row and are not read.
void check_contents(DiskTier& tier, const std::map<int64_t, std::vector<char>>& expected) {
  CHECK(tier.size() == static_cast<int64_t>(expected.size()));
  std::vector<int64_t> entries;
  for (int64_t e = 0; e < tier.entries(); ++e) {
    if (!tier.released(e)) entries.push_back(e);
  }
  CHECK(static_cast<int64_t>(entries.size()) == tier.size());
  std::shuffle(entries.begin(), entries.end(), std::mt19937_64(entries.size()));
  const int64_t bytes = tier.slot_bytes();
  for (const bool mapped : {true, false}) {
    tier.set_use_mapping(mapped);
    std::vector<char> buf(entries.size() * static_cast<size_t>(bytes));
    tier.read(entries.data(), static_cast<int64_t>(entries.size()), buf.data());
    for (size_t i = 0; i < entries.size(); ++i) {
      const auto it = expected.find(tier.key(entries[i]));
      CHECK(it != expected.end());
      if (it == expected.end()) continue;
      CHECK(std::equal(it->second.begin(), it->second.end(), buf.begin() + static_cast<int64_t>(i) * bytes));
    }
  }
  tier.set_use_mapping(true);
  CHECK(tier.span() >= tier.size());
  CHECK(file_size(tier.path()) >= tier.span() * bytes);
}

}  // namespace

TEST(disk_tier_matches_a_map_under_random_adds_removes_and_compactions) {
  const ScratchDir scratch;
  const std::string& dir = scratch.path;
  const int64_t bytes = 4096;  // (large slots: the automatic compaction's 4 MiB of holes come soon)
  DiskTier tier("t", dir, 0, bytes, nullptr);
  std::map<int64_t, std::vector<char>> expected;
  std::mt19937_64 rng(7);
  int64_t next_key = 0, version = 0;
  for (int round = 0; round < 60; ++round) {
    // Add a batch of new keys (one append), then take a random share back out (holes).
    const int64_t n = 1 + static_cast<int64_t>(rng() % 200);
    std::vector<int64_t> keys;
    std::vector<char> payloads;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t key = static_cast<int64_t>(rng() % 2 ? next_key++ : -1 - next_key++);  // (any int64 key)
      const std::vector<char> r = record_of(key, ++version, bytes);
      keys.push_back(key);
      payloads.insert(payloads.end(), r.begin(), r.end());
      expected[key] = r;
    }
    tier.add(keys.data(), n, payloads.data());
    std::vector<int64_t> victims;
    for (int64_t e = 0; e < tier.size(); ++e) {
      if (rng() % 3 == 0) victims.push_back(e);
    }
    std::vector<int64_t> victim_keys;
    for (const int64_t e : victims) victim_keys.push_back(tier.key(e));
    tier.remove(victims);
    for (const int64_t key : victim_keys) expected.erase(key);
    for (const int64_t key : victim_keys) CHECK(tier.find(key) < 0);
    if (round % 20 == 19) {
      tier.compact();
      CHECK(tier.span() == tier.size());
      CHECK(file_size(tier.path()) == tier.size() * bytes);  // (the holes' space given back)
    }
    check_contents(tier, expected);
  }
  CHECK(tier.compactions() > 3);  // (automatic ones too)
  const int64_t written = tier.bytes_written();
  tier.remove([&] {
    std::vector<int64_t> all(static_cast<size_t>(tier.size()));
    for (int64_t e = 0; e < tier.size(); ++e) all[static_cast<size_t>(e)] = e;
    return all;
  }());
  CHECK(tier.size() == 0 && tier.span() == 0 && file_size(tier.path()) == 0);  // (an empty tier is an empty file)
  CHECK(tier.bytes_written() == written);
}

TEST(released_entries_keep_their_keys_and_indices_and_take_rows_again_without_a_new_entry) {
  // A dynamic table's row read back into memory releases its entry (the key and index stay, the
  // slot becomes a hole); when the row goes to disk again, store() gives the same entry a slot.
  // Against a map of the rows held and a map of key -> entry: random adds, releases, stores
  // that reuse released entries beside new keys, removes of both kinds, compactions.
  const ScratchDir scratch;
  const int64_t bytes = 2048;  // (the automatic compaction's 4 MiB of holes come soon)
  DiskTier tier("t", scratch.path, 0, bytes, nullptr);
  std::map<int64_t, std::vector<char>> held;  // key -> record, rows the file holds
  std::map<int64_t, int64_t> entry_of;        // every key with an entry, released or not
  std::mt19937_64 rng(11);
  int64_t next_key = 0, version = 0;
  auto check_entries = [&] {
    CHECK(tier.entries() == static_cast<int64_t>(entry_of.size()));
    CHECK(tier.released_count() == tier.entries() - tier.size());
    for (const auto& [key, e] : entry_of) {
      CHECK(tier.find(key) == e && tier.key(e) == key);
      CHECK(tier.released(e) == (held.count(key) == 0) && tier.holds(key) == (held.count(key) == 1));
    }
    check_contents(tier, held);
  };
  for (int round = 0; round < 80; ++round) {
    // Release a random share of the rows held (read back into memory).
    std::vector<int64_t> released;
    for (const auto& [key, e] : entry_of) {
      if (held.count(key) && rng() % 3 == 0) released.push_back(e);
    }
    tier.release(released.data(), static_cast<int64_t>(released.size()));
    for (const int64_t e : released) held.erase(tier.key(e));
    // Store some released keys again (new versions), mixed with new keys, in one call.
    std::vector<int64_t> keys, entries;
    std::vector<char> payloads;
    for (const auto& [key, e] : entry_of) {
      if (!held.count(key) && rng() % 2 == 0) {
        keys.push_back(key);
        entries.push_back(e);
      }
    }
    for (int64_t i = static_cast<int64_t>(rng() % 60); i > 0; --i) {
      keys.push_back(next_key++ * (rng() % 2 ? 1 : -1));
      entries.push_back(-1);
    }
    std::shuffle(keys.begin(), keys.end(), std::mt19937_64(round));  // (the pairs stay together below)
    std::shuffle(entries.begin(), entries.end(), std::mt19937_64(round));
    const int64_t first_new = tier.entries();
    for (const int64_t key : keys) {
      const std::vector<char> r = record_of(key, ++version, bytes);
      payloads.insert(payloads.end(), r.begin(), r.end());
      held[key] = r;
    }
    tier.store(keys.data(), entries.data(), static_cast<int64_t>(keys.size()), payloads.data());
    int64_t appended = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (entries[i] < 0) entry_of[keys[i]] = first_new + appended++;  // (new entries in order)
    }
    check_entries();
    // Remove a few entries of either kind (rows evicted or expired, on disk or in memory).
    std::vector<int64_t> victims;
    for (int64_t e = 0; e < tier.entries(); ++e) {
      if (rng() % 7 == 0) victims.push_back(e);
    }
    for (const int64_t e : victims) {
      held.erase(tier.key(e));
      entry_of.erase(tier.key(e));
    }
    for (const auto& [from, to] : tier.remove(victims)) entry_of[tier.key(to)] = to;
    check_entries();
    if (round % 25 == 24) {
      tier.compact();
      CHECK(tier.span() == tier.size());
      check_entries();
    }
  }
  CHECK(tier.compactions() > 1);  // (automatic ones too)
  // Every row read back: the file is empty, the entries stay; compaction gives its space back.
  std::vector<int64_t> all;
  for (const auto& [key, e] : entry_of) {
    if (held.count(key)) all.push_back(e);
  }
  tier.release(all.data(), static_cast<int64_t>(all.size()));
  held.clear();
  tier.compact();
  CHECK(tier.size() == 0 && tier.span() == 0 && file_size(tier.path()) == 0);
  check_entries();
}

TEST(a_disk_tier_compaction_moves_rows_once_and_appends_stay_sequential) {
  const ScratchDir scratch;
  const std::string& dir = scratch.path;
  const int64_t bytes = 64;
  DiskTier tier("t", dir, 0, bytes, nullptr);
  std::map<int64_t, std::vector<char>> expected;
  std::vector<int64_t> keys(1000);
  std::vector<char> payloads;
  for (int64_t k = 0; k < 1000; ++k) {
    keys[static_cast<size_t>(k)] = k;
    const std::vector<char> r = record_of(k, 0, bytes);
    payloads.insert(payloads.end(), r.begin(), r.end());
    expected[k] = r;
  }
  tier.add(keys.data(), 1000, payloads.data());
  for (int64_t e = 0; e < 1000; ++e) CHECK(tier.slot(e) == e);  // one append, in order
  // Every other row out: holes, not reused by the next add (it appends after them).
  std::vector<int64_t> odd;
  for (int64_t e = 0; e < tier.size(); ++e) {
    if (tier.key(e) % 2) odd.push_back(e);
  }
  tier.remove(odd);
  for (int64_t k = 1; k < 1000; k += 2) expected.erase(k);
  const int64_t key = 5000;
  const std::vector<char> r = record_of(key, 1, bytes);
  tier.add(&key, 1, r.data());
  expected[key] = r;
  CHECK(tier.slot(tier.find(key)) == 1000 && tier.span() == 1001);
  const int64_t read_before = tier.bytes_read(), written_before = tier.bytes_written();
  tier.compact();
  check_contents(tier, expected);
  CHECK(tier.span() == 501);
  // Row 0 was in place: 500 rows moved, each read and written once.
  CHECK(tier.bytes_written() - written_before == 500 * bytes);
  CHECK(tier.bytes_read() - read_before >= 500 * bytes);
  std::vector<int64_t> slots;
  for (int64_t e = 0; e < tier.size(); ++e) slots.push_back(tier.slot(e));
  std::sort(slots.begin(), slots.end());
  for (int64_t i = 0; i < static_cast<int64_t>(slots.size()); ++i) CHECK(slots[static_cast<size_t>(i)] == i);
}

TEST(a_full_disk_tier_compacts_to_make_room_or_fails_with_nothing_added) {
  const ScratchDir scratch;
  const std::string& dir = scratch.path;
  const int64_t bytes = 128;
  DiskTier tier("full", dir, 0, bytes, nullptr);
  std::map<int64_t, std::vector<char>> expected;
  std::vector<int64_t> keys;
  std::vector<char> payloads;
  for (int64_t k = 0; k < 100; ++k) {
    keys.push_back(k);
    const std::vector<char> r = record_of(k, 0, bytes);
    payloads.insert(payloads.end(), r.begin(), r.end());
    expected[k] = r;
  }
  tier.add(keys.data(), 100, payloads.data());
  std::vector<int64_t> first_half;
  for (int64_t e = 0; e < tier.size(); ++e) {
    if (tier.key(e) < 50) first_half.push_back(e);
  }
  tier.remove(first_half);  // 50 holes at the front of the file
  for (int64_t k = 0; k < 50; ++k) expected.erase(k);
  // The disk is full at the file's size (RLIMIT_FSIZE; a write past it fails with EFBIG).
  struct rlimit saved;
  getrlimit(RLIMIT_FSIZE, &saved);
  const auto old_handler = signal(SIGXFSZ, SIG_IGN);
  struct rlimit full = saved;
  full.rlim_cur = static_cast<rlim_t>(file_size(tier.path()));
  setrlimit(RLIMIT_FSIZE, &full);
  // 40 rows fit once the 50 holes are compacted away.
  std::vector<int64_t> more;
  std::vector<char> more_payloads;
  for (int64_t k = 1000; k < 1040; ++k) {
    more.push_back(k);
    const std::vector<char> r = record_of(k, 1, bytes);
    more_payloads.insert(more_payloads.end(), r.begin(), r.end());
    expected[k] = r;
  }
  tier.add(more.data(), 40, more_payloads.data());
  CHECK(tier.compactions() == 1 && tier.span() == 90);
  check_contents(tier, expected);
  // 20 more do not fit: an error naming the file, and the tier holds what it held.
  std::vector<int64_t> too_many;
  std::vector<char> too_many_payloads;
  for (int64_t k = 2000; k < 2020; ++k) {
    too_many.push_back(k);
    const std::vector<char> r = record_of(k, 2, bytes);
    too_many_payloads.insert(too_many_payloads.end(), r.begin(), r.end());
  }
  std::string message;
  try {
    tier.add(too_many.data(), 20, too_many_payloads.data());
  } catch (const PSError& e) {
    message = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &saved);
  signal(SIGXFSZ, old_handler);
  CHECK(message.find(tier.path()) != std::string::npos);
  CHECK(message.find("could not take") != std::string::npos);
  for (const int64_t k : too_many) CHECK(tier.find(k) < 0);
  check_contents(tier, expected);
  tier.add(too_many.data(), 20, too_many_payloads.data());  // room again: it goes on
  CHECK(tier.size() == 110);
}

TEST(a_disk_tier_file_cut_short_is_an_error_naming_it_on_either_read_path) {
  const ScratchDir scratch;
  const std::string& dir = scratch.path;
  const int64_t bytes = 256;
  for (const bool mapped : {true, false}) {
    DiskTier tier("cut", dir, 0, bytes, nullptr);
    tier.set_use_mapping(mapped);
    std::vector<int64_t> keys = {10, 20, 30};
    std::vector<char> payloads(3 * bytes, 1);
    tier.add(keys.data(), 3, payloads.data());
    CHECK(truncate(tier.path().c_str(), bytes) == 0);
    const int64_t last = tier.find(30);
    std::vector<char> buf(bytes);
    std::string message;
    try {
      tier.read(&last, 1, buf.data());
    } catch (const PSError& e) {
      message = e.what();
    }
    CHECK(message.find(tier.path()) != std::string::npos && message.find("truncated") != std::string::npos);
    message.clear();
    try {
      tier.check();
    } catch (const PSError& e) {
      message = e.what();
    }
    CHECK(message.find("truncated") != std::string::npos);
  }
}

TEST(a_bulk_read_of_a_disk_tier_reads_right_and_later_reads_still_do) {
  const ScratchDir scratch;
  const std::string& dir = scratch.path;
  const int64_t bytes = 16, n = 20000;  // (a read of 16384 rows or more lets the mapped pages go)
  DiskTier tier("bulk", dir, 0, bytes, nullptr);
  std::map<int64_t, std::vector<char>> expected;
  std::vector<int64_t> keys;
  std::vector<char> payloads;
  for (int64_t k = 0; k < n; ++k) {
    keys.push_back(k * 3);
    const std::vector<char> r = record_of(k * 3, 0, bytes);
    payloads.insert(payloads.end(), r.begin(), r.end());
    expected[k * 3] = r;
  }
  tier.add(keys.data(), n, payloads.data());
  check_contents(tier, expected);  // (bulk: every row at once)
  for (const int64_t key : {0, 3, 30000, 59997}) {
    const int64_t e = tier.find(key);
    std::vector<char> buf(bytes);
    tier.read(&e, 1, buf.data());
    CHECK(buf == expected[key]);
  }
}
