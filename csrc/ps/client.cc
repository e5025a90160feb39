// The Client: construction and the serving thread, table registration, whole-table
// collectives (load_from_root, drop_table, barrier) and the local operations on this rank's
// shards. The per-step pull and push are in exchange.cc, one-sided reads and writes in access.cc,
// the server side in server.cc.
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <sstream>
#include <utility>

#include "../transport/wait.h"
#include "client_impl.h"
#include "seeded.h"

namespace hybridsync {

namespace {

std::string describe(const TableSpec& s) {
  std::ostringstream out;
  out << "'" << s.name << "' rows=" << s.num_rows << " dim=" << s.dim << " shards=" << s.num_shards
      << " partition=" << (s.partition == PartitionKind::kCyclic ? "cyclic" : "block") << " optimizer=" << s.rule;
  for (const auto& [k, v] : s.hparams) out << " " << k << "=" << v;
  const DynamicSpec& d = s.dynamic;
  if (d.on) {
    out << " dynamic(capacity=" << d.capacity << " admit_after=" << d.admit_after << " evict=" << d.evict
        << " ttl_steps=" << d.ttl_steps << " seed=" << d.seed << " init=" << d.init << "(" << d.init_a << ", "
        << d.init_b << "))";
  }
  const StorageSpec& st = s.storage;  // (not the path: each rank's own local disk)
  out << " storage(dtype=" << st.dtype << " rounding=" << st.rounding << " seed=" << st.seed
      << " memory_rows=" << st.memory_rows << " disk_rows=" << st.disk_rows << " disk=" << !st.path.empty() << ")";
  return out.str();
}

// What is wrong with a table's storage options ("" when nothing).
std::string storage_error(const TableSpec& s) {
  const StorageSpec& st = s.storage;
  const std::string at = "table '" + s.name + "': storage: ";
  RowType type;
  if (!parse_row_type(st.dtype, &type)) return at + "dtype must be float32, float16 or bfloat16, got '" + st.dtype + "'";
  if (st.rounding != "nearest" && st.rounding != "stochastic") {
    return at + "rounding must be nearest or stochastic, got '" + st.rounding + "'";
  }
  if (st.path.empty()) {
    if (st.memory_rows != 0) return at + "memory_rows needs a path (the directory of the disk tier holding the other rows)";
    if (st.disk_rows != 0) return at + "disk_rows needs a path (the directory of the disk tier)";
    return "";
  }
  if (st.memory_rows < s.num_shards) {
    return at + "memory_rows must be at least one row per shard (" + std::to_string(s.num_shards) + "), got " +
           std::to_string(st.memory_rows);
  }
  if (st.disk_rows < 0) return at + "disk_rows must be >= 1 (or none: unbounded), got " + std::to_string(st.disk_rows);
  if (!s.dynamic.on && st.disk_rows != 0) {
    return at + "disk_rows bounds a dynamic table's disk tier; a fixed table keeps every row (leave it out)";
  }
  if (s.dynamic.on && s.dynamic.capacity != 0) {
    return at + "a dynamic table with a disk tier is bounded by storage memory_rows (in memory) and disk_rows (on "
                "disk): leave its capacity out";
  }
  return "";
}

// What is wrong with a dynamic table's options ("" when nothing).
std::string dynamic_error(const TableSpec& s) {
  const DynamicSpec& d = s.dynamic;
  const std::string at = "dynamic table '" + s.name + "': ";
  if (d.capacity < 0) return at + "capacity must be >= 1 (or none: unbounded), got " + std::to_string(d.capacity);
  if (d.capacity > 0 && d.capacity < s.num_shards) {
    return at + "capacity " + std::to_string(d.capacity) + " is below one row per shard (" +
           std::to_string(s.num_shards) + " shards)";
  }
  if (d.admit_after < 1) return at + "admit_after must be >= 1, got " + std::to_string(d.admit_after);
  if (d.ttl_steps < 0) return at + "ttl_steps must be >= 1 (or none), got " + std::to_string(d.ttl_steps);
  if (d.evict != "none" && d.evict != "lru" && d.evict != "lfu") {
    return at + "evict must be none, 'lru' or 'lfu', got '" + d.evict + "'";
  }
  if (d.evict != "none" && d.capacity == 0 && s.storage.path.empty()) {
    return at + "evict='" + d.evict + "' needs a capacity (or a disk tier: storage path)";
  }
  if (d.init != "normal" && d.init != "uniform") return at + "initializer must be normal or uniform, got '" + d.init + "'";
  return "";
}

// A shard's share of a row bound over all shards (a dynamic table's capacity, a storage's
// memory_rows): total / shards, the first total % shards one more; 0 (unbounded) stays 0.
int64_t share_of(int64_t total, int shards, int shard) {
  if (total == 0) return 0;
  return total / shards + (shard < total % shards ? 1 : 0);
}

// A registered table and this rank's shard of it: rows in memory, or with a disk tier in an
// arena over it (TieredRows, or the dynamic store's own), stored as the storage's dtype says.
std::unique_ptr<Table> make_table(detail::ClientState& c, const TableSpec& spec, std::unique_ptr<UpdateRule> rule) {
  Partitioner part(spec.num_rows, spec.num_shards, spec.partition);
  auto t = std::make_unique<Table>(Table{spec, part, nullptr, RowAggregator(), false, RoundStats{}, BoundedState{},
                                         nullptr, nullptr, {}});
  const int rank = c.rank();
  if (rank >= spec.num_shards) return t;
  const StorageSpec& st = spec.storage;
  const RowType type = row_type_of(spec);
  const bool disk = !st.path.empty();
  const int64_t memory = disk ? share_of(st.memory_rows, spec.num_shards, rank) : 0;
  Rounding rounding;
  rounding.stochastic = st.rounding == "stochastic";
  rounding.seed = st.seed;
  if (spec.dynamic.on) {
    const int64_t share = disk ? share_of(st.disk_rows == 0 ? 0 : st.memory_rows + st.disk_rows, spec.num_shards, rank)
                               : share_of(spec.dynamic.capacity, spec.num_shards, rank);
    if (disk) {  // (the arena first: the disk's records are its rows with their slots)
      t->shard = std::make_unique<Shard>(spec.name, memory, spec.dim, std::move(rule), type);
      t->dynamic = std::make_unique<DynamicStore>(
          spec.name, spec.dynamic, share, spec.dim, memory,
          std::make_unique<DiskTier>(spec.name, st.path, rank, t->shard->record_size(), &c.tracer));
    } else {
      t->dynamic = std::make_unique<DynamicStore>(spec.name, spec.dynamic, share, spec.dim);
      t->shard = std::make_unique<Shard>(spec.name, t->dynamic->arena_rows(), spec.dim, std::move(rule), type);
    }
  } else if (disk) {
    rounding.id_offset = part.global_id(rank, 0);
    rounding.id_stride = part.shard_rows(rank) > 1 ? part.global_id(rank, 1) - rounding.id_offset : 1;
    t->shard = std::make_unique<Shard>(spec.name, std::max<int64_t>(1, memory), spec.dim, std::move(rule), type);
    t->tiered = std::make_unique<TieredRows>(
        part.shard_rows(rank), memory, rounding.id_stride, rounding.id_offset,
        std::make_unique<DiskTier>(spec.name, st.path, rank, t->shard->record_size(), &c.tracer));
  } else {
    rounding.id_offset = part.global_id(rank, 0);
    rounding.id_stride = part.shard_rows(rank) > 1 ? part.global_id(rank, 1) - rounding.id_offset : 1;
    t->shard = std::make_unique<Shard>(spec.name, part.shard_rows(rank), spec.dim, std::move(rule), type);
  }
  t->shard->set_rounding(rounding);
  return t;
}

void check_slot(const Table& t, int slot) {
  if (t.shard && slot >= t.shard->num_slots()) {
    throw PSError("table '" + t.spec.name + "': optimizer '" + t.spec.rule + "' has no state slot " + std::to_string(slot));
  }
}

// Fills this rank's shard from a seeded counter-based generator; a shard with a disk tier only
// remembers `init` (its rows take their values from it when they are first needed).
void init_rows(Table& t, int rank, const RowInit& init) {
  if (!t.shard) return;
  if (t.tiered) {
    t.tiered->reset(init);
    return;
  }
  const int64_t dim = t.spec.dim;
  std::vector<float> row(static_cast<size_t>(dim));
  for (int64_t l = 0; l < t.shard->rows(); ++l) {
    init.fill(static_cast<uint64_t>(t.part.global_id(rank, l)), dim, row.data());
    t.shard->set_row(l, row.data());
  }
}

// Rows of a fixed table's shard, in chunks: a shard with a disk tier holds one chunk in memory.
constexpr int64_t kLocalChunk = 65536;

// How long the serving thread sleeps when nothing came: short right after work (the next
// request of a burst is near), growing to a cap, so an idle rank costs about a thousand cheap
// polls a second and no core.
constexpr double kServeMinSleepUs = 20.0;
constexpr double kServeMaxSleepUs = 1000.0;

}  // namespace

void check_fixed(const Table& t, const char* op) {
  if (t.spec.dynamic.on) {
    throw PSError(std::string(op) + " needs a fixed row count: table '" + t.spec.name +
                  "' is dynamic (read its rows by id; save it with its dynamic state)");
  }
}

Table& detail::ClientState::table_at(int table) const {
  if (table < 0 || table >= static_cast<int>(tables.size())) {
    throw PSError("unknown PS table handle " + std::to_string(table));
  }
  Table& t = *tables[table];
  if (t.dropped) throw PSError("PS table '" + t.spec.name + "' was dropped (its variable left the parameter server)");
  return t;
}

void detail::ClientState::check_usable() const {
  if (broken) throw PSTransportError("hybridsync PS is unusable after an earlier failure: " + broken_reason);
}

void detail::ClientState::throw_errors(const std::vector<ErrorNote>& errors, int self, const char* op) {
  for (const ErrorNote& e : errors) {
    if (e.rank != self) continue;
    if (e.index_error) throw PSIndexError(e.message);
    throw PSError(e.message);
  }
  for (const ErrorNote& e : errors) {
    throw PSRemoteError("hybridsync " + (e.op.empty() ? std::string(op) : e.op) + " failed on rank " +
                        std::to_string(e.rank) + ": " + e.message);
  }
}

void detail::ClientState::send_request(int dest, std::vector<char> payload) {
  transport->send(dest, kTagRequest, std::move(payload));
}

int detail::ClientState::late_rank() const {
  bool waiting = false;
  for (const auto& queue : queues) waiting = waiting || !queue.empty();
  if (!waiting) return -1;
  for (int src = 0; src < size(); ++src) {
    if (queues[src].empty()) return src;
  }
  return -1;
}

void detail::ClientState::settle() {
  drive_until([&] { return queues[rank()].empty(); }, "this rank's earlier PS calls to be applied");
}

void detail::ClientState::serve_in_background() {
  double sleep_us = kServeMinSleepUs;
  while (!stopping.load()) {
    bool worked = false;
    {
      std::unique_lock<std::mutex> lock(mu, std::try_to_lock);
      if (lock.owns_lock() && !broken) {
        try {
          worked = progress();
        } catch (const std::exception&) {
          // fail() marked the engine broken and told the peers; the caller's next call throws.
        }
      }
    }
    if (worked) {
      sleep_us = kServeMinSleepUs;
      continue;
    }
    std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(sleep_us));
    sleep_us = std::min(sleep_us * 2.0, kServeMaxSleepUs);
  }
}

