// The Client: table registration and the operations on whole tables (initialisation, loading,
// gathering, replicas, local state). The per-step pull and push live in exchange.cc.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <utility>

#include "client_impl.h"
#include "wire.h"

namespace hybridsync {

namespace {

std::string describe(const TableSpec& s) {
  std::ostringstream out;
  out << "'" << s.name << "' rows=" << s.num_rows << " dim=" << s.dim << " shards=" << s.num_shards
      << " partition=" << (s.partition == PartitionKind::kCyclic ? "cyclic" : "block")
      << " optimizer=" << s.rule;
  for (const auto& [k, v] : s.hparams) out << " " << k << "=" << v;
  return out.str();
}

// Seeded value for element (id, col): a counter-based hash, so it does not depend on sharding.
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

double uniform01(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) / 9007199254740992.0; }

// Local row l of the rows (slot < 0) or of optimizer slot `slot`.
float* row_of(Shard& shard, int slot, int64_t l) {
  return slot < 0 ? shard.row(l) : shard.slot(slot) + l * shard.dim();
}

// Gives the pages wholly inside the first `bytes` of a buffer back to the system, a growing
// prefix at a time (MADV_DONTNEED: they read as zeros, or as their file, if touched again).
class PageReleaser {
 public:
  PageReleaser(const void* base, int64_t size) : base_(reinterpret_cast<uintptr_t>(base)), size_(size) {
    page_ = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    done_ = (base_ + page_ - 1) & ~(page_ - 1);
  }
  void release_to(int64_t bytes) {
    const uintptr_t end = (base_ + static_cast<uintptr_t>(std::min(bytes, size_))) & ~(page_ - 1);
    if (base_ == 0 || end <= done_) return;
    madvise(reinterpret_cast<void*>(done_), end - done_, MADV_DONTNEED);  // advisory: a failure only costs memory
    done_ = end;
  }

 private:
  uintptr_t base_, page_, done_;
  int64_t size_;
};

void check_slot(const Table& t, int slot) {
  if (t.shard && slot >= t.shard->num_slots()) {
    throw PSError("table '" + t.spec.name + "': optimizer '" + t.spec.rule + "' has no state slot " + std::to_string(slot));
  }
}

// Fills this rank's shard element by element from a seeded counter-based generator.
template <class Value>
void init_rows(Table& t, int rank, uint64_t seed, Value value) {
  if (!t.shard) return;
  const int64_t dim = t.spec.dim;
  for (int64_t l = 0; l < t.shard->rows(); ++l) {
    const uint64_t id = static_cast<uint64_t>(t.part.global_id(rank, l));
    float* row = t.shard->row(l);
    for (int64_t j = 0; j < dim; ++j) {
      row[j] = value(mix64(seed ^ mix64(id * static_cast<uint64_t>(dim) + static_cast<uint64_t>(j))));
    }
  }
}

}  // namespace

std::vector<char> error_request(const std::string& message) {
  Writer w;
  w.i64(static_cast<int64_t>(RequestKind::kError));
  w.text(message);
  return w.take();
}

void throw_remote(const std::vector<std::string>& errors, int self, const char* op) {
  for (size_t r = 0; r < errors.size(); ++r) {
    if (static_cast<int>(r) == self || errors[r].empty()) continue;
    throw PSRemoteError("hybridsync " + std::string(op) + " failed on rank " + std::to_string(r) + ": " + errors[r]);
  }
}

void check_rows(const Shard* shard, const std::string& table, const int64_t* local, int64_t n, const char* op) {
  if (n == 0) return;
  if (!shard) throw PSTransportError(std::string(op) + " for table '" + table + "' reached a rank without its shard");
  for (int64_t i = 0; i < n; ++i) {
    if (local[i] < 0 || local[i] >= shard->rows()) throw PSTransportError(std::string(op) + " for table '" + table + "': bad row index");
  }
}

Table& Client::Impl::table_at(int table) const {
  if (table < 0 || table >= static_cast<int>(tables.size())) {
    throw PSError("unknown PS table handle " + std::to_string(table));
  }
  Table& t = *tables[table];
  if (t.dropped) throw PSError("PS table '" + t.spec.name + "' was dropped (its variable left the parameter server)");
  return t;
}

void Client::Impl::check_usable() const {
  if (broken) throw PSRemoteError("hybridsync PS is unusable after an earlier failure: " + broken_reason);
}

Client::Client(std::unique_ptr<Transport> transport) : impl_(std::make_unique<Impl>()) {
  impl_->transport = std::move(transport);
}

