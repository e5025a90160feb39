// Bounded staleness over real Clients (ranks as threads): pulls of a table with staleness k miss
// at most the other ranks' last k pushes and never the puller's own, a slow rank holds the others
// only at the bound, nothing pushed is lost, and ranks that join (uneven data) hold no one.
#include <chrono>
#include <thread>
#include <vector>

#include "check.h"
#include "hybridsync/ps.h"
#include "inproc_transport.h"

using namespace hybridsync;

namespace {

std::string message_of(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

// Row q counts rank q's pushes: each adds 1 to it (sgd, lr 1, gradient -1).
void push_count(Client& c, int t, int rank) {
  const int64_t id = rank;
  const float minus_one = -1.0f;
  c.push({TableBatch{t, &id, 1, &minus_one}}, 1.0f);
}

std::vector<float> pull_all(Client& c, int t, int64_t rows) {
  std::vector<int64_t> ids(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) ids[static_cast<size_t>(i)] = i;
  std::vector<float> out(static_cast<size_t>(rows));
  c.pull({TableBatch{t, ids.data(), rows, nullptr, -1.0, out.data()}});
  return out;
}

}  // namespace

TEST(bounded_pulls_miss_at_most_k_steps_of_others_and_none_of_their_own) {
  const int P = 3, steps = 30, k = 2;
  auto errors = run_ranks(P, [&](int rank, Client& c) {
    const int t = c.add_table(TableSpec{"t", P, 1, 0, PartitionKind::kCyclic, "sgd", {{"lr", 1.0}}});
    c.set_staleness(t, k);
    for (int step = 0; step < steps; ++step) {
      const std::vector<float> rows = pull_all(c, t, P);
      for (int q = 0; q < P; ++q) {
        if (q == rank) {
          CHECK_NEAR(rows[q], step, 0.0);  // every own push, at once
        } else {
          CHECK(rows[q] >= step - k);  // at most k of q's steps missing
        }
      }
      const StalenessStats s = c.staleness(t);
      CHECK(s.last_lag <= k);
      if (rank == P - 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the straggler
      push_count(c, t, rank);
    }
    const StalenessStats s = c.staleness(t);
    CHECK(s.staleness == k && s.clock == steps && s.pulls == steps);
    CHECK(s.max_lag <= k);
    if (rank == 0) CHECK(s.held > 0 && s.max_lag == k);  // the fast rank ran ahead to the bound, then waited
    c.barrier();  // every push in flight is applied before it
    const std::vector<float> rows = pull_all(c, t, P);
    for (int q = 0; q < P; ++q) CHECK_NEAR(rows[q], steps, 0.0);
  });
  for (auto& e : errors) CHECK(message_of(e).empty());
}

TEST(staleness_zero_stays_collective_and_a_negative_one_is_refused) {
  auto errors = run_ranks(2, [&](int rank, Client& c) {
    const int t = c.add_table(TableSpec{"t", 2, 1, 0, PartitionKind::kCyclic, "sgd", {{"lr", 1.0}}});
    c.set_staleness(t, 0);
    for (int step = 0; step < 5; ++step) {
      const std::vector<float> rows = pull_all(c, t, 2);
      for (int q = 0; q < 2; ++q) CHECK_NEAR(rows[q], step, 0.0);  // synchronous: every push of every rank
      push_count(c, t, rank);
    }
    CHECK(c.staleness(t).pulls == 0);
    CHECK(c.round_stats(t).ranks == 2);  // collective rounds
    bool refused = false;
    try {
      c.set_staleness(t, -1);
    } catch (const PSError& e) {
      refused = std::string(e.what()).find("staleness must be >= 0") != std::string::npos;
    }
    CHECK(refused);
  });
  for (auto& e : errors) CHECK(message_of(e).empty());
}

TEST(a_rank_that_joined_holds_no_bounded_pull_and_clocks_restart_after_the_join) {
  const int k = 1;
  auto errors = run_ranks(2, [&](int rank, Client& c) {
    const int t = c.add_table(TableSpec{"t", 2, 1, 0, PartitionKind::kCyclic, "sgd", {{"lr", 1.0}}});
    c.set_staleness(t, k);
    const int mine = rank == 0 ? 8 : 3;  // uneven data: rank 1 runs out first
    for (int step = 0; step < mine; ++step) {
      pull_all(c, t, 2);
      push_count(c, t, rank);
    }
    c.join_begin();
    c.join_finish();
    CHECK(c.staleness(t).clock == 0);
    for (int step = 0; step < 4; ++step) {  // a second epoch, even: nobody waits for the old gap
      const std::vector<float> rows = pull_all(c, t, 2);
      CHECK_NEAR(rows[rank], (rank == 0 ? 8 : 3) + step, 0.0);
      push_count(c, t, rank);
    }
    c.barrier();
    const std::vector<float> rows = pull_all(c, t, 2);
    CHECK_NEAR(rows[0], 12, 0.0);
    CHECK_NEAR(rows[1], 7, 0.0);
  });
  for (auto& e : errors) CHECK(message_of(e).empty());
}

TEST(a_bad_bounded_push_is_raised_once_on_every_rank_and_holds_no_one) {
  // The last rank pushes an id out of range at step 2: it throws at once; every shard counts the
  // step and tells the others, who throw once (every shard tells), within the bound's reach.
  const int P = 3, steps = 8, k = 1, bad_rank = P - 1, bad_step = 2;
  auto errors = run_ranks(P, [&](int rank, Client& c) {
    const int t = c.add_table(TableSpec{"emb", P, 1, 0, PartitionKind::kCyclic, "sgd", {{"lr", 1.0}}});
    c.set_staleness(t, k);
    int raised = 0, raised_at = -1;
    std::string text;
    for (int step = 0; step < steps; ++step) {
      try {
        pull_all(c, t, P);
        const int64_t id = rank == bad_rank && step == bad_step ? 99 : rank;
        const float minus_one = -1.0f;
        c.push({TableBatch{t, &id, 1, &minus_one}}, 1.0f);
      } catch (const PSIndexError& e) {
        CHECK(rank == bad_rank);
        ++raised, raised_at = step, text = e.what();
      } catch (const PSTransportError&) {
        throw;
      } catch (const PSRemoteError& e) {
        CHECK(rank != bad_rank);
        ++raised, raised_at = step, text = e.what();
      }
    }
    c.barrier();  // nobody waits for the bad push
    CHECK(raised == 1);
    CHECK(text.find("table 'emb': id 99 is out of range [0, 3)") != std::string::npos);
    if (rank == bad_rank) {
      CHECK(raised_at == bad_step);
    } else {
      CHECK(text.find("failed on rank 2") != std::string::npos);
      CHECK(raised_at >= bad_step - k && raised_at <= bad_step + k + 1);
    }
    const std::vector<float> rows = pull_all(c, t, P);
    for (int q = 0; q < P; ++q) CHECK_NEAR(rows[q], steps - 1, 0.0);  // each rank lost one push, no more
  });
  for (auto& e : errors) CHECK(message_of(e).empty());
}
