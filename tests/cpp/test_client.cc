// A real Client over the one-rank "loopback" transport: the transport factory, table
// registration, split-phase pull/push with handles, lazy pushes, replicas, errors and threads.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "check.h"
#include "hybridsync/ps.h"
#include "transport/transport.h"

using namespace hybridsync;

namespace {

std::unique_ptr<Client> loopback_client() {
  return std::make_unique<Client>(make_transport("loopback", TransportConfig{}));
}

TableSpec spec(const std::string& rule = "sgd", std::map<std::string, double> hparams = {{"lr", 1.0}}) {
  return TableSpec{"emb", 6, 2, 0, PartitionKind::kCyclic, rule, std::move(hparams)};
}

std::vector<float> iota_table() {
  std::vector<float> v(12);
  for (int i = 0; i < 12; ++i) v[i] = static_cast<float>(i);
  return v;
}

}  // namespace

TEST(transports_are_made_by_name_and_unknown_names_list_the_known) {
  CHECK(make_transport("loopback", TransportConfig{}) != nullptr);  // registered by its own file
  CHECK_THROWS(make_transport("tcp", TransportConfig{}), PSError, "unknown PS transport 'tcp' (known: loopback, mpi)");
  CHECK_THROWS(make_transport("mpi", TransportConfig{}), PSError, "needs a communicator");
}

TEST(pull_returns_rows_of_unique_ids_and_wait_completes_the_handle) {
  auto c = loopback_client();
  const int t = c->add_table(spec());
  const std::vector<float> init = iota_table();
  c->load_local(t, -1, init.data());
  const std::vector<int64_t> ids = {3, 1, 3};
  const Client::Handle h = c->Pull({TableBatch{t, ids.data(), 3}});
  Completion done = c->Wait(h);
  CHECK(done.pulled.size() == 1);
  CHECK((done.pulled[0].unique == std::vector<int64_t>{3, 1}));
  CHECK((done.pulled[0].inverse == std::vector<int64_t>{0, 1, 0}));
  CHECK((done.pulled[0].rows == std::vector<float>{6, 7, 2, 3}));
  CHECK_THROWS(c->Wait(h), PSError, "already waited for");
  CHECK_THROWS(c->Wait(h + 5), PSError, "unknown PS operation handle");
}

TEST(an_operation_completed_by_a_later_one_keeps_its_result_for_its_own_wait) {
  auto c = loopback_client();
  const int t = c->add_table(spec());
  const std::vector<float> init = iota_table();
  c->load_local(t, -1, init.data());
  const std::vector<int64_t> a = {5}, b = {0, 1};
  const std::vector<int64_t> bad = {9};
  const Client::Handle ha = c->Pull({TableBatch{t, a.data(), 1}});
  const Client::Handle hbad = c->Pull({TableBatch{t, bad.data(), 1}});  // completes ha on its owner's behalf
  const Client::Handle hb = c->Pull({TableBatch{t, b.data(), 2}});      // and this completes hbad
  CHECK((c->Wait(hb).pulled[0].rows == std::vector<float>{0, 1, 2, 3}));
  CHECK((c->Wait(ha).pulled[0].rows == std::vector<float>{10, 11}));
  CHECK_THROWS(c->Wait(hbad), PSIndexError, "table 'emb': id 9 is out of range [0, 6)");  // thrown to its owner
  CHECK((c->pull({TableBatch{t, a.data(), 1}})[0].rows == std::vector<float>{10, 11}));  // still usable
}

