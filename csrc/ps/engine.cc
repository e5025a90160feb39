// The Engine's collective operations. Protocol, per operation, on every rank:
//   1. as a worker, send one request to every rank (possibly empty, or an error notice);
//   2. as a server, receive one request from every rank and answer it;
//   3. as a worker, collect the answers.
// Requests travel in operation order per (source, tag), so a server always applies a push
// before it serves the next pull from any rank.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>
#include <unordered_map>

#include "../transport/transport.h"
#include "hybridsync/ps.h"
#include "wire.h"

namespace hybridsync {

struct Engine::Table {
  TableSpec spec;
  Partitioner part;
  std::unique_ptr<Shard> shard;  // null when this rank holds no shard of the table
};

// A push whose requests were sent but not yet received and applied by this rank's shards.
struct Engine::Round {
  float scale = 1.0f;
  std::map<int, double> lr;          // table -> learning rate for this round
  bool self_error_reported = false;  // this rank already threw for its own bad input
};

namespace {

// Rows one worker sends one server for one table.
struct Slice {
  int table = -1;
  std::vector<int64_t> local;     // row positions in the server's shard
  std::vector<int64_t> position;  // pull: index into the worker's unique ids
  std::vector<float> grads;       // push: local.size() x dim
};

std::string describe(const TableSpec& s) {
  std::ostringstream out;
  out << "'" << s.name << "' rows=" << s.num_rows << " dim=" << s.dim << " shards=" << s.num_shards
      << " partition=" << (s.partition == PartitionKind::kCyclic ? "cyclic" : "block")
      << " optimizer=" << s.rule;
  for (const auto& [k, v] : s.hparams) out << " " << k << "=" << v;
  return out.str();
}

std::vector<char> error_request(const std::string& message) {
  Writer w;
  w.i64(static_cast<int64_t>(RequestKind::kError));
  w.text(message);
  return w.take();
}

// Throws the first error a peer announced (this rank's own is thrown by the caller).
void throw_remote(const std::vector<std::string>& errors, int self, const char* op) {
  for (size_t r = 0; r < errors.size(); ++r) {
    if (static_cast<int>(r) == self || errors[r].empty()) continue;
    throw PSRemoteError("hybridsync " + std::string(op) + " failed on rank " + std::to_string(r) +
                        ": " + errors[r]);
  }
}

// Seeded value for element (id, col): a counter-based hash, so it does not depend on sharding.
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// A server's sanity check of row positions a worker sent (they come from our own partitioner).
void check_rows(const Shard* shard, const std::string& table, const std::vector<int64_t>& local, const char* op) {
  if (local.empty()) return;
  if (!shard) throw PSTransportError(std::string(op) + " for table '" + table + "' reached a rank without its shard");
  for (int64_t l : local) {
    if (l < 0 || l >= shard->rows()) throw PSTransportError(std::string(op) + " for table '" + table + "': bad row index");
  }
}

// Local row l of the rows (slot < 0) or of optimizer slot `slot`.
float* row_of(Shard& shard, int slot, int64_t l) {
  return slot < 0 ? shard.row(l) : shard.slot(slot) + l * shard.dim();
}

double uniform01(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) / 9007199254740992.0; }

// Runs one collective operation; a transport or protocol failure leaves the Engine unusable,
// because peers may be stuck half-way through the operation.
template <class F>
auto guarded(bool& broken, std::string& reason, F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const PSTransportError& e) {
    broken = true;
    reason = e.what();
    throw;
  }
}

}  // namespace

Engine::Engine(std::unique_ptr<Transport> transport) : transport_(std::move(transport)) {}

Engine::~Engine() = default;

int Engine::rank() const { return transport_->rank(); }
int Engine::size() const { return transport_->size(); }

void Engine::check_usable() const {
  if (broken_) throw PSRemoteError("hybridsync PS is unusable after an earlier failure: " + broken_reason_);
}

Engine::Table& Engine::table_at(int table) const {
  if (table < 0 || table >= static_cast<int>(tables_.size())) {
    throw PSError("unknown PS table handle " + std::to_string(table));
  }
  return *tables_[table];
}

const TableSpec& Engine::spec(int table) const { return table_at(table).spec; }
const Partitioner& Engine::partitioner(int table) const { return table_at(table).part; }
Shard* Engine::local_shard(int table) { return table_at(table).shard.get(); }

