// The shard store and the update rules, against numbers worked out by hand.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <random>
#include <vector>

#include "check.h"
#include "ps/shard.h"
#include "ps/rules/registry.h"

using namespace hybridsync;

namespace {

// A rule defined and registered here, as a new rule's own file would: row -= grad / 2.
class HalveRule : public UpdateRule {
 public:
  HalveRule() : UpdateRule({}) {}
  std::string name() const override { return "halve"; }
  std::vector<std::string> slot_names() const override { return {}; }
  void apply(float* row, float* const*, const float* grad, int64_t dim) const override {
    for (int64_t j = 0; j < dim; ++j) row[j] -= 0.5f * grad[j];
  }
  void validate() const override {}
};
const UpdateRuleRegistrar kHalve("halve", [](const std::map<std::string, double>&) {
  return std::unique_ptr<UpdateRule>(std::make_unique<HalveRule>());
});

Shard make_shard(const std::string& rule, std::map<std::string, double> hparams, int64_t rows = 4, int64_t dim = 2) {
  return Shard("emb", rows, dim, make_update_rule(rule, hparams));
}

}  // namespace

TEST(sgd_moves_each_row_by_lr_times_its_gradient) {
  Shard s = make_shard("sgd", {{"lr", 0.5}});
  const std::vector<float> init = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<int64_t> all = {0, 1, 2, 3};
  s.scatter(all.data(), 4, init.data());
  const std::vector<int64_t> rows = {2, 0};
  const std::vector<float> grads = {1, -2, 4, 4};
  s.rule().begin_step();
  s.apply(rows.data(), 2, grads.data());
  std::vector<float> out(8);
  s.gather(all.data(), 4, out.data());
  const std::vector<float> expected = {1 - 2, 2 - 2, 3, 4, 5 - 0.5f, 6 + 1, 7, 8};
  for (int i = 0; i < 8; ++i) CHECK_NEAR(out[i], expected[i], 1e-6);
  CHECK(s.rule().step() == 1);
}

TEST(adagrad_with_epsilon_outside_or_inside_the_square_root) {
  for (double in_sqrt : {0.0, 1.0}) {
    Shard s = make_shard("adagrad", {{"lr", 0.1}, {"eps", 0.5}, {"initial_accumulator_value", 1.0}, {"eps_in_sqrt", in_sqrt}}, 1, 1);
    const int64_t row = 0;
    const float g = 2.0f;
    s.rule().begin_step();
    s.apply(&row, 1, &g);
    // acc = 1 + 4 = 5; torch: g / (sqrt(acc) + eps); Keras: g / sqrt(acc + eps).
    const double step = in_sqrt ? 2.0 / std::sqrt(5.5) : 2.0 / (std::sqrt(5.0) + 0.5);
    CHECK_NEAR(*s.row(0), -0.1 * step, 1e-6);
    CHECK_NEAR(s.slot(0)[0], 5.0, 1e-6);
  }
}