Client::~Client() = default;

int Client::rank() const { return impl_->rank(); }
int Client::size() const { return impl_->size(); }

TableSpec Client::spec(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->table_at(table).spec;
}

int Client::add_table(const TableSpec& given, const std::string& given_error) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& c = *impl_;
  return c.guarded([&] {
    c.begin_collective();
    TableSpec spec = given;
    if (spec.num_shards == 0) spec.num_shards = c.size();
    std::string error = given_error;
    if (!error.empty()) {
      error = "table '" + spec.name + "': " + error;
    } else if (spec.num_shards < 1 || spec.num_shards > c.size()) {
      error = "table '" + spec.name + "': partitions must be in [1, " + std::to_string(c.size()) +
              "] (the world size), got " + std::to_string(spec.num_shards);
    } else if (spec.num_rows < 0 || spec.dim < 1) {
      error = "table '" + spec.name + "': shape (" + std::to_string(spec.num_rows) + ", " + std::to_string(spec.dim) +
              ") is not a valid (rows, dim)";
    }
    std::unique_ptr<UpdateRule> rule;
    if (error.empty()) {
      try {
        rule = make_update_rule(spec.rule, spec.hparams);
      } catch (const PSError& e) {
        error = "table '" + spec.name + "': " + e.what();
      }
    }
    // Every rank tells every rank what it registers; all compare, so all agree on the verdict.
    const std::string mine = error.empty() ? describe(spec) : "ERROR " + error;
    for (int r = 0; r < c.size(); ++r) {
      Writer w;
      w.text(mine);
      c.transport->send(r, kTagControl, w.take());
    }
    std::vector<std::string> theirs(c.size());
    for (int r = 0; r < c.size(); ++r) {
      auto msg = c.transport->recv(r, kTagControl);
      theirs[r] = Reader(msg).text();
    }
    if (!error.empty()) throw PSError(error);
    for (int r = 0; r < c.size(); ++r) {
      if (theirs[r].rfind("ERROR ", 0) == 0) {
        throw PSRemoteError("hybridsync table registration failed on rank " + std::to_string(r) + ": " +
                            theirs[r].substr(6));
      }
      if (theirs[r] != mine) {
        throw PSError("PS table #" + std::to_string(c.tables.size()) + " differs between ranks: rank " +
                      std::to_string(c.rank()) + " has " + mine + ", rank " + std::to_string(r) + " has " + theirs[r] +
                      " (every rank must build the same model)");
      }
    }
    auto table = std::make_unique<Table>(Table{spec, Partitioner(spec.num_rows, spec.num_shards, spec.partition),
                                               nullptr, RowAggregator()});
    if (c.rank() < spec.num_shards) {
      table->shard = std::make_unique<Shard>(spec.name, table->part.shard_rows(c.rank()), spec.dim, std::move(rule));
    }
    c.tables.push_back(std::move(table));
    return static_cast<int>(c.tables.size()) - 1;
  });
}