int Engine::add_table(const TableSpec& given) {
  return guarded(broken_, broken_reason_, [&] {
    check_usable();
    drain_pending();
    TableSpec spec = given;
    if (spec.num_shards == 0) spec.num_shards = size();
    std::string error;
    if (spec.num_shards < 1 || spec.num_shards > size()) {
      error = "table '" + spec.name + "': partitions must be in [1, " + std::to_string(size()) +
              "] (the world size), got " + std::to_string(spec.num_shards);
    } else if (spec.num_rows < 0 || spec.dim < 1) {
      error = "table '" + spec.name + "': shape (" + std::to_string(spec.num_rows) + ", " +
              std::to_string(spec.dim) + ") is not a valid (rows, dim)";
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
    for (int r = 0; r < size(); ++r) {
      Writer w;
      w.text(mine);
      transport_->send(r, kTagControl, w.take());
    }
    std::vector<std::string> theirs(size());
    for (int r = 0; r < size(); ++r) {
      auto msg = transport_->recv(r, kTagControl);
      theirs[r] = Reader(msg).text();
    }
    if (!error.empty()) throw PSError(error);
    for (int r = 0; r < size(); ++r) {
      if (theirs[r].rfind("ERROR ", 0) == 0) {
        throw PSRemoteError("hybridsync table registration failed on rank " + std::to_string(r) +
                            ": " + theirs[r].substr(6));
      }
      if (theirs[r] != mine) {
        throw PSError("PS table #" + std::to_string(tables_.size()) + " differs between ranks: rank " +
                      std::to_string(rank()) + " has " + mine + ", rank " + std::to_string(r) +
                      " has " + theirs[r] + " (every rank must build the same model)");
      }
    }
    auto table = std::make_unique<Table>(Table{spec, Partitioner(spec.num_rows, spec.num_shards, spec.partition), nullptr});
    if (rank() < spec.num_shards) {
      table->shard = std::make_unique<Shard>(spec.name, table->part.shard_rows(rank()), spec.dim,
                                             std::move(rule));
    }
    tables_.push_back(std::move(table));
    return static_cast<int>(tables_.size()) - 1;
  });
}

std::vector<PullResult> Engine::pull(const std::vector<TableBatch>& batches, const std::string& error) {
  return guarded(broken_, broken_reason_, [&] {
    check_usable();
    drain_pending();
    const int P = size();
    std::string local_error = error;
    bool index_error = false;
    std::vector<PullResult> results(batches.size());
    std::vector<std::vector<Slice>> to(P);  // to[dest]: one slice per batch
    try {
      if (local_error.empty()) {
        for (int d = 0; d < P; ++d) to[d].resize(batches.size());
        for (size_t b = 0; b < batches.size(); ++b) {
          const Table& t = table_at(batches[b].table);
          Dedup dd = deduplicate(t.spec.name, batches[b].ids, batches[b].n, t.spec.num_rows);
          for (int d = 0; d < P; ++d) to[d][b].table = batches[b].table;
          for (size_t u = 0; u < dd.unique.size(); ++u) {
            Slice& s = to[t.part.shard_of(dd.unique[u])][b];
            s.local.push_back(t.part.local_index(dd.unique[u]));
            s.position.push_back(static_cast<int64_t>(u));
          }
          results[b].unique = std::move(dd.unique);
          results[b].inverse = std::move(dd.inverse);
          results[b].rows.resize(results[b].unique.size() * t.spec.dim);
        }
      }
    } catch (const PSIndexError& e) {
      local_error = e.what();
      index_error = true;
    } catch (const PSError& e) {
      local_error = e.what();
    }
    for (int d = 0; d < P; ++d) {
      if (!local_error.empty()) {
        transport_->send(d, kTagRequest, error_request(local_error));
        continue;
      }
      Writer w;
      w.i64(static_cast<int64_t>(RequestKind::kPull));
      w.i64(static_cast<int64_t>(to[d].size()));
      for (const Slice& s : to[d]) {
        w.i64(s.table);
        w.i64(static_cast<int64_t>(s.local.size()));
      }
      for (const Slice& s : to[d]) w.i64s(s.local.data(), s.local.size());
      transport_->send(d, kTagRequest, w.take());
    }
    // Serve every worker's request from this rank's shards.
    std::vector<std::string> errors(P);
    for (int src = 0; src < P; ++src) {
      auto msg = transport_->recv(src, kTagRequest);
      Reader r(msg);
      const auto kind = static_cast<RequestKind>(r.i64());
      Writer reply;
      if (kind == RequestKind::kError) {
        errors[src] = r.text();
      } else if (kind == RequestKind::kPull) {
        const int64_t n_tables = r.i64();
        std::vector<std::pair<int64_t, int64_t>> header(static_cast<size_t>(n_tables));
        for (auto& h : header) h = {r.i64(), r.i64()};
        for (const auto& [table, count] : header) {
          Table& t = table_at(static_cast<int>(table));
          std::vector<int64_t> local = r.i64s(static_cast<size_t>(count));
          check_rows(t.shard.get(), t.spec.name, local, "pull");
          if (count) t.shard->gather(local.data(), count, reply.f32_slot(count * t.spec.dim));
        }
      } else {
        throw PSTransportError("hybridsync: ranks called different PS operations (pull vs push)");
      }
      transport_->send(src, kTagReply, reply.take());
    }
    // Collect the rows this worker asked for.
    for (int d = 0; d < P; ++d) {
      auto msg = transport_->recv(d, kTagReply);
      if (!local_error.empty() || !errors[d].empty()) continue;
      Reader r(msg);
      for (size_t b = 0; b < batches.size(); ++b) {
        const Slice& s = to[d][b];
        const int64_t dim = table_at(s.table).spec.dim;
        const float* rows = r.f32s(s.local.size() * dim);
        for (size_t k = 0; k < s.position.size(); ++k) {
          std::memcpy(results[b].rows.data() + s.position[k] * dim, rows + k * dim, dim * sizeof(float));
        }
      }
    }
    if (!local_error.empty()) {
      if (index_error) throw PSIndexError(local_error);
      throw PSError(local_error);
    }
    throw_remote(errors, rank(), "pull");
    return results;
  });
}

std::vector<RowUpdates> Engine::push(const std::vector<TableBatch>& batches, float scale,
                                     bool return_updates, const std::string& error) {
  return guarded(broken_, broken_reason_, [&] {
    check_usable();
    drain_pending();
    const int P = size();
    std::string local_error = error;
    bool index_error = false;
    std::vector<std::vector<Slice>> to(P);
    try {
      if (local_error.empty()) {
        for (int d = 0; d < P; ++d) to[d].resize(batches.size());
        for (size_t b = 0; b < batches.size(); ++b) {
          const Table& t = table_at(batches[b].table);
          const int64_t dim = t.spec.dim;
          // Sum duplicate ids here, so each row crosses the wire once per worker.
          Dedup dd = deduplicate(t.spec.name, batches[b].ids, batches[b].n, t.spec.num_rows);
          std::vector<float> summed(dd.unique.size() * dim, 0.0f);
          for (int64_t i = 0; i < batches[b].n; ++i) {
            float* dst = summed.data() + dd.inverse[i] * dim;
            const float* g = batches[b].grads + i * dim;
            for (int64_t j = 0; j < dim; ++j) dst[j] += g[j];
          }
          for (int d = 0; d < P; ++d) to[d][b].table = batches[b].table;
          for (size_t u = 0; u < dd.unique.size(); ++u) {
            Slice& s = to[t.part.shard_of(dd.unique[u])][b];
            s.local.push_back(t.part.local_index(dd.unique[u]));
            s.grads.insert(s.grads.end(), summed.begin() + u * dim, summed.begin() + (u + 1) * dim);
          }
        }
      }
    } catch (const PSIndexError& e) {
      local_error = e.what();
      index_error = true;
    } catch (const PSError& e) {
      local_error = e.what();
    }
    for (int d = 0; d < P; ++d) {
      if (!local_error.empty()) {
        transport_->send(d, kTagRequest, error_request(local_error));
        continue;
      }
      Writer w;
      w.i64(static_cast<int64_t>(RequestKind::kPush));
      w.i64(static_cast<int64_t>(to[d].size()));
      for (const Slice& s : to[d]) {
        w.i64(s.table);
        w.i64(static_cast<int64_t>(s.local.size()));
      }
      for (const Slice& s : to[d]) w.i64s(s.local.data(), s.local.size());
      for (const Slice& s : to[d]) w.f32s(s.grads.data(), s.grads.size());
      transport_->send(d, kTagRequest, w.take());
    }
    Round round;
    round.scale = scale;
    round.self_error_reported = !local_error.empty();
    if (local_error.empty()) {
      for (const TableBatch& b : batches) {
        if (b.lr >= 0) round.lr[b.table] = b.lr;
      }
    }
    std::vector<RowUpdates> out;
    if (!return_updates) {
      pending_.push_back(round);  // applied at the start of the next operation
    } else {
      std::map<int, RowUpdates> updates;
      apply_round(round, &updates);
      if (local_error.empty()) {
        for (const TableBatch& b : batches) out.push_back(std::move(updates[b.table]));
      }
    }
    if (!local_error.empty()) {
      if (index_error) throw PSIndexError(local_error);
      throw PSError(local_error);
    }
    return out;
  });
}

void Engine::flush() {
  return guarded(broken_, broken_reason_, [&] {
    check_usable();
    drain_pending();
  });
}

void Engine::drain_pending() {
  while (!pending_.empty()) {
    Round round = pending_.front();
    pending_.erase(pending_.begin());
    apply_round(round, nullptr);
  }
}

void Engine::apply_round(const Round& round, std::map<int, RowUpdates>* updates) {
  const int P = size();
  // Per table: the sum over workers of each row's gradient, rows in first-seen order.
  struct Accumulator {
    std::unordered_map<int64_t, int64_t> slot_of;
    std::vector<int64_t> local;
    std::vector<float> sum;
  };
  std::map<int, Accumulator> acc;  // ordered: deterministic apply order
  std::vector<std::string> errors(P);
  for (int src = 0; src < P; ++src) {
    auto msg = transport_->recv(src, kTagRequest);
    Reader r(msg);
    const auto kind = static_cast<RequestKind>(r.i64());
    if (kind == RequestKind::kError) {
      errors[src] = r.text();
      continue;
    }
    if (kind != RequestKind::kPush) {
      throw PSTransportError("hybridsync: ranks called different PS operations (push vs pull)");
    }
    const int64_t n_tables = r.i64();
    std::vector<std::pair<int64_t, int64_t>> header(static_cast<size_t>(n_tables));
    for (auto& h : header) h = {r.i64(), r.i64()};
    std::vector<std::vector<int64_t>> locals;
    for (const auto& h : header) locals.push_back(r.i64s(static_cast<size_t>(h.second)));
    for (size_t h = 0; h < header.size(); ++h) {
      Table& t = table_at(static_cast<int>(header[h].first));
      const int64_t dim = t.spec.dim;
      Accumulator& a = acc[static_cast<int>(header[h].first)];
      const float* grads = r.f32s(locals[h].size() * dim);
      check_rows(t.shard.get(), t.spec.name, locals[h], "push");
      for (size_t k = 0; k < locals[h].size(); ++k) {
        const int64_t l = locals[h][k];
        auto [it, inserted] = a.slot_of.emplace(l, static_cast<int64_t>(a.local.size()));
        if (inserted) {
          a.local.push_back(l);
          a.sum.resize(a.sum.size() + dim, 0.0f);
        }
        float* dst = a.sum.data() + it->second * dim;
        const float* g = grads + k * dim;
        for (int64_t j = 0; j < dim; ++j) dst[j] += g[j];
      }
    }
  }
  bool failed = false;
  for (int src = 0; src < P; ++src) failed = failed || !errors[src].empty();
  // All-or-nothing: a round with any bad input changes no row on any shard.
  if (!failed) {
    for (auto& [table, a] : acc) {
      Table& t = *tables_[table];
      if (!t.shard) continue;
      for (float& v : a.sum) v *= round.scale;
      auto lr = round.lr.find(table);
      if (lr != round.lr.end()) t.shard->rule().set_hyperparameter("lr", lr->second);
      t.shard->rule().begin_step();
      t.shard->apply(a.local.data(), static_cast<int64_t>(a.local.size()), a.sum.data());
    }
  }
  if (updates) {
    // Every shard tells every rank which rows changed, so all replicas stay identical.
    Writer w;
    int64_t n_tables = 0;
    for (auto& [table, a] : acc) n_tables += (tables_[table]->shard && !failed) ? 1 : 0;
    w.i64(n_tables);
    for (auto& [table, a] : acc) {
      Table& t = *tables_[table];
      if (!t.shard || failed) continue;
      w.i64(table);
      w.i64(static_cast<int64_t>(a.local.size()));
      std::vector<int64_t> ids(a.local.size());
      for (size_t k = 0; k < ids.size(); ++k) ids[k] = t.part.global_id(rank(), a.local[k]);
      w.i64s(ids.data(), ids.size());
      float* rows = w.f32_slot(a.local.size() * t.spec.dim);
      t.shard->gather(a.local.data(), static_cast<int64_t>(a.local.size()), rows);
    }
    std::vector<char> payload = w.take();
    for (int d = 0; d < P; ++d) transport_->send(d, kTagUpdates, payload);
    for (int src = 0; src < P; ++src) {
      auto msg = transport_->recv(src, kTagUpdates);
      Reader r(msg);
      const int64_t n = r.i64();
      for (int64_t k = 0; k < n; ++k) {
        const int table = static_cast<int>(r.i64());
        const int64_t count = r.i64();
        const int64_t dim = table_at(table).spec.dim;
        const std::vector<int64_t> ids = r.i64s(static_cast<size_t>(count));
        const float* rows = r.f32s(count * dim);
        RowUpdates& u = (*updates)[table];
        u.ids.insert(u.ids.end(), ids.begin(), ids.end());
        u.rows.insert(u.rows.end(), rows, rows + count * dim);
      }
    }
  }
  if (!round.self_error_reported) throw_remote(errors, rank(), "push");
}

void Engine::load_from_root(int table, const float* values, int root) {
  return guarded(broken_, broken_reason_, [&] {
    check_usable();
    drain_pending();
    Table& t = table_at(table);
    const int64_t dim = t.spec.dim;
    if (rank() == root) {
      for (int s = 0; s < t.spec.num_shards; ++s) {
        Writer w;
        const int64_t n = t.part.shard_rows(s);
        float* rows = w.f32_slot(n * dim);
        for (int64_t l = 0; l < n; ++l) {
          std::memcpy(rows + l * dim, values + t.part.global_id(s, l) * dim, dim * sizeof(float));
        }
        transport_->send(s, kTagControl, w.take());
      }
    }
    if (t.shard) {
      auto msg = transport_->recv(root, kTagControl);
      if (msg.size() != static_cast<size_t>(t.shard->rows() * dim) * sizeof(float)) {
        throw PSTransportError("table '" + t.spec.name + "': initial rows from rank " + std::to_string(root) + " have the wrong size");
      }
      const float* rows = reinterpret_cast<const float*>(msg.data());
      for (int64_t l = 0; l < t.shard->rows(); ++l) std::memcpy(t.shard->row(l), rows + l * dim, dim * sizeof(float));
    }
    transport_->wait_sends();
  });
}

void Engine::load_local(int table, int slot, const float* values) {
  Table& t = table_at(table);
  if (!t.shard) return;
  if (slot >= t.shard->num_slots()) {
    throw PSError("table '" + t.spec.name + "': optimizer '" + t.spec.rule + "' has no state slot " + std::to_string(slot));
  }
  const int64_t dim = t.spec.dim;
  for (int64_t l = 0; l < t.shard->rows(); ++l) {
    std::memcpy(row_of(*t.shard, slot, l), values + t.part.global_id(rank(), l) * dim, dim * sizeof(float));
  }
}

void Engine::attach_replica(int table, float* full_table) {
  Table& t = table_at(table);
  if (!t.shard) return;
  if (!full_table) {
    t.shard->detach();
    return;
  }
  // Local row l is global row global_id(rank, l) = l * stride + offset.
  if (t.spec.partition == PartitionKind::kCyclic) {
    t.shard->attach(full_table, t.spec.num_shards, rank());
  } else {
    t.shard->attach(full_table, 1, t.part.global_id(rank(), 0));
  }
}

const float* Engine::attached_replica(int table) {
  Table& t = table_at(table);
  return t.shard ? t.shard->attached_base() : nullptr;
}

void Engine::write_local(int table, const int64_t* ids, int64_t n, const float* rows) {
  Table& t = table_at(table);
  if (!t.shard) return;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= t.spec.num_rows) {
      throw PSIndexError("table '" + t.spec.name + "': id " + std::to_string(ids[i]) + " is out of range [0, " +
                         std::to_string(t.spec.num_rows) + ")");
    }
    if (t.part.shard_of(ids[i]) != rank()) continue;
    std::memcpy(t.shard->row(t.part.local_index(ids[i])), rows + i * t.spec.dim, t.spec.dim * sizeof(float));
  }
}