TEST(adam_is_lazy_and_bias_corrected) {
  Shard s = make_shard("adam", {{"lr", 0.01}, {"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}}, 2, 1);
  const int64_t row = 1;
  const float g = 0.5f;
  s.rule().begin_step();
  s.apply(&row, 1, &g);
  // m = 0.05, v = 0.00025; lr * sqrt(1 - b2) / (1 - b1) * m / (sqrt(v) + eps) = 0.01 (the sign of g).
  CHECK_NEAR(*s.row(1), -0.01, 1e-6);
  CHECK_NEAR(*s.row(0), 0.0, 0.0);  // no gradient: untouched, moments too
  CHECK_NEAR(s.slot(0)[0], 0.0, 0.0);
  CHECK_NEAR(s.slot(0)[1], 0.05, 1e-7);
  CHECK_NEAR(s.slot(1)[1], 0.00025, 1e-8);
}

TEST(rules_register_themselves_and_unknown_names_list_them) {
  CHECK(make_update_rule("halve", {})->name() == "halve");  // registered by this file alone
  CHECK_THROWS(make_update_rule("rmsprop", {}), PSError,
               "unknown server optimizer 'rmsprop' (known: adagrad, adam, halve, sgd)");
  CHECK_THROWS(make_update_rule("sgd", {{"momentum", 0.9}}), PSError, "unknown hyper-parameter 'momentum'");
  CHECK_THROWS(make_update_rule("adam", {{"beta1", 1.0}}), PSError, "beta1");
  Shard s = make_shard("halve", {}, 1, 2);
  const std::vector<float> start = {4, 8};
  const int64_t row = 0;
  s.scatter(&row, 1, start.data());
  s.rule().begin_step();
  s.apply(&row, 1, start.data());  // a new rule drives a shard like the built-in ones
  CHECK_NEAR(s.row(0)[0], 2, 0.0);
  CHECK_NEAR(s.row(0)[1], 4, 0.0);
}

TEST(a_batch_of_rows_gets_the_same_floats_as_one_apply_per_row) {
  // Shard::apply hands the rule the whole batch (apply_rows: the built-in rules' own loops, the
  // default's apply() per row); the reference calls apply() on each row by hand. Bit for bit,
  // over three steps, dims with and without a vector tail, owned and attached (strided) rows.
  const std::vector<std::pair<std::string, std::map<std::string, double>>> rules = {
      {"sgd", {{"lr", 0.3}}},
      {"adagrad", {{"lr", 0.1}, {"initial_accumulator_value", 0.1}}},
      {"adagrad", {{"lr", 0.1}, {"eps", 1e-3}, {"eps_in_sqrt", 1.0}, {"lr_decay", 0.01}}},
      {"adam", {{"lr", 0.01}, {"beta1", 0.8}}},
      {"halve", {}}};
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (const auto& [rule, hparams] : rules) {
    for (int64_t dim : {1, 7, 16, 32, 37, 64, 128}) {  // (the widths built apart: 16, 32, 64, 128)
      for (bool attached : {false, true}) {
        const int64_t rows = 40;
        std::vector<float> init(static_cast<size_t>(rows * dim));
        for (float& x : init) x = value(rng);
        std::vector<float> table_a(2 * init.size()), table_b(2 * init.size());  // rank 1 of 2, cyclic
        Shard a("emb", rows, dim, make_update_rule(rule, hparams)), b("emb", rows, dim, make_update_rule(rule, hparams));
        if (attached) {
          a.attach(table_a.data(), 2, 1);
          b.attach(table_b.data(), 2, 1);
        }
        std::vector<int64_t> all(rows);
        for (int64_t l = 0; l < rows; ++l) all[l] = l;
        a.scatter(all.data(), rows, init.data());
        b.scatter(all.data(), rows, init.data());
        for (int step = 0; step < 3; ++step) {
          std::vector<int64_t> picked = all;
          std::shuffle(picked.begin(), picked.end(), rng);
          picked.resize(25);  // distinct rows, in no order
          std::vector<float> grads(picked.size() * dim);
          for (float& g : grads) g = value(rng);
          a.rule().begin_step();
          b.rule().begin_step();
          a.apply(picked.data(), static_cast<int64_t>(picked.size()), grads.data());
          std::vector<float*> slots(b.num_slots());
          for (size_t i = 0; i < picked.size(); ++i) {
            for (int k = 0; k < b.num_slots(); ++k) slots[k] = b.slot(k) + picked[i] * dim;
            b.rule().apply(b.row(picked[i]), slots.data(), grads.data() + i * dim, dim);
          }
        }
        std::vector<float> out_a(init.size()), out_b(init.size());
        for (int slot = -1; slot < a.num_slots(); ++slot) {
          a.gather(all.data(), rows, out_a.data(), slot);
          b.gather(all.data(), rows, out_b.data(), slot);
          const bool same = std::memcmp(out_a.data(), out_b.data(), sizeof(float) * out_a.size()) == 0;
          if (!same) std::cerr << rule << " dim " << dim << " attached " << attached << " slot " << slot << "\n";
          CHECK(same);
        }
      }
    }
  }
}

TEST(a_rejected_hyperparameter_change_keeps_the_old_value) {
  auto rule = make_update_rule("sgd", {{"lr", 0.1}});
  CHECK_THROWS(rule->set_hyperparameter("lr", -1.0), PSError, "lr must be >= 0");
  CHECK_NEAR(rule->hyperparameters().at("lr"), 0.1, 0.0);
  CHECK_THROWS(rule->set_hyperparameter("beta1", 0.5), PSError, "no hyper-parameter 'beta1'");
}

TEST(an_attached_shard_reads_and_writes_the_callers_rows_and_detach_copies_them) {
  // Shard of rank 1 of 2 under cyclic partitioning: local row l is global row 2l + 1.
  std::vector<float> table = {0, 0, 10, 11, 0, 0, 30, 31};  // 4 rows x 2
  Shard s = make_shard("sgd", {{"lr", 1.0}}, 2, 2);
  s.attach(table.data(), 2, 1);
  CHECK(s.attached());
  CHECK(s.row_bytes() == 0);
  CHECK_NEAR(s.row(1)[1], 31, 0.0);
  const int64_t row = 1;
  const float g[2] = {1, 1};
  s.rule().begin_step();
  s.apply(&row, 1, g);
  CHECK_NEAR(table[6], 29, 0.0);  // written in the caller's memory
  s.detach();
  CHECK(!s.attached());
  table[6] = -1;
  CHECK_NEAR(s.row(1)[0], 29, 0.0);  // owns a copy now
}

namespace {

// Pages of [p, p + bytes) that are resident (p page-aligned).
int64_t resident_pages(const void* p, int64_t bytes) {
  const int64_t page = sysconf(_SC_PAGESIZE), n = (bytes + page - 1) / page;
  std::vector<unsigned char> in(static_cast<size_t>(n));
  CHECK(mincore(const_cast<void*>(p), static_cast<size_t>(bytes), in.data()) == 0);
  int64_t count = 0;
  for (unsigned char v : in) count += v & 1;
  return count;
}

}  // namespace

TEST(a_shards_rows_are_zeros_that_take_memory_only_once_written) {
  // 8 MiB of rows: a shard being loaded from a whole table grows as that table shrinks.
  Shard s = make_shard("sgd", {{"lr", 1.0}}, 65536, 32);
  const int64_t bytes = s.rows() * s.dim() * static_cast<int64_t>(sizeof(float));
  CHECK(resident_pages(s.row(0), bytes) == 0);
  CHECK(s.row_bytes() == bytes);
  const float one[32] = {1};
  const int64_t l = 1000;
  s.scatter(&l, 1, one);  // 128 bytes: one page, or one huge page (2 MiB) where the system grants them
  const int64_t resident = resident_pages(s.row(0), bytes);
  CHECK(resident >= 1 && resident <= (int64_t{2} << 20) / sysconf(_SC_PAGESIZE));
  CHECK_NEAR(s.row(1000)[0], 1, 0.0);
  CHECK_NEAR(s.row(65535)[31] + s.row(0)[0] + s.row(1000)[1], 0, 0.0);  // never written: zeros
  Shard small = make_shard("sgd", {{"lr", 1.0}}, 3, 2);  // (calloc'd, not mapped)
  CHECK_NEAR(small.row(2)[1] + small.row(0)[0], 0, 0.0);
}

TEST(a_released_range_gives_its_pages_back_and_attached_rows_stay) {
  // 8 MiB of float32 rows written everywhere, then rows [16384, 49152) released: 4 MiB.
  Shard s = make_shard("adagrad", {{"lr", 1.0}}, 65536, 32);
  const int64_t bytes = s.rows() * s.dim() * static_cast<int64_t>(sizeof(float));
  std::vector<float> ones(static_cast<size_t>(s.dim()), 1.0f);
  for (int64_t l = 0; l < s.rows(); ++l) s.set_row(l, ones.data());
  const int64_t page = sysconf(_SC_PAGESIZE), before = resident_pages(s.row(0), bytes);
  CHECK(before == bytes / page);
  s.release(-1, 16384, 32768);
  CHECK(resident_pages(s.row(0), bytes) == before - (int64_t{4} << 20) / page);
  CHECK_NEAR(s.row(16384)[0] + s.row(49151)[31], 0, 0.0);  // released rows read as zeros
  CHECK_NEAR(s.row(16383)[31] + s.row(49152)[0], 2, 0.0);  // their neighbours keep theirs
  s.release(0, 0, 65536);  // the optimizer slot, whole
  CHECK(resident_pages(s.slot(0), bytes) == 0);
  s.release(-1, 65000, 1000);  // past the end: nothing
  CHECK_NEAR(s.row(65535)[0], 1, 0.0);
  // Rows aliasing a caller's buffer are the caller's: never released.
  std::vector<float> table(64, 5.0f);
  Shard a = make_shard("sgd", {{"lr", 1.0}}, 32, 2);
  a.attach(table.data(), 1, 0);
  a.release(-1, 0, 32);
  CHECK_NEAR(table[0] + table[63], 10, 0.0);
}