Client::Client(std::unique_ptr<detail::ClientState> state, bool serve_in_background) : impl_(std::move(state)) {
  detail::ClientState& c = *impl_;
  c.policy = c.transport->wait_policy();
  c.queues.resize(static_cast<size_t>(c.size()));
  c.deferred.resize(static_cast<size_t>(c.size()));
  if (serve_in_background && c.size() > 1) {
    c.serving = std::thread([&c] { c.serve_in_background(); });
    // Named here, before the engine is handed out, not by the thread itself (which may not have
    // run yet): findable in /proc/<pid>/task (its CPU time) as soon as the engine exists.
    pthread_setname_np(c.serving.native_handle(), "hybridsync-ps");
  }
}

Client::~Client() { close(); }

void Client::close() {
  impl_->stopping = true;
  if (impl_->serving.joinable()) impl_->serving.join();
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->broken) {
    impl_->broken = true;
    impl_->broken_reason = "the engine was closed (hybridsync.shutdown())";
  }
  // The shards go with the engine -- their memory, and their disk tiers' files, which their
  // destructors remove -- even while Python still holds the tables' objects (every later use
  // of one throws: the engine is closed).
  for (auto& table : impl_->tables) {
    if (table) {
      table->tiered.reset();
      table->dynamic.reset();
      table->shard.reset();
    }
  }
}