void Client::load_from_root(int table, const float* values, int root, const std::string& error, bool consume) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& c = *impl_;
  c.guarded([&] {
    c.begin_collective();
    Table& t = c.table_at(table);
    if (root < 0 || root >= c.size()) {  // every rank sees the same root: all throw, none waits
      throw PSError("table '" + t.spec.name + "': load_from_root needs a root rank in [0, " + std::to_string(c.size()) +
                    "), got " + std::to_string(root));
    }
    const int64_t dim = t.spec.dim;
    // The root tells every rank (shard or not) its verdict first, so a bad array on the root
    // makes every rank throw instead of leaving the shards waiting for rows.
    if (c.rank() == root) {
      for (int r = 0; r < c.size(); ++r) {
        Writer w;
        w.text(error);
        c.transport->send(r, kTagControl, w.take());
      }
    }
    auto msg = c.transport->recv(root, kTagControl);
    const std::string verdict = Reader(msg).text();
    if (!verdict.empty()) {
      c.transport->wait_sends();
      if (c.rank() == root) throw PSError(verdict);
      throw PSRemoteError("hybridsync load_from_root failed on rank " + std::to_string(root) + ": " + verdict);
    }
    // Rows travel in chunks of about kChunkBytes, at most one chunk in flight: the root never
    // holds a second copy of the table. Each shard's k-th chunk goes out in round k, so the rows
    // handed over form a growing prefix of the table (ids are increasing in each shard's local
    // order); with `consume`, that prefix's pages go back to the system after every round and
    // the root's own shard (whose pages become resident only as they are written) grows as the
    // table shrinks.
    constexpr int64_t kChunkBytes = 256 << 10;
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / static_cast<int64_t>(dim * sizeof(float)));
    if (c.rank() == root) {
      const int shards = t.spec.num_shards;
      std::vector<int64_t> next(static_cast<size_t>(shards), 0);  // each shard's first row not handed over
      PageReleaser released(values, t.spec.num_rows * dim * static_cast<int64_t>(sizeof(float)));
      for (bool more = true; more;) {
        more = false;
        for (int s = 0; s < shards; ++s) {
          const int64_t n = t.part.shard_rows(s), start = next[static_cast<size_t>(s)];
          if (start >= n) continue;
          const int64_t count = std::min(chunk, n - start);
          if (s == root) {  // our own shard: straight from the caller's array
            for (int64_t l = start; l < start + count; ++l) {
              std::memcpy(t.shard->row(l), values + t.part.global_id(s, l) * dim, dim * sizeof(float));
            }
          } else {
            Writer w;
            float* rows = w.f32_slot(count * dim);
            for (int64_t l = 0; l < count; ++l) {
              std::memcpy(rows + l * dim, values + t.part.global_id(s, start + l) * dim, dim * sizeof(float));
            }
            c.transport->send(s, kTagControl, w.take());
            c.transport->wait_sends();
          }
          next[static_cast<size_t>(s)] = start + count;
          more = more || start + count < n;
        }
        if (consume) {
          int64_t prefix = t.spec.num_rows;  // every row below it has been handed over
          for (int s = 0; s < shards; ++s) {
            if (next[static_cast<size_t>(s)] < t.part.shard_rows(s)) {
              prefix = std::min(prefix, t.part.global_id(s, next[static_cast<size_t>(s)]));
            }
          }
          released.release_to(prefix * dim * static_cast<int64_t>(sizeof(float)));
        }
      }
    } else if (t.shard) {
      for (int64_t start = 0; start < t.shard->rows(); start += chunk) {
        const int64_t count = std::min(chunk, t.shard->rows() - start);
        auto rows_msg = c.transport->recv(root, kTagControl);
        Reader r(rows_msg);
        const float* rows = r.f32s(static_cast<size_t>(count * dim));
        for (int64_t l = 0; l < count; ++l) std::memcpy(t.shard->row(start + l), rows + l * dim, dim * sizeof(float));
      }
    }
    c.transport->wait_sends();
  });
}

std::vector<float> Client::gather(int table, int slot) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& c = *impl_;
  return c.guarded([&] {
    c.begin_collective();
    Table& t = c.table_at(table);
    const int64_t dim = t.spec.dim;
    std::string error;
    try {
      check_slot(t, slot);
    } catch (const PSError& e) {
      error = e.what();
    }
    if (t.shard) {
      Writer w;
      w.text(error);
      if (error.empty()) {
        float* out = w.f32_slot(t.shard->rows() * dim);
        for (int64_t l = 0; l < t.shard->rows(); ++l) std::memcpy(out + l * dim, row_of(*t.shard, slot, l), dim * sizeof(float));
      }
      std::vector<char> payload = w.take();
      for (int d = 0; d < c.size(); ++d) c.transport->send(d, kTagControl, payload);
    }
    std::vector<float> full(static_cast<size_t>(t.spec.num_rows * dim));
    std::string remote;
    for (int s = 0; s < t.spec.num_shards; ++s) {
      auto msg = c.transport->recv(s, kTagControl);
      Reader r(msg);
      const std::string e = r.text();
      if (!e.empty()) {
        remote = e;
        continue;
      }
      const int64_t n = t.part.shard_rows(s);
      const float* rows = r.f32s(n * dim);
      for (int64_t l = 0; l < n; ++l) std::memcpy(full.data() + t.part.global_id(s, l) * dim, rows + l * dim, dim * sizeof(float));
    }
    c.transport->wait_sends();
    if (!remote.empty()) throw PSError(remote);
    return full;
  });
}

void Client::load_local(int table, int slot, const float* values) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->settle();
  Table& t = impl_->table_at(table);
  if (!t.shard) return;
  check_slot(t, slot);
  const int64_t dim = t.spec.dim;
  for (int64_t l = 0; l < t.shard->rows(); ++l) {
    std::memcpy(row_of(*t.shard, slot, l), values + t.part.global_id(impl_->rank(), l) * dim, dim * sizeof(float));
  }
}