void Engine::rename_table(int table, const std::string& name) { table_at(table).spec.name = name; }

void Engine::set_rule(int table, const std::string& rule, const std::map<std::string, double>& hparams) {
  Table& t = table_at(table);
  auto made = make_update_rule(rule, hparams);  // validates on every rank, shard or not
  t.spec.rule = rule;
  t.spec.hparams = hparams;
  if (t.shard) t.shard->set_rule(std::move(made));
}

void Engine::init_normal(int table, uint64_t seed, float mean, float stddev) {
  Table& t = table_at(table);
  if (!t.shard) return;
  const int64_t dim = t.spec.dim;
  const double two_pi = 6.283185307179586;
  for (int64_t l = 0; l < t.shard->rows(); ++l) {
    const uint64_t id = static_cast<uint64_t>(t.part.global_id(rank(), l));
    float* row = t.shard->row(l);
    for (int64_t j = 0; j < dim; ++j) {
      const uint64_t key = mix64(seed ^ mix64(id * static_cast<uint64_t>(dim) + static_cast<uint64_t>(j)));
      const double u1 = uniform01(key), u2 = uniform01(mix64(key));
      row[j] = mean + stddev * static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi * u2));
    }
  }
}

void Engine::init_uniform(int table, uint64_t seed, float low, float high) {
  Table& t = table_at(table);
  if (!t.shard) return;
  const int64_t dim = t.spec.dim;
  for (int64_t l = 0; l < t.shard->rows(); ++l) {
    const uint64_t id = static_cast<uint64_t>(t.part.global_id(rank(), l));
    float* row = t.shard->row(l);
    for (int64_t j = 0; j < dim; ++j) {
      const uint64_t key = mix64(seed ^ mix64(id * static_cast<uint64_t>(dim) + static_cast<uint64_t>(j)));
      row[j] = low + (high - low) * static_cast<float>(uniform01(key));
    }
  }
}