std::unique_ptr<Client> make_client(const std::string& transport, void* native, const WaitPolicy& wait,
                                    int64_t max_message_bytes, bool serve_in_background) {
  auto state = std::make_unique<detail::ClientState>();
  state->transport = make_transport(transport, TransportConfig{native, wait, max_message_bytes});
  return std::unique_ptr<Client>(new Client(std::move(state), serve_in_background));
}

bool Client::usable() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return !impl_->broken;
}

int Client::rank() const { return impl_->rank(); }
int Client::size() const { return impl_->size(); }

TableSpec Client::spec(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->table_at(table).spec;
}

int Client::add_table(const TableSpec& given, const std::string& given_error) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  TableSpec spec = given;
  if (spec.num_shards == 0) spec.num_shards = c.size();
  std::string error = given_error;
  if (!error.empty()) {
    error = "table '" + spec.name + "': " + error;
  } else if (spec.num_shards < 1 || spec.num_shards > c.size()) {
    error = "table '" + spec.name + "': partitions must be in [1, " + std::to_string(c.size()) +
            "] (the world size), got " + std::to_string(spec.num_shards);
  } else if (spec.dynamic.on) {
    spec.num_rows = -1;
    spec.partition = PartitionKind::kHash;
    if (spec.dim < 1) error = "dynamic table '" + spec.name + "': embedding_dim must be >= 1, got " + std::to_string(spec.dim);
    if (error.empty()) error = dynamic_error(spec);
  } else if (spec.num_rows < 0 || spec.dim < 1) {
    error = "table '" + spec.name + "': shape (" + std::to_string(spec.num_rows) + ", " + std::to_string(spec.dim) +
            ") is not a valid (rows, dim)";
  }
  if (error.empty()) error = storage_error(spec);
  std::unique_ptr<UpdateRule> rule;
  if (error.empty()) {
    try {
      rule = make_update_rule(spec.rule, spec.hparams);
    } catch (const PSError& e) {
      error = "table '" + spec.name + "': " + e.what();
    }
  }
  const int64_t seq = c.next_seq();
  if (error.empty()) {
    try {
      c.adding = make_table(c, spec, std::move(rule));
    } catch (const PSError& e) {  // (a disk tier whose directory or file cannot be made)
      error = e.what();
    }
  }
  for (int d = 0; d < c.size(); ++d) {
    if (!error.empty()) {
      c.send_request(d, error_request(RequestKind::kAddTable, seq, error, false));
      continue;
    }
    Writer w = request_writer(RequestKind::kAddTable, seq);
    w.text(describe(spec));
    c.send_request(d, w.take());
  }
  c.collect_replies(RequestKind::kAddTable, seq, "add_table", [](int, Reader&) {});
  return static_cast<int>(c.tables.size()) - 1;
}

