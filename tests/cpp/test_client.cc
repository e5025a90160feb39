// Real Clients over the in-process transport: a world of one (registration, pushes applied at
// once, in-order pulls, replicas, loading, dropping, errors, threads sharing a Client), and
// several ranks as threads (parity with one rank, one-sided reads served while the owner
// computes, protocol mismatches failing every rank at once, fragmented messages).
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "check.h"
#include "hybridsync/ps.h"
#include "inproc_transport.h"
#include "transport/transport.h"

using namespace hybridsync;

namespace {

std::unique_ptr<Client> one_rank(InprocHub& hub) { return inproc_client(hub, 0); }

TableSpec spec(const std::string& rule = "sgd", std::map<std::string, double> hparams = {{"lr", 1.0}}) {
  return TableSpec{"emb", 6, 2, 0, PartitionKind::kCyclic, rule, std::move(hparams)};
}

std::vector<float> iota(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i);
  return v;
}

std::vector<float> whole(Client& c, int table) {
  const TableSpec s = c.spec(table);
  std::vector<float> out(static_cast<size_t>(s.num_rows * s.dim));
  c.read_table(table, -1, out.data());
  return out;
}

// The message of a rank's exception ("" when it finished).
std::string message(const std::exception_ptr& e) {
  if (!e) return "";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

}  // namespace

TEST(transports_are_made_by_name_and_unknown_names_list_the_known) {
  InprocHub hub(1);
  InprocEndpoint at{&hub, 0};
  CHECK(make_transport("inproc", TransportConfig{&at, WaitPolicy{}, 0}) != nullptr);  // registered by its own file
  CHECK_THROWS(make_transport("tcp", TransportConfig{}), PSError, "unknown PS transport 'tcp' (known: inproc, mpi)");
  CHECK_THROWS(make_transport("mpi", TransportConfig{}), PSError, "needs a communicator");
}

TEST(pull_returns_rows_of_unique_ids) {
  InprocHub hub(1);
  auto c = one_rank(hub);
  const int t = c->add_table(spec());
  const std::vector<float> init = iota(12);
  c->load_local(t, -1, init.data());
  const std::vector<int64_t> ids = {3, 1, 3};
  std::vector<PullResult> done = c->pull({TableBatch{t, ids.data(), 3}});
  CHECK(done.size() == 1);
  CHECK((done[0].unique == std::vector<int64_t>{3, 1}));
  CHECK((done[0].inverse == std::vector<int64_t>{0, 1, 0}));
  CHECK((done[0].rows == std::vector<float>{6, 7, 2, 3}));
}