TEST(threads_sharing_a_client_each_get_their_own_results) {
  auto c = loopback_client();
  const int t = c->add_table(TableSpec{"emb", 64, 1, 0, PartitionKind::kBlock, "sgd", {{"lr", 1.0}}});
  std::vector<float> init(64);
  for (int i = 0; i < 64; ++i) init[i] = static_cast<float>(i);
  c->load_local(t, -1, init.data());
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      try {
        for (int i = 0; i < 100; ++i) {
          const std::vector<int64_t> ids = {k, 8 + k, k};
          if (i % 2) {  // split phase, with a pause in which other threads complete it
            const Client::Handle h = c->Pull({TableBatch{t, ids.data(), 3}});
            std::this_thread::sleep_for(std::chrono::microseconds(50));
            const Completion done = c->Wait(h);
            if (done.pulled.size() != 1 || done.pulled[0].unique != std::vector<int64_t>{k, 8 + k}) ++wrong;
          } else {
            const std::vector<PullResult> rows = c->pull({TableBatch{t, ids.data(), 3}});
            if (rows.size() != 1 || rows[0].rows != std::vector<float>{float(k), float(8 + k)}) ++wrong;
          }
          const std::vector<int64_t> own = {32 + k};
          const float g = 1.0f;
          c->push({TableBatch{t, own.data(), 1, &g}}, 1.0f);
          if (c->spec(t).dim != 1 || c->shard_rows(t) != 64) ++wrong;
        }
      } catch (const std::exception&) {
        ++wrong;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  CHECK(wrong.load() == 0);
  const std::vector<float> full = c->gather(t, -1);
  for (int k = 0; k < 4; ++k) CHECK_NEAR(full[32 + k], 32 + k - 100, 0.0);  // every push applied once
  CHECK(c->step(t) == 4 * 100);
}

TEST(a_push_is_applied_before_the_next_pull_and_sums_duplicates) {
  auto c = loopback_client();
  const int t = c->add_table(spec());
  const std::vector<int64_t> ids = {2, 2, 5};
  const std::vector<float> grads = {1, 1, 2, 2, 4, 4};
  const TableBatch push{t, ids.data(), 3, grads.data(), 0.5};
  c->Wait(c->Push({push}, 1.0f));
  const std::vector<int64_t> all = {0, 1, 2, 3, 4, 5};
  std::vector<PullResult> rows = c->pull({TableBatch{t, all.data(), 6}});
  CHECK_NEAR(rows[0].rows[4], -1.5, 1e-6);  // row 2: lr 0.5 x (1 + 2)
  CHECK_NEAR(rows[0].rows[10], -2.0, 1e-6);  // row 5: lr 0.5 x 4
  CHECK_NEAR(c->hyperparameters(t).at("lr"), 0.5, 0.0);
  CHECK(c->step(t) == 1);
}

TEST(a_pull_in_input_order_writes_every_ids_row_into_out_once_the_pending_push_is_applied) {
  auto c = loopback_client();
  const int t = c->add_table(spec());
  const std::vector<float> init = iota_table();
  c->load_local(t, -1, init.data());
  const std::vector<int64_t> pushed = {1};
  const std::vector<float> grads = {1, 1};
  c->Wait(c->Push({TableBatch{t, pushed.data(), 1, grads.data()}}, 1.0f));  // lazy: applied by the pull
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
  auto c = loopback_client();
  const int t = c->add_table(spec());
  const std::vector<int64_t> ids = {4};
  const std::vector<float> grads = {1, 2};
  std::vector<RowUpdates> updates = c->push({TableBatch{t, ids.data(), 1, grads.data()}}, 2.0f, true);
  CHECK(updates.size() == 1);
  CHECK((updates[0].ids == std::vector<int64_t>{4}));
  CHECK((updates[0].rows == std::vector<float>{-2, -4}));
}

TEST(bad_input_throws_and_changes_no_row) {
  auto c = loopback_client();
  const int t = c->add_table(spec());
  const std::vector<int64_t> bad = {1, 6};
  const std::vector<float> grads = {1, 1, 1, 1};
  CHECK_THROWS(c->push({TableBatch{t, bad.data(), 2, grads.data()}}, 1.0f, true), PSIndexError,
               "table 'emb': id 6 is out of range [0, 6)");
  CHECK_THROWS(c->pull({}, "gradients must be float32"), PSError, "gradients must be float32");
  // Without updates one rank applies a push at once; a bad id in any batch still changes nothing.
  const std::vector<int64_t> good = {0};
  const Client::Handle h = c->Push({TableBatch{t, good.data(), 1, grads.data()}, TableBatch{t, bad.data(), 2, grads.data()}}, 1.0f);
  CHECK_THROWS(c->Wait(h), PSIndexError, "table 'emb': id 6 is out of range [0, 6)");
  CHECK_THROWS(c->push({TableBatch{t, good.data(), 1, grads.data()}}, 1.0f, false, "bad gradients"), PSError, "bad gradients");
  CHECK(c->step(t) == 0);
  const std::vector<float> full = c->gather(t, -1);
  for (float v : full) CHECK_NEAR(v, 0.0, 0.0);
  CHECK_THROWS(c->gather(t, 3), PSError, "has no state slot 3");
  CHECK_THROWS(c->load_from_root(t, nullptr, 0, "expected a float32 array"), PSError, "expected a float32 array");
  CHECK_THROWS(c->load_from_root(t, full.data(), 1), PSError, "root rank in [0, 1), got 1");
  CHECK_THROWS(c->add_table(spec("rmsprop", {})), PSError, "table 'emb': unknown server optimizer 'rmsprop'");
  CHECK_THROWS(c->add_table(spec(), "unknown partition 'hash'"), PSError, "table 'emb': unknown partition 'hash'");
}

TEST(load_from_root_and_a_replica_attachment) {
  auto c = loopback_client();
  const int t = c->add_table(spec("adagrad", {{"lr", 1.0}}));
  std::vector<float> replica = iota_table();
  c->load_from_root(t, replica.data(), 0);
  CHECK((c->gather(t, -1) == replica));
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
  auto c = loopback_client();
  const int64_t rows = 100000, dim = 16;  // 6.1 MiB, many chunks
  const int t = c->add_table(TableSpec{"big", rows, dim, 0, PartitionKind::kCyclic, "sgd", {{"lr", 1.0}}});
  const size_t bytes = static_cast<size_t>(rows * dim) * sizeof(float);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(mem != MAP_FAILED);
  float* values = static_cast<float*>(mem);
  std::vector<float> expected(static_cast<size_t>(rows * dim));
  for (size_t i = 0; i < expected.size(); ++i) values[i] = expected[i] = static_cast<float>(i % 9973);
  c->load_from_root(t, values, 0, "", true);
  CHECK((c->gather(t, -1) == expected));
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

TEST(a_dropped_table_frees_its_shard_after_its_pending_push_and_refuses_later_use) {
  auto c = loopback_client();
  const int keep = c->add_table(spec());
  const int gone = c->add_table(TableSpec{"gone", 6, 2, 0, PartitionKind::kCyclic, "sgd", {{"lr", 1.0}}});
  const std::vector<float> init = iota_table();
  c->load_local(gone, -1, init.data());
  const int64_t with_both = c->row_store_bytes();
  const std::vector<int64_t> ids = {2};
  const std::vector<float> grad = {1, 1};
  c->push({TableBatch{gone, ids.data(), 1, grad.data()}}, 1.0f);  // pending: applied by the drop
  c->drop_table(gone);
  CHECK(c->row_store_bytes() < with_both);
  CHECK_THROWS(c->pull({TableBatch{gone, ids.data(), 1}}), PSError, "PS table 'gone' was dropped");
  CHECK_THROWS(c->drop_table(gone), PSError, "was dropped");
  auto rows = c->pull({TableBatch{keep, ids.data(), 1}});  // the other table is untouched
  CHECK(rows.size() == 1 && rows[0].rows.size() == 2);
}