void Client::barrier(const std::string& what) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  const int64_t seq = c.next_seq();
  for (int d = 0; d < c.size(); ++d) {
    Writer w = request_writer(RequestKind::kBarrier, seq);
    w.text(what);
    c.send_request(d, w.take());
  }
  c.collect_replies(RequestKind::kBarrier, seq, what.c_str(), [](int, Reader&) {});
}

void Client::rescale_accumulators(const std::vector<int>& tables, double factor) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  std::string error;
  if (!(std::isfinite(factor) && factor > 0.0)) {
    error = "rescale_accumulators: factor must be finite and > 0, got " + std::to_string(factor);
  }
  for (const int table : tables) {
    if (!error.empty()) break;
    try {
      c.table_at(table);
    } catch (const PSError& e) {
      error = std::string("rescale_accumulators: ") + e.what();
    }
  }
  const int64_t seq = c.next_seq();
  for (int d = 0; d < c.size(); ++d) {
    if (!error.empty()) {
      c.send_request(d, error_request(RequestKind::kRescaleAccumulators, seq, error, false));
      continue;
    }
    Writer w = request_writer(RequestKind::kRescaleAccumulators, seq);
    w.f64(factor);
    w.i64(static_cast<int64_t>(tables.size()));
    for (const int table : tables) w.i64(table);
    c.send_request(d, w.take());
  }
  c.collect_replies(RequestKind::kRescaleAccumulators, seq, "rescale_accumulators", [](int, Reader&) {});
}