TEST(threads_sharing_a_client_each_get_their_own_results) {
  InprocHub hub(1);
  auto c = one_rank(hub);
  const int t = c->add_table(TableSpec{"emb", 64, 1, 0, PartitionKind::kBlock, "sgd", {{"lr", 1.0}}});
  std::vector<float> init = iota(64);
  c->load_local(t, -1, init.data());
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      try {
        for (int i = 0; i < 100; ++i) {
          const std::vector<int64_t> ids = {k, 8 + k, k};
          const std::vector<PullResult> rows = c->pull({TableBatch{t, ids.data(), 3}});
          if (rows.size() != 1 || rows[0].rows != std::vector<float>{float(k), float(8 + k)}) ++wrong;
          const std::vector<int64_t> own = {32 + k};
          const float g = 1.0f;
          c->push({TableBatch{t, own.data(), 1, &g}}, 1.0f);
          std::vector<float> read(1);
          c->read_rows(t, -1, own.data(), 1, read.data());  // one-sided, between the collectives
          if (c->spec(t).dim != 1 || c->shard_rows(t) != 64 || read[0] > 32 + k - i - 1 + 1e-6) ++wrong;
        }
      } catch (const std::exception&) {
        ++wrong;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  CHECK(wrong.load() == 0);
  const std::vector<float> full = whole(*c, t);
  for (int k = 0; k < 4; ++k) CHECK_NEAR(full[32 + k], 32 + k - 100, 0.0);  // every push applied once
  CHECK(c->step(t) == 4 * 100);
}

TEST(a_push_is_applied_before_the_next_pull_and_sums_duplicates) {
  InprocHub hub(1);
  auto c = one_rank(hub);
  const int t = c->add_table(spec());
  c->set_gradient_statistics(t, true);  // (the adaptive batch size's squared norms)
  const std::vector<int64_t> ids = {2, 2, 5};
  const std::vector<float> grads = {1, 1, 2, 2, 4, 4};
  c->push({TableBatch{t, ids.data(), 3, grads.data(), 0.5}}, 1.0f);
  const std::vector<int64_t> all = {0, 1, 2, 3, 4, 5};
  std::vector<PullResult> rows = c->pull({TableBatch{t, all.data(), 6}});
  CHECK_NEAR(rows[0].rows[4], -1.5, 1e-6);   // row 2: lr 0.5 x (1 + 2)
  CHECK_NEAR(rows[0].rows[10], -2.0, 1e-6);  // row 5: lr 0.5 x 4
  CHECK_NEAR(c->hyperparameters(t).at("lr"), 0.5, 0.0);
  CHECK(c->step(t) == 1);
  // Statistics before the scale (a world of one sends no deduplicated rows, so the per-rank sum
  // counts the duplicates apart): |1,1|^2 + |2,2|^2 + |4,4|^2, and |3,3|^2 + |4,4|^2 summed.
  const RoundStats s = c->round_stats(t);
  CHECK(s.round >= 0 && s.ranks == 1);
  CHECK_NEAR(s.local_sq, 2 + 8 + 32, 1e-9);
  CHECK_NEAR(s.combined_sq, 18 + 32, 1e-9);
  CHECK(s.rows == 2 && s.pushed == 3);  // distinct rows updated; rows received (the duplicate too)
}

TEST(the_squared_norms_of_a_round_are_computed_only_while_statistics_are_on) {
  InprocHub hub(1);
  auto c = one_rank(hub);
  const int t = c->add_table(spec());
  const std::vector<int64_t> ids = {2, 5};
  const std::vector<float> grads = {1, 1, 2, 2};
  c->push({TableBatch{t, ids.data(), 2, grads.data(), 0.5}}, 1.0f);  // off: the default
  RoundStats s = c->round_stats(t);
  CHECK(s.round >= 0 && s.rows == 2);  // the round is counted, its norms are not computed
  CHECK_NEAR(s.local_sq, 0.0, 0.0);
  CHECK_NEAR(s.combined_sq, 0.0, 0.0);
  c->set_gradient_statistics(t, true);
  c->push({TableBatch{t, ids.data(), 2, grads.data(), 0.5}}, 1.0f);
  s = c->round_stats(t);
  CHECK_NEAR(s.local_sq, 2 + 8, 1e-9);
  CHECK_NEAR(s.combined_sq, 2 + 8, 1e-9);
  c->set_gradient_statistics(t, false);
  c->push({TableBatch{t, ids.data(), 2, grads.data(), 0.5}}, 1.0f);
  CHECK_NEAR(c->round_stats(t).local_sq, 0.0, 0.0);
}

TEST(a_pull_in_input_order_writes_every_ids_row_into_out) {
  InprocHub hub(1);
  auto c = one_rank(hub);
  const int t = c->add_table(spec());
  const std::vector<float> init = iota(12);
  c->load_local(t, -1, init.data());
  const std::vector<int64_t> pushed = {1};
  const std::vector<float> grads = {1, 1};
  c->push({TableBatch{t, pushed.data(), 1, grads.data()}}, 1.0f);
  const std::vector<int64_t> ids = {3, 1, 3, 0}, other = {5, 5};
  std::vector<float> out(8, -1.0f);
  TableBatch ordered{t, ids.data(), 4};
  ordered.out = out.data();
  std::vector<PullResult> got = c->pull({ordered, TableBatch{t, other.data(), 2}});
  CHECK((out == std::vector<float>{6, 7, 1, 2, 6, 7, 0, 1}));
  CHECK(got[0].rows.empty() && got[0].unique.empty() && got[0].inverse.empty());  // one rank: nothing deduplicated
  CHECK((got[1].unique == std::vector<int64_t>{5}));  // a batch without out, in the same round
  CHECK((got[1].rows == std::vector<float>{10, 11}));
  const std::vector<int64_t> bad = {2, 6};
  TableBatch wrong{t, bad.data(), 2};
  wrong.out = out.data();
  CHECK_THROWS(c->pull({wrong}), PSIndexError, "table 'emb': id 6 is out of range [0, 6)");
  CHECK((c->pull({ordered})[0].rows.empty() && out[0] == 6));  // still usable
}

TEST(a_push_with_updates_returns_every_changed_row) {
  InprocHub hub(1);
  auto c = one_rank(hub);
  const int t = c->add_table(spec());
  const std::vector<int64_t> ids = {4};
  const std::vector<float> grads = {1, 2};
  std::vector<RowUpdates> updates = c->push({TableBatch{t, ids.data(), 1, grads.data()}}, 2.0f, true);
  CHECK(updates.size() == 1);
  CHECK((updates[0].ids == std::vector<int64_t>{4}));
  CHECK((updates[0].rows == std::vector<float>{-2, -4}));
}

TEST(bad_input_throws_and_changes_no_row) {
  InprocHub hub(1);
  auto c = one_rank(hub);
  const int t = c->add_table(spec());
  const std::vector<int64_t> bad = {1, 6};
  const std::vector<float> grads = {1, 1, 1, 1};
  CHECK_THROWS(c->push({TableBatch{t, bad.data(), 2, grads.data()}}, 1.0f, true), PSIndexError,
               "table 'emb': id 6 is out of range [0, 6)");
  CHECK_THROWS(c->pull({}, "gradients must be float32"), PSError, "gradients must be float32");
  // One rank applies a push at once; a bad id in any batch still changes nothing.
  const std::vector<int64_t> good = {0};
  CHECK_THROWS(c->push({TableBatch{t, good.data(), 1, grads.data()}, TableBatch{t, bad.data(), 2, grads.data()}}, 1.0f),
               PSIndexError, "table 'emb': id 6 is out of range [0, 6)");
  CHECK_THROWS(c->push({TableBatch{t, good.data(), 1, grads.data()}}, 1.0f, false, "bad gradients"), PSError, "bad gradients");
  CHECK(c->step(t) == 0);
  const std::vector<float> full = whole(*c, t);
  for (float v : full) CHECK_NEAR(v, 0.0, 0.0);
  std::vector<float> scratch(full.size());
  CHECK_THROWS(c->read_table(t, 3, scratch.data()), PSError, "has no state slot 3");
  CHECK_THROWS(c->read_rows(t, -1, bad.data(), 2, scratch.data()), PSIndexError, "id 6 is out of range");
  CHECK_THROWS(c->load_from_root(t, nullptr, 0, "expected a float32 array"), PSError, "expected a float32 array");
  CHECK_THROWS(c->load_from_root(t, full.data(), 1), PSError, "root rank in [0, 1), got 1");
  CHECK_THROWS(c->add_table(spec("rmsprop", {})), PSError, "table 'emb': unknown server optimizer 'rmsprop'");
  CHECK_THROWS(c->add_table(spec(), "unknown partition 'hash'"), PSError, "table 'emb': unknown partition 'hash'");
  CHECK(c->add_table(spec()) == t + 1);  // still usable
}

TEST(load_from_root_and_a_replica_attachment) {
  InprocHub hub(1);
  auto c = one_rank(hub);
  const int t = c->add_table(spec("adagrad", {{"lr", 1.0}}));
  std::vector<float> replica = iota(12);
  c->load_from_root(t, replica.data(), 0);
  CHECK((whole(*c, t) == replica));
  c->attach_replica(t, replica.data());
  CHECK(c->row_store_bytes() == 0);
  CHECK(c->state_bytes() == 12 * 4);  // Adagrad's accumulator
  const std::vector<int64_t> ids = {0, 1, 2, 3};
  const std::vector<float> rows = {9, 9, 8, 8, 7, 7, 6, 6};
  c->write_local(t, -1, ids.data(), 4, rows.data());
  CHECK_NEAR(replica[5], 7, 0.0);  // written through the alias
  CHECK((c->slot_names(t) == std::vector<std::string>{"sum"}));
  c->write_local(t, 0, ids.data(), 4, rows.data());  // optimizer state, for checkpoint restores
  const std::vector<float> sums = c->local_values(t, 0);
  CHECK(sums.size() == 12 && sums[4] == 7 && sums[10] == 0);
  CHECK((c->local_values(t, -1) == replica));
  CHECK_THROWS(c->write_local(t, 1, ids.data(), 4, rows.data()), PSError, "has no state slot 1");
}

TEST(load_from_root_consuming_the_values_gives_their_pages_back_as_rows_reach_the_shard) {
  InprocHub hub(1);
  auto c = one_rank(hub);
  const int64_t rows = 100000, dim = 16;  // 6.1 MiB, many chunks
  const int t = c->add_table(TableSpec{"big", rows, dim, 0, PartitionKind::kCyclic, "sgd", {{"lr", 1.0}}});
  const size_t bytes = static_cast<size_t>(rows * dim) * sizeof(float);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(mem != MAP_FAILED);
  float* values = static_cast<float*>(mem);
  std::vector<float> expected(static_cast<size_t>(rows * dim));
  for (size_t i = 0; i < expected.size(); ++i) values[i] = expected[i] = static_cast<float>(i % 9973);
  c->load_from_root(t, values, 0, "", true);
  CHECK((whole(*c, t) == expected));
  const int64_t page = sysconf(_SC_PAGESIZE), n = (static_cast<int64_t>(bytes) + page - 1) / page;
  std::vector<unsigned char> in(static_cast<size_t>(n));
  CHECK(mincore(mem, bytes, in.data()) == 0);
  int64_t resident = 0;
  for (unsigned char v : in) resident += v & 1;
  CHECK(resident <= 1);  // every whole page went back (the last may hold the tail)
  CHECK_NEAR(values[12345], 0, 0.0);  // a returned page reads as zeros
  munmap(mem, bytes);
  // Without consume, the caller's rows stay.
  std::vector<float> kept = expected;
  c->load_from_root(t, kept.data(), 0);
  CHECK((kept == expected));
}

TEST(a_dropped_table_frees_its_shard_after_its_pushes_and_refuses_later_use) {
  InprocHub hub(1);
  auto c = one_rank(hub);
  const int keep = c->add_table(spec());
  const int gone = c->add_table(TableSpec{"gone", 6, 2, 0, PartitionKind::kCyclic, "sgd", {{"lr", 1.0}}});
  const std::vector<float> init = iota(12);
  c->load_local(gone, -1, init.data());
  const int64_t with_both = c->row_store_bytes();
  const std::vector<int64_t> ids = {2};
  const std::vector<float> grad = {1, 1};
  c->push({TableBatch{gone, ids.data(), 1, grad.data()}}, 1.0f);
  c->drop_table(gone);
  CHECK(c->row_store_bytes() < with_both);
  CHECK_THROWS(c->pull({TableBatch{gone, ids.data(), 1}}), PSError, "PS table 'gone' was dropped");
  CHECK_THROWS(c->drop_table(gone), PSError, "was dropped");
  auto rows = c->pull({TableBatch{keep, ids.data(), 1}});  // the other table is untouched
  CHECK(rows.size() == 1 && rows[0].rows.size() == 2);
}

// -- several ranks ---------------------------------------------------------------------------

TEST(three_ranks_train_a_table_as_one_rank_does) {
  // Each rank pushes its own gradients; the shards sum them, so 3 ranks give the parameters one
  // rank gets from the summed batch (same rule, same order of rounds).
  const int64_t rows = 40, dim = 3;
  auto grads_of = [&](int rank, int step, std::vector<int64_t>* ids, std::vector<float>* g) {
    ids->clear();
    g->clear();
    for (int k = 0; k < 5; ++k) {
      ids->push_back((rank * 7 + step * 3 + k * 11) % rows);
      for (int j = 0; j < dim; ++j) g->push_back(0.1f * (rank + 1) + 0.01f * (k + j + step));
    }
  };
  std::vector<float> reference;
  {
    InprocHub hub(1);
    auto c = one_rank(hub);
    const int t = c->add_table(TableSpec{"t", rows, dim, 0, PartitionKind::kCyclic, "adagrad", {{"lr", 0.5}}});
    std::vector<float> init = iota(rows * dim);
    c->load_from_root(t, init.data(), 0);
    for (int step = 0; step < 6; ++step) {
      std::vector<int64_t> all_ids;
      std::vector<float> all_g;
      for (int r = 0; r < 3; ++r) {
        std::vector<int64_t> ids;
        std::vector<float> g;
        grads_of(r, step, &ids, &g);
        all_ids.insert(all_ids.end(), ids.begin(), ids.end());
        all_g.insert(all_g.end(), g.begin(), g.end());
      }
      c->push({TableBatch{t, all_ids.data(), static_cast<int64_t>(all_ids.size()), all_g.data()}}, 1.0f / 3);
    }
    reference = whole(*c, t);
  }
  auto errors = run_ranks(3, [&](int rank, Client& c) {
    const int t = c.add_table(TableSpec{"t", rows, dim, 0, PartitionKind::kCyclic, "adagrad", {{"lr", 0.5}}});
    std::vector<float> init = iota(rows * dim);
    c.load_from_root(t, rank == 1 ? init.data() : nullptr, 1);
    for (int step = 0; step < 6; ++step) {
      std::vector<int64_t> ids;
      std::vector<float> g;
      grads_of(rank, step, &ids, &g);
      c.pull({TableBatch{t, ids.data(), static_cast<int64_t>(ids.size())}});
      c.push({TableBatch{t, ids.data(), static_cast<int64_t>(ids.size()), g.data()}}, 1.0f / 3);
    }
    c.barrier();
    const std::vector<float> got = whole(c, t);
    for (size_t i = 0; i < got.size(); ++i) CHECK_NEAR(got[i], reference[i], 1e-5);
    CHECK(c.round_stats(t).ranks == 3);
    // Steps 4 and 5 alike: 5 distinct rows from each rank, 11 distinct among the 15.
    CHECK(c.round_stats(t).pushed == 15 && c.round_stats(t).rows == 11);
  });
  for (auto& e : errors) CHECK(message(e).empty());
}

TEST(a_shard_answers_reads_while_its_owner_computes) {
  // Rank 0 reads and writes the whole table while rank 1 is busy outside the Client: its
  // serving thread answers, and rank 1 sees rank 0's write once it is back.
  std::atomic<bool> done_reading{false};
  auto errors = run_ranks(2, [&](int rank, Client& c) {
    const int t = c.add_table(TableSpec{"t", 1000, 4, 0, PartitionKind::kBlock, "sgd", {{"lr", 1.0}}});
    std::vector<float> init = iota(4000);
    c.load_from_root(t, rank == 0 ? init.data() : nullptr, 0);
    if (rank == 1) {
      while (!done_reading.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // "computing"
    } else {
      CHECK((whole(c, t) == init));
      std::vector<float> twice(init);
      for (float& v : twice) v *= 2;
      c.write_table(t, -1, twice.data());
      const std::vector<int64_t> ids = {999, 0, 500};
      std::vector<float> got(12);
      c.read_rows(t, -1, ids.data(), 3, got.data());
      CHECK_NEAR(got[0], 2 * 3996, 0.0);
      CHECK_NEAR(got[8], 2 * 2000, 0.0);
      done_reading = true;
    }
    c.barrier();
    const std::vector<float> after = whole(c, t);
    CHECK_NEAR(after[3999], 2 * 3999, 0.0);
  });
  for (auto& e : errors) CHECK(message(e).empty());
}

TEST(ranks_calling_different_operations_all_fail_at_once_naming_both) {
  for (bool with_updates : {false, true}) {
    auto errors = run_ranks(2, [&](int rank, Client& c) {
      const int t = c.add_table(spec());
      const std::vector<int64_t> ids = {1};
      const std::vector<float> g = {1, 1};
      if (rank == 0) {
        c.push({TableBatch{t, ids.data(), 1, g.data()}}, 1.0f, with_updates);
        c.barrier();  // a plain push returns at once: the mismatch surfaces here
      } else {
        c.pull({TableBatch{t, ids.data(), 1}});
      }
    });
    const std::string want = with_updates ? "push(return_updates=True)" : "called push";
    for (auto& e : errors) {
      CHECK(message(e).find("ranks called different PS operations") != std::string::npos);
      CHECK(message(e).find(want) != std::string::npos);
      CHECK(message(e).find("called pull") != std::string::npos);
    }
  }
  auto errors = run_ranks(2, [&](int rank, Client& c) {  // a return_updates push facing a plain one
    const int t = c.add_table(spec());
    const std::vector<int64_t> ids = {1};
    const std::vector<float> g = {1, 1};
    c.push({TableBatch{t, ids.data(), 1, g.data()}}, 1.0f, rank == 0);
    c.barrier();
  });
  for (auto& e : errors) CHECK(message(e).find("push(return_updates=True)") != std::string::npos);
}

TEST(bad_input_on_one_rank_raises_on_every_rank) {
  auto errors = run_ranks(3, [&](int rank, Client& c) {
    const int t = c.add_table(spec());
    const std::vector<int64_t> ids = {rank == 2 ? 9 : 1};
    try {
      c.pull({TableBatch{t, ids.data(), 1}});
      CHECK(false);
    } catch (const PSIndexError& e) {
      CHECK(rank == 2);
    } catch (const PSRemoteError& e) {
      CHECK(rank != 2 && std::string(e.what()).find("pull failed on rank 2: table 'emb': id 9") != std::string::npos);
    }
    const std::vector<int64_t> fine = {1};
    CHECK(c.pull({TableBatch{t, fine.data(), 1}}).size() == 1);  // still usable
  });
  for (auto& e : errors) CHECK(message(e).empty());
}

TEST(messages_longer_than_the_transport_limit_travel_in_fragments_and_tables_in_chunks) {
  const int64_t limit = 5000;
  auto errors = run_ranks(2, [&](int rank, Client& c) {
    const int t = c.add_table(TableSpec{"t", 3000, 8, 0, PartitionKind::kCyclic, "sgd", {{"lr", 1.0}}});
    std::vector<float> init = iota(3000 * 8);
    c.load_from_root(t, rank == 0 ? init.data() : nullptr, 0);
    CHECK((whole(c, t) == init));  // a read in chunks below the limit
    std::vector<int64_t> ids(2000);
    for (int i = 0; i < 2000; ++i) ids[i] = (i * 7 + rank) % 3000;
    std::vector<PullResult> got = c.pull({TableBatch{t, ids.data(), 2000}});  // requests and replies fragmented
    CHECK(got[0].unique.size() > 600);
    for (size_t u = 0; u < got[0].unique.size(); ++u) CHECK_NEAR(got[0].rows[u * 8], got[0].unique[u] * 8, 0.0);
    CHECK(c.traffic().largest_message <= limit);
    c.barrier();
  }, limit);
  for (auto& e : errors) CHECK(message(e).empty());
}

TEST(rescale_accumulators_scales_every_adagrad_rows_sums_on_every_shard_and_tier_and_nothing_else) {
  // Two ranks push a few rounds into Adagrad tables -- in memory (initial sum 0.1), half rows with
  // a disk tier of one row per shard in memory (most rows on disk), dynamic -- and an Adam table;
  // then rescale. Each stored sum becomes base + f (sum - base) exactly, rows never touched keep
  // their initial sum, Adam's moments (moving averages) are untouched, and a push after the
  // rescale is applied against the rescaled sums (the round is ordered after it on every shard).
  char tmpl[] = "/tmp/hybridsync-rescale-test-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const int64_t rows = 20, dim = 3;
  const float factor = 0.37f;
  auto errors = run_ranks(2, [&](int rank, Client& c) {
    TableSpec plain{"plain", rows, dim, 0, PartitionKind::kCyclic, "adagrad",
                    {{"lr", 0.5}, {"initial_accumulator_value", 0.1}}};
    TableSpec tiered{"tiered", rows, dim, 0, PartitionKind::kCyclic, "adagrad", {{"lr", 0.5}}};
    tiered.storage.dtype = "float16";
    tiered.storage.path = dir;
    tiered.storage.memory_rows = 2;
    TableSpec dynamic{"dyn", -1, dim, 0, PartitionKind::kHash, "adagrad", {{"lr", 0.5}}};
    dynamic.dynamic.on = true;
    TableSpec adam{"adam", rows, dim, 0, PartitionKind::kCyclic, "adam", {{"lr", 0.1}}};
    const std::vector<int> tables = {c.add_table(plain), c.add_table(tiered), c.add_table(dynamic), c.add_table(adam)};
    auto push_round = [&](int step) {
      std::vector<int64_t> ids;
      std::vector<float> g;
      for (int k = 0; k < 6; ++k) {
        ids.push_back((rank * 5 + step * 3 + k * 7) % (rows - 4));  // rows rows-4.. never touched
        for (int j = 0; j < dim; ++j) g.push_back(0.3f * (rank + 1) - 0.05f * (k + j + step));
      }
      std::vector<TableBatch> batches;
      for (const int t : tables) batches.push_back(TableBatch{t, ids.data(), static_cast<int64_t>(ids.size()), g.data()});
      c.pull(batches);
      c.push(batches, 0.5f);
    };
    for (int step = 0; step < 4; ++step) push_round(step);
    std::vector<int64_t> all(rows);
    for (int64_t i = 0; i < rows; ++i) all[static_cast<size_t>(i)] = i;
    auto slots = [&](int slot) {  // every table's slot of every row, after every push so far
      c.barrier();
      std::vector<std::vector<float>> out;
      for (const int t : tables) {
        out.emplace_back(static_cast<size_t>(rows * dim));
        c.read_rows(t, t == tables[3] ? slot : 0, all.data(), rows, out.back().data());  // (Adam: moment `slot`)
      }
      return out;
    };
    const auto sums = slots(0), adam_second = slots(1);
    const auto values_before = whole(c, tables[0]);
    if (rank == 0) CHECK(c.tier_stats(tables[1]).disk_rows > 0);  // rows on the disk tier are rescaled too
    c.rescale_accumulators({tables[0], tables[1], tables[2], tables[3]}, factor);
    const auto rescaled = slots(0), adam_after = slots(1);
    for (size_t t = 0; t < 3; ++t) {
      const float base = t == 0 ? 0.1f : 0.0f;
      for (size_t i = 0; i < rescaled[t].size(); ++i) {
        const float want = sums[t][i] == base ? base : base == 0.0f ? sums[t][i] * factor : base + factor * (sums[t][i] - base);
        CHECK(rescaled[t][i] == want);
      }
      CHECK(rescaled[t][(rows - 1) * dim] == base);  // never touched: still its initial value
      CHECK(sums[t][0] != base);                      // (and touched rows did change)
    }
    CHECK((rescaled[3] == sums[3]) && (adam_after[3] == adam_second[3]));  // Adam's moments forget: untouched
    CHECK((whole(c, tables[0]) == values_before));                    // rows are untouched
    // Ranks asking for different factors: every rank throws, no slot changes.
    CHECK_THROWS(c.rescale_accumulators({tables[0]}, rank == 0 ? 0.5 : 0.25), std::runtime_error, "bit for bit");
    CHECK((slots(0)[0] == rescaled[0]));
    CHECK_THROWS(c.rescale_accumulators({tables[0]}, 0.0), PSError, "finite and > 0");
    push_round(4);  // applied against the rescaled sums
    const auto after_push = slots(0);
    CHECK(after_push[0] != rescaled[0]);
  });
  for (auto& e : errors) CHECK(message(e).empty());
  rmdir(dir.c_str());
}