std::vector<float> Engine::gather(int table, int slot) {
  return guarded(broken_, broken_reason_, [&] {
    check_usable();
    drain_pending();
    Table& t = table_at(table);
    const int64_t dim = t.spec.dim;
    std::string error;
    if (t.shard && slot >= t.shard->num_slots()) {
      error = "table '" + t.spec.name + "': optimizer '" + t.spec.rule + "' has no state slot " + std::to_string(slot);
    }
    if (t.shard) {
      Writer w;
      w.text(error);
      if (error.empty()) {
        float* out = w.f32_slot(t.shard->rows() * dim);
        for (int64_t l = 0; l < t.shard->rows(); ++l) std::memcpy(out + l * dim, row_of(*t.shard, slot, l), dim * sizeof(float));
      }
      std::vector<char> payload = w.take();
      for (int d = 0; d < size(); ++d) transport_->send(d, kTagControl, payload);
    }
    std::vector<float> full(static_cast<size_t>(t.spec.num_rows * dim));
    std::string remote;
    for (int s = 0; s < t.spec.num_shards; ++s) {
      auto msg = transport_->recv(s, kTagControl);
      Reader r(msg);
      const std::string e = r.text();
      if (!e.empty()) {
        remote = e;
        continue;
      }
      const int64_t n = t.part.shard_rows(s);
      const float* rows = r.f32s(n * dim);
      for (int64_t l = 0; l < n; ++l) {
        std::memcpy(full.data() + t.part.global_id(s, l) * dim, rows + l * dim, dim * sizeof(float));
      }
    }
    transport_->wait_sends();
    if (!remote.empty()) throw PSError(remote);
    return full;
  });
}

void Engine::set_step(int table, int64_t step) {
  Table& t = table_at(table);
  if (t.shard) t.shard->rule().set_step(step);
}

int64_t Engine::step(int table) const {
  const Table& t = table_at(table);
  return t.shard ? t.shard->rule().step() : -1;
}

int64_t Engine::row_store_bytes() const {
  int64_t total = 0;
  for (const auto& t : tables_) total += t->shard ? t->shard->row_bytes() : 0;
  return total;
}

int64_t Engine::state_bytes() const {
  int64_t total = 0;
  for (const auto& t : tables_) total += t->shard ? t->shard->state_bytes() : 0;
  return total;
}

TrafficStats Engine::traffic() const {
  return TrafficStats{transport_->bytes_sent(), transport_->bytes_received(), transport_->messages_sent()};
}

void Engine::reset_traffic() { transport_->reset_counters(); }

}  // namespace hybridsync