void Client::drop_table(int table) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  c.table_at(table);  // an unknown or already dropped handle throws on every rank, before anything moves
  const int64_t seq = c.next_seq();
  for (int d = 0; d < c.size(); ++d) {
    Writer w = request_writer(RequestKind::kDropTable, seq);
    w.i64(table);
    c.send_request(d, w.take());
  }
  c.collect_replies(RequestKind::kDropTable, seq, "drop_table", [](int, Reader&) {});
}

void Client::join_begin() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  c.join_seq = c.next_seq();
  for (int d = 0; d < c.size(); ++d) c.send_request(d, request_writer(RequestKind::kJoin, c.join_seq).take());
}

void Client::join_finish() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  int64_t newest = c.join_seq;
  c.collect_replies(RequestKind::kJoin, c.join_seq, "join", [&](int, Reader& r) { newest = std::max(newest, r.i64()); });
  c.last_seq = newest;  // the ranks that joined later made more calls: every rank counts on from the same number
}

void Client::load_local(int table, int slot, const float* values) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  Table& t = impl_->table_at(table);
  check_fixed(t, "load_local");
  if (!t.shard) return;
  check_slot(t, slot);
  const int64_t dim = t.spec.dim, rows = rows_held(t);
  std::vector<int64_t> local;
  std::vector<float> chunk;
  for (int64_t begin = 0; begin < rows; begin += kLocalChunk) {
    const int64_t count = std::min(kLocalChunk, rows - begin);
    local.resize(static_cast<size_t>(count));
    chunk.resize(static_cast<size_t>(count * dim));
    for (int64_t k = 0; k < count; ++k) {
      local[static_cast<size_t>(k)] = begin + k;
      std::memcpy(chunk.data() + k * dim, values + t.part.global_id(impl_->rank(), begin + k) * dim, dim * sizeof(float));
    }
    scatter_rows(t, local.data(), count, chunk.data(), slot);
  }
}

void Client::attach_replica(int table, float* full_table) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  Table& t = impl_->table_at(table);
  check_fixed(t, "a replica");
  if (full_table && (t.tiered || row_type_of(t.spec) != RowType::kFloat32)) {
    throw PSError("table '" + t.spec.name + "' has storage (" + t.spec.storage.dtype + " rows" +
                  (t.tiered ? ", a disk tier" : "") + "): it cannot be replicated (use placement: sharded)");
  }
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
  impl_->check_usable();
  impl_->settle();
  Table& t = impl_->table_at(table);
  check_fixed(t, "write_local");
  check_ids(t.spec.name, ids, n, t.spec.num_rows);
  check_slot(t, slot);
  if (!t.shard) return;
  // A few rows at a time (a disk tier holds them in memory; an elastic restore writes a whole
  // shard, which must not be copied once more: a small chunk keeps the copy small).
  constexpr int64_t kWriteChunk = 4096;
  const int64_t dim = t.spec.dim;
  std::vector<int64_t> local;
  std::vector<float> mine;
  local.reserve(static_cast<size_t>(std::min<int64_t>(n, kWriteChunk)));
  mine.reserve(local.capacity() * static_cast<size_t>(dim));
  for (int64_t i = 0; i < n; ++i) {
    if (t.part.shard_of(ids[i]) != impl_->rank()) continue;
    local.push_back(t.part.local_index(ids[i]));
    mine.insert(mine.end(), rows + i * dim, rows + (i + 1) * dim);
    if (static_cast<int64_t>(local.size()) == kWriteChunk) {
      scatter_rows(t, local.data(), kWriteChunk, mine.data(), slot);
      local.clear();
      mine.clear();
    }
  }
  if (!local.empty()) scatter_rows(t, local.data(), static_cast<int64_t>(local.size()), mine.data(), slot);
}

std::vector<float> Client::local_values(int table, int slot) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  Table& t = impl_->table_at(table);
  check_fixed(t, "local_values");
  check_slot(t, slot);
  if (!t.shard) return {};
  const int64_t dim = t.spec.dim, rows = rows_held(t);
  std::vector<float> out(static_cast<size_t>(rows * dim));
  std::vector<int64_t> local;
  for (int64_t begin = 0; begin < rows; begin += kLocalChunk) {
    const int64_t count = std::min(kLocalChunk, rows - begin);
    local.resize(static_cast<size_t>(count));
    for (int64_t k = 0; k < count; ++k) local[static_cast<size_t>(k)] = begin + k;
    gather_rows(t, local.data(), count, out.data() + begin * dim, slot);
  }
  return out;
}

