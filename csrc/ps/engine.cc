// The Engine: table registration and the operations on whole tables (initialisation,
// loading, gathering, replicas). The per-step pull and push live in exchange.cc.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>
#include <cstring>
#include <sstream>

#include "../transport/transport.h"
#include "engine_internal.h"
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
// Local row l of the rows (slot < 0) or of optimizer slot `slot`.
float* row_of(Shard& shard, int slot, int64_t l) {
  return slot < 0 ? shard.row(l) : shard.slot(slot) + l * shard.dim();
}

double uniform01(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) / 9007199254740992.0; }

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
    throw PSRemoteError("hybridsync " + std::string(op) + " failed on rank " + std::to_string(r) +
                        ": " + errors[r]);
  }
}

void check_rows(const Shard* shard, const std::string& table, const int64_t* local, int64_t n, const char* op) {
  if (n == 0) return;
  if (!shard) throw PSTransportError(std::string(op) + " for table '" + table + "' reached a rank without its shard");
  for (int64_t i = 0; i < n; ++i) {
    if (local[i] < 0 || local[i] >= shard->rows()) throw PSTransportError(std::string(op) + " for table '" + table + "': bad row index");
  }
}

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

std::vector<TraceEvent> Engine::take_trace() { return std::exchange(trace_, {}); }

void Engine::trace(const char* name, int64_t start_ns, int64_t rows) {
  if (tracing_) trace_.push_back(TraceEvent{name, start_ns, now_ns(), rows});
}

}  // namespace hybridsync