void Client::attach_replica(int table, float* full_table) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->settle();
  Table& t = impl_->table_at(table);
  if (!t.shard) return;
  if (!full_table) {
    t.shard->detach();
    return;
  }
  // Local row l is global row global_id(rank, l) = l * stride + offset.
  if (t.spec.partition == PartitionKind::kCyclic) {
    t.shard->attach(full_table, t.spec.num_shards, impl_->rank());
  } else {
    t.shard->attach(full_table, 1, t.part.global_id(impl_->rank(), 0));
  }
}

void Client::write_local(int table, int slot, const int64_t* ids, int64_t n, const float* rows) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->settle();
  Table& t = impl_->table_at(table);
  check_ids(t.spec.name, ids, n, t.spec.num_rows);
  check_slot(t, slot);
  if (!t.shard) return;
  for (int64_t i = 0; i < n; ++i) {
    if (t.part.shard_of(ids[i]) != impl_->rank()) continue;
    std::memcpy(row_of(*t.shard, slot, t.part.local_index(ids[i])), rows + i * t.spec.dim, t.spec.dim * sizeof(float));
  }
}

std::vector<float> Client::local_values(int table, int slot) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->settle();
  Table& t = impl_->table_at(table);
  check_slot(t, slot);
  if (!t.shard) return {};
  const int64_t dim = t.spec.dim;
  std::vector<float> out(static_cast<size_t>(t.shard->rows() * dim));
  for (int64_t l = 0; l < t.shard->rows(); ++l) std::memcpy(out.data() + l * dim, row_of(*t.shard, slot, l), dim * sizeof(float));
  return out;
}

void Client::drop_table(int table) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& c = *impl_;
  c.table_at(table);  // an unknown or already dropped handle throws before anything moves
  c.settle();          // pushes already started may still name the table
  Table& t = *c.tables[table];
  t.shard.reset();
  t.sums = RowAggregator{};
  t.dropped = true;
}

void Client::rename_table(int table, const std::string& name) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Table& t = impl_->table_at(table);
  t.spec.name = name;
  if (t.shard) t.shard->rename(name);
}

void Client::set_rule(int table, const std::string& rule, const std::map<std::string, double>& hparams) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->settle();
  Table& t = impl_->table_at(table);
  auto made = make_update_rule(rule, hparams);  // validates on every rank, shard or not
  t.spec.rule = rule;
  t.spec.hparams = hparams;
  if (t.shard) t.shard->set_rule(std::move(made));
}

void Client::init_normal(int table, uint64_t seed, float mean, float stddev) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->settle();
  const double two_pi = 6.283185307179586;
  init_rows(impl_->table_at(table), impl_->rank(), seed, [&](uint64_t key) {
    const double u1 = uniform01(key), u2 = uniform01(mix64(key));
    return mean + stddev * static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi * u2));
  });
}

void Client::init_uniform(int table, uint64_t seed, float low, float high) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->settle();
  init_rows(impl_->table_at(table), impl_->rank(), seed,
            [&](uint64_t key) { return low + (high - low) * static_cast<float>(uniform01(key)); });
}

void Client::set_step(int table, int64_t step) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->settle();
  Table& t = impl_->table_at(table);
  if (t.shard) t.shard->rule().set_step(step);
}

int64_t Client::step(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->settle();
  const Table& t = impl_->table_at(table);
  return t.shard ? t.shard->rule().step() : -1;
}

std::vector<std::string> Client::slot_names(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Table& t = impl_->table_at(table);
  return t.shard ? t.shard->rule().slot_names() : make_update_rule(t.spec.rule, t.spec.hparams)->slot_names();
}

std::map<std::string, double> Client::hyperparameters(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Table& t = impl_->table_at(table);
  return t.shard ? t.shard->rule().hyperparameters() : t.spec.hparams;
}

int64_t Client::shard_rows(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Table& t = impl_->table_at(table);
  return t.shard ? t.shard->rows() : 0;
}

int64_t Client::row_store_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  int64_t total = 0;
  for (const auto& t : impl_->tables) total += t->shard ? t->shard->row_bytes() : 0;
  return total;
}

int64_t Client::state_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  int64_t total = 0;
  for (const auto& t : impl_->tables) total += t->shard ? t->shard->state_bytes() : 0;
  return total;
}

TrafficStats Client::traffic() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Transport& tr = *impl_->transport;
  return TrafficStats{tr.bytes_sent(), tr.bytes_received(), tr.messages_sent()};
}

void Client::reset_traffic() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->transport->reset_counters();
}

void Client::set_tracing(bool on) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->tracer.set_on(on);
}

std::vector<TraceEvent> Client::take_trace() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->tracer.take();
}

}  // namespace hybridsync