std::vector<int64_t> Client::written_rows(int table, bool memory) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  const Table& t = impl_->table_at(table);
  if (!t.tiered) throw PSError("table '" + t.spec.name + "' has no disk tier (written_rows lists a tier's rows)");
  std::vector<int64_t> local = memory ? t.tiered->written_in_memory() : t.tiered->on_disk();
  std::sort(local.begin(), local.end());
  for (int64_t& l : local) l = t.part.global_id(impl_->rank(), l);
  return local;
}

void Client::local_rows(int table, int slot, const int64_t* ids, int64_t n, float* out) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  const Table& t = impl_->table_at(table);
  check_fixed(t, "local_rows");
  check_ids(t.spec.name, ids, n, t.spec.num_rows);
  check_slot(t, slot);
  std::vector<int64_t> local(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (t.part.shard_of(ids[i]) != impl_->rank()) {
      throw PSError("table '" + t.spec.name + "': row " + std::to_string(ids[i]) + " is not in this rank's shard");
    }
    local[static_cast<size_t>(i)] = t.part.local_index(ids[i]);
  }
  if (n) gather_rows(t, local.data(), n, out, slot);
}

TierStats Client::tier_stats(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  const Table& t = impl_->table_at(table);
  TierStats s;
  s.dtype = t.spec.storage.dtype;
  if (!t.shard) return s;
  s.steps = t.shard->rule().step();
  const DiskTier* disk = nullptr;
  if (t.tiered) {
    disk = &t.tiered->disk();
    s.memory_rows = t.tiered->resident();
    s.memory_share = t.tiered->arena_rows();
    s.hits = t.tiered->hits();
    s.loads = t.tiered->loads();
  } else if (t.dynamic) {
    disk = t.dynamic->disk();
    s.memory_rows = t.dynamic->resident();
    s.memory_share = disk ? share_of(t.spec.storage.memory_rows, t.spec.num_shards, impl_->rank()) : 0;
    s.hits = t.dynamic->hits();
    s.loads = t.dynamic->loads();
  } else {
    s.memory_rows = t.shard->rows();
  }
  if (disk) {
    s.path = disk->path();
    s.disk_rows = disk->size();
    s.bytes_read = disk->bytes_read();
    s.bytes_written = disk->bytes_written();
  }
  return s;
}

void Client::rename_table(int table, const std::string& name) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Table& t = impl_->table_at(table);
  t.spec.name = name;
  if (t.shard) t.shard->rename(name);
  if (t.tiered) t.tiered->disk().rename(name);
  if (t.dynamic) t.dynamic->rename(name);
}

void Client::set_rule(int table, const std::string& rule, const std::map<std::string, double>& hparams) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  Table& t = impl_->table_at(table);
  auto made = make_update_rule(rule, hparams);  // validates on every rank, shard or not
  t.spec.rule = rule;
  t.spec.hparams = hparams;
  if (!t.shard) return;
  t.shard->set_rule(std::move(made));
  if (t.tiered) t.tiered->new_rule(*t.shard);  // rows on disk get the new rule's fresh slots too
  if (t.dynamic) t.dynamic->new_rule(*t.shard);
}

void Client::init_normal(int table, uint64_t seed, float mean, float stddev) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  check_fixed(impl_->table_at(table), "init_normal");
  init_rows(impl_->table_at(table), impl_->rank(), RowInit{RowInit::Kind::kNormal, seed, mean, stddev});
}

void Client::init_uniform(int table, uint64_t seed, float low, float high) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  check_fixed(impl_->table_at(table), "init_uniform");
  init_rows(impl_->table_at(table), impl_->rank(), RowInit{RowInit::Kind::kUniform, seed, low, high});
}

RowInitSpec Client::row_init(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  const Table& t = impl_->table_at(table);
  if (!t.tiered) throw PSError("table '" + t.spec.name + "' has no disk tier (only a tier remembers its initializer)");
  const RowInit& init = t.tiered->init();
  static const char* const kinds[] = {"zeros", "normal", "uniform"};
  return RowInitSpec{kinds[static_cast<int>(init.kind)], init.seed, init.a, init.b};
}

void Client::reset_rows(int table, const RowInitSpec& spec) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  Table& t = impl_->table_at(table);
  check_fixed(t, "reset_rows");
  RowInit init{RowInit::Kind::kZeros, spec.seed, static_cast<float>(spec.a), static_cast<float>(spec.b)};
  if (spec.kind == "normal") {
    init.kind = RowInit::Kind::kNormal;
  } else if (spec.kind == "uniform") {
    init.kind = RowInit::Kind::kUniform;
  } else if (spec.kind != "zeros") {
    throw PSError("table '" + t.spec.name + "': unknown initializer kind '" + spec.kind +
                  "' (expected zeros, normal or uniform)");
  }
  init_rows(t, impl_->rank(), init);
  if (t.shard && !t.tiered) {  // (a tier's reset gives every row fresh slots already)
    for (int64_t l = 0; l < t.shard->rows(); ++l) t.shard->reset_slots(l);
  }
}

void Client::set_step(int table, int64_t step) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  Table& t = impl_->table_at(table);
  if (t.shard) t.shard->rule().set_step(step);
}

int64_t Client::step(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
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
  if (t.dynamic) return t.dynamic->stored();
  return rows_held(t);
}

DynamicState Client::dynamic_state(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  const Table& t = impl_->table_at(table);
  if (!t.spec.dynamic.on) throw PSError("table '" + t.spec.name + "' is not dynamic");
  if (!t.dynamic) return DynamicState{t.spec.dim, {}, {}, {}, {}, {}, {}, {}, {}};
  t.dynamic->drop_released();  // (the state walks the disk's entries)
  return t.dynamic->state(*t.shard);
}

DynamicState Client::dynamic_range(int table, bool pending, int64_t begin, int64_t n, bool rows) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  const Table& t = impl_->table_at(table);
  if (!t.spec.dynamic.on) throw PSError("table '" + t.spec.name + "' is not dynamic");
  const int64_t size = t.dynamic ? (pending ? t.dynamic->pending() : t.dynamic->stored()) : 0;
  if (begin < 0 || n < 0 || begin + n > size) {
    throw PSError("table '" + t.spec.name + "': entries [" + std::to_string(begin) + ", " + std::to_string(begin + n) +
                  ") are outside this shard's " + std::to_string(size) + (pending ? " pending ids" : " stored rows"));
  }
  if (!t.dynamic) return DynamicState{t.spec.dim, {}, {}, {}, {}, {}, {}, {}, {}};
  t.dynamic->drop_released();  // (the range walks the disk's entries)
  return t.dynamic->range(*t.shard, pending, begin, n, rows && !pending, rows && !pending);
}

void Client::dynamic_restore(int table, const DynamicState& state) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  Table& t = impl_->table_at(table);
  if (!t.spec.dynamic.on) throw PSError("table '" + t.spec.name + "' is not dynamic");
  const size_t n = state.ids.size(), floats = n * static_cast<size_t>(state.dim);
  bool ok = state.counts.size() == n && state.last_touch.size() == n && state.rows.size() == floats &&
            state.pending_counts.size() == state.pending_ids.size() &&
            state.pending_last.size() == state.pending_ids.size();
  for (const auto& s : state.slots) ok = ok && s.size() == floats;
  if (!ok) throw PSError("table '" + t.spec.name + "': inconsistent dynamic table state (array lengths differ)");
  if (!t.dynamic) return;
  const int rank = impl_->rank();
  const Partitioner& part = t.part;
  t.dynamic->restore(t.shard, state, [&](int64_t id) { return part.shard_of(id) == rank; });
}

void Client::dynamic_clear(int table) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  Table& t = impl_->table_at(table);
  if (!t.spec.dynamic.on) throw PSError("table '" + t.spec.name + "' is not dynamic");
  if (t.dynamic) t.dynamic->clear();
}

DynamicStats Client::dynamic_stats(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->check_usable();
  impl_->settle();
  const Table& t = impl_->table_at(table);
  if (!t.spec.dynamic.on) throw PSError("table '" + t.spec.name + "' is not dynamic");
  return t.dynamic ? t.dynamic->stats(*t.shard) : DynamicStats{};
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

RoundStats Client::round_stats(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->table_at(table);
  auto it = impl_->stats.done.find(table);
  return it == impl_->stats.done.end() ? RoundStats{} : it->second;
}

void Client::set_gradient_statistics(int table, bool on) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->table_at(table).sums.set_statistics(on);
}

TrafficStats Client::traffic() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Transport& tr = *impl_->transport;
  return TrafficStats{tr.bytes_sent(), tr.bytes_received(), tr.messages_sent(), tr.largest_message_sent()};
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
