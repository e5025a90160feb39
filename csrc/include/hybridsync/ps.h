// hybridsync parameter server: the public C++ surface.
//
// A table (int64 id -> float32 row of `dim` values) is split across shards by a Partitioner.
// Every rank is both a worker and a server: a Client on each rank holds that rank's shards and
// runs collective operations (pull, push) over a Transport. Nothing here knows about torch or
// TensorFlow; adapters hand in contiguous buffers. Internals (deduplication, push rounds,
// tracing, wire format) live in private headers under csrc/ps/.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace hybridsync {

// Bad input from the caller (unknown hyper-parameter, shape or dtype mismatch); -> ValueError.
class PSError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An id outside [0, num_rows) of its table; -> IndexError.
class PSIndexError : public PSError {
 public:
  using PSError::PSError;
};

// A peer reported bad input in a collective operation (every rank throws); -> RuntimeError.
class PSRemoteError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The transport failed or ranks disagreed on the protocol (timeout, a dead peer, mismatched
// operations). The Client is unusable afterwards; -> RuntimeError.
class PSTransportError : public PSRemoteError {
 public:
  using PSRemoteError::PSRemoteError;
};

// How ids are spread over shards. kCyclic (id mod shards) keeps hot small ids apart;
// kBlock gives each shard one contiguous range.
enum class PartitionKind : int { kBlock = 0, kCyclic = 1 };

// Maps a global row id to (shard, local index) and back. Mirrored by hybridsync/partition.py.
class Partitioner {
 public:
  Partitioner(int64_t num_rows, int num_shards, PartitionKind kind);
  // Shard that owns `id` (id must be in range).
  int shard_of(int64_t id) const;
  // Position of `id` within its shard's row store.
  int64_t local_index(int64_t id) const;
  // Inverse of (shard_of, local_index).
  int64_t global_id(int shard, int64_t local) const;
  // Number of rows shard `shard` stores.
  int64_t shard_rows(int shard) const;
  int64_t num_rows() const { return num_rows_; }
  int num_shards() const { return num_shards_; }
  PartitionKind kind() const { return kind_; }

 private:
  int64_t num_rows_;
  int num_shards_;
  PartitionKind kind_;
  int64_t block_;  // rows per shard for kBlock (last shard may hold fewer)
};

// A server-side optimizer for one table shard. Rules keep per-row state slots (each `dim`
// floats, e.g. Adagrad's accumulator) next to the rows; scalars (hyper-parameters, the step)
// live here. begin_step() runs once per push round and precomputes what apply() needs.
class UpdateRule {
 public:
  explicit UpdateRule(std::map<std::string, double> hparams) : hp_(std::move(hparams)) {}
  virtual ~UpdateRule() = default;
  // Canonical name, as registered ("sgd", "adagrad", "adam", ...).
  virtual std::string name() const = 0;
  // Names of the per-row state slots, in storage order.
  virtual std::vector<std::string> slot_names() const = 0;
  // Initial value of every element of slot `slot`.
  virtual float slot_init(int slot) const { (void)slot; return 0.0f; }
  // Advances the step counter and refreshes per-step constants.
  virtual void begin_step() { ++step_; }
  // Updates one row in place from its aggregated gradient; `slots[k]` points at slot k's row.
  virtual void apply(float* row, float* const* slots, const float* grad, int64_t dim) const = 0;
  // Throws PSError naming the first out-of-range hyper-parameter.
  virtual void validate() const = 0;
  const std::map<std::string, double>& hyperparameters() const { return hp_; }
  // Changes one hyper-parameter (e.g. "lr" from an LR schedule); unknown names throw.
  void set_hyperparameter(const std::string& key, double value);
  int64_t step() const { return step_; }
  void set_step(int64_t step) { step_ = step; }

 protected:
  std::map<std::string, double> hp_;
  int64_t step_ = 0;
};

// Makes a rule from its hyper-parameters (throws PSError naming unknown keys or bad values).
using UpdateRuleFactory = std::function<std::unique_ptr<UpdateRule>(const std::map<std::string, double>&)>;
// Adds a rule under `name`; each rule's own .cc file registers itself with a static
// UpdateRuleRegistrar, so a new rule is one file.
void register_update_rule(const std::string& name, UpdateRuleFactory factory);
struct UpdateRuleRegistrar {
  UpdateRuleRegistrar(const char* name, UpdateRuleFactory factory) { register_update_rule(name, std::move(factory)); }
};
// Builds the registered rule `name`; unknown names or keys throw PSError.
std::unique_ptr<UpdateRule> make_update_rule(const std::string& name, const std::map<std::string, double>& hparams);
// Registered rule names, sorted.
std::vector<std::string> update_rule_names();

// The rows of one table held by this rank, with their optimizer state. Not thread-safe on its
// own (the Client serialises access). Rows are owned, or alias rows of a caller's full-table
// buffer (replicated placement: local row l lives at base + (l * stride + offset) * dim).
class Shard {
 public:
  Shard(std::string table, int64_t rows, int64_t dim, std::unique_ptr<UpdateRule> rule);
  const std::string& table() const { return table_; }
  void rename(std::string table) { table_ = std::move(table); }
  int64_t rows() const { return rows_; }
  int64_t dim() const { return dim_; }
  UpdateRule& rule() { return *rule_; }
  const UpdateRule& rule() const { return *rule_; }
  // Address of local row l.
  float* row(int64_t l) { return base_ + (l * stride_ + offset_) * dim_; }
  const float* row(int64_t l) const { return base_ + (l * stride_ + offset_) * dim_; }
  // Copies rows `local[i]` into out[i*dim...]; indices must be in range.
  void gather(const int64_t* local, int64_t n, float* out) const;
  // Overwrites rows `local[i]` with values[i*dim...].
  void scatter(const int64_t* local, int64_t n, const float* values);
  // One optimizer step: rows `local[i]` (unique) get gradient grads[i*dim...].
  void apply(const int64_t* local, int64_t n, const float* grads);
  // Replaces the optimizer; its state slots start fresh.
  void set_rule(std::unique_ptr<UpdateRule> rule);
  // Uses the caller's memory for the rows (which must outlive the attachment); detach()
  // copies them back into owned memory.
  void attach(float* base, int64_t stride, int64_t offset);
  void detach();
  bool attached() const { return owned_.empty() && rows_ > 0; }
  float* slot(int k) { return slots_[k].data(); }
  const float* slot(int k) const { return slots_[k].data(); }
  int num_slots() const { return static_cast<int>(slots_.size()); }
  // Bytes held by the rows (0 when attached), and by the optimizer state slots.
  int64_t row_bytes() const;
  int64_t state_bytes() const;

 private:
  std::string table_;
  int64_t rows_, dim_;
  std::unique_ptr<UpdateRule> rule_;
  std::vector<float> owned_;
  float* base_ = nullptr;
  int64_t stride_ = 1, offset_ = 0;
  std::vector<std::vector<float>> slots_;
};

// Point-to-point messaging used by the Client; made by name (see transport/transport.h).
class Transport;
// One timed piece of server-side work (see ps/trace.h).
struct TraceEvent;

// Description of a table registered with a Client.
struct TableSpec {
  std::string name;
  int64_t num_rows = 0;
  int64_t dim = 0;
  int num_shards = 0;  // ranks 0..num_shards-1 hold a shard; 0 means every rank
  PartitionKind partition = PartitionKind::kCyclic;
  std::string rule = "sgd";
  std::map<std::string, double> hparams;
};

// Per-table input of a pull or push.
struct TableBatch {
  int table = -1;
  const int64_t* ids = nullptr;
  int64_t n = 0;
  const float* grads = nullptr;  // push only: n x dim
  double lr = -1.0;              // push only: learning rate for this round (< 0: unchanged)
};

// Per-table result of a pull: rows of the unique ids and where each input id went.
struct PullResult {
  std::vector<int64_t> unique;
  std::vector<int64_t> inverse;
  std::vector<float> rows;  // unique.size() x dim
};

// Rows changed by a push, for ranks that keep a replica of the table.
struct RowUpdates {
  std::vector<int64_t> ids;
  std::vector<float> rows;  // ids.size() x dim
};

// What Wait() returns: per batch, pulled rows (a pull) or changed rows (a push that asked).
struct Completion {
  std::vector<PullResult> pulled;
  std::vector<RowUpdates> updates;
};

// Traffic counters of this rank (payload bytes, headers included).
struct TrafficStats {
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t messages_sent = 0;
};

// One rank's side of the parameter server: its shards of every table, and the collective
// operations. Every rank calls the collective methods in the same order with the same tables.
// Local bad input (`error` non-empty, or an id out of range) is announced to every peer inside
// the operation, so all ranks throw instead of one rank leaving the others waiting. Every
// method is safe to call from several threads (one operation runs at a time).
class Client {
 public:
  explicit Client(std::unique_ptr<Transport> transport);
  ~Client();
  int rank() const;
  int size() const;

  // Collective. Registers a table (same specs, same order on every rank; a mismatch, or
  // `error` on any rank, throws on every rank naming the table). Returns its handle.
  int add_table(const TableSpec& spec, const std::string& error = "");
  int num_tables() const;
  TableSpec spec(int table) const;
  Partitioner partitioner(int table) const;

  // A started collective operation.
  using Handle = int64_t;
  // Collective. Starts a pull of the rows of each batch's ids (deduplicated per table): the
  // requests leave now; Wait() serves the peers and collects the rows.
  Handle Pull(const std::vector<TableBatch>& batches, const std::string& error = "");
  // Collective. Starts a push of each batch's (id, gradient) rows to their shards; each shard
  // sums them over ranks, multiplies by `scale` and applies its rule once per row. With
  // `return_updates`, Wait() applies and returns every row any shard changed (for replicas);
  // otherwise the shards apply it at the start of the next operation.
  Handle Push(const std::vector<TableBatch>& batches, float scale, bool return_updates = false,
              const std::string& error = "");
  // Completes `handle` and every operation started before it; throws what the operation met.
  Completion Wait(Handle handle);
  // Pull and Wait.
  std::vector<PullResult> pull(const std::vector<TableBatch>& batches, const std::string& error = "");
  // Push and Wait.
  std::vector<RowUpdates> push(const std::vector<TableBatch>& batches, float scale, bool return_updates = false,
                               const std::string& error = "");
  // Collective. Applies any push still pending.
  void flush();

  // Collective. Rank `root`'s full table (num_rows x dim) becomes every shard's rows; `error`
  // (root only) makes every rank throw instead.
  void load_from_root(int table, const float* values, int root, const std::string& error = "");
  // Collective. The full table (slot < 0) or optimizer slot on every rank.
  std::vector<float> gather(int table, int slot);
  // Local, for a world of one rank (every row is here): rows of ids into out[i*dim...].
  void lookup_local(int table, const int64_t* ids, int64_t n, float* out);
  // Local. Each shard copies its rows (slot < 0) or slot `slot` from a full-table array.
  void load_local(int table, int slot, const float* values);
  // Local. The shard's rows alias `full_table` (num_rows x dim, identical on every rank) from
  // now on; nullptr copies them back into memory the shard owns.
  void attach_replica(int table, float* full_table);
  // Local. Writes the rows among `ids` that this rank's shard holds; other ids are skipped.
  void write_local(int table, const int64_t* ids, int64_t n, const float* rows);
  // Local. The name errors use for `table` (e.g. its path in the model, known after creation).
  void rename_table(int table, const std::string& name);
  // Local. Replaces the server optimizer of this rank's shard of `table` (state restarts).
  void set_rule(int table, const std::string& rule, const std::map<std::string, double>& hparams);
  // Local. Seeded rows that do not depend on the number of shards.
  void init_normal(int table, uint64_t seed, float mean, float stddev);
  void init_uniform(int table, uint64_t seed, float low, float high);
  // Local. The step counter of this rank's shard of `table` (-1 when it holds none).
  void set_step(int table, int64_t step);
  int64_t step(int table) const;
  // Local. The server optimizer's slot names and current hyper-parameters for `table`.
  std::vector<std::string> slot_names(int table) const;
  std::map<std::string, double> hyperparameters(int table) const;
  // Local. Rows of `table` this rank's shard holds (0 without one).
  int64_t shard_rows(int table) const;
  // Bytes of rows, and of optimizer state, held by this rank's shards.
  int64_t row_store_bytes() const;
  int64_t state_bytes() const;
  TrafficStats traffic() const;
  void reset_traffic();
  // Records server-side work (applying pushes, serving pulls) for take_trace() while on.
  void set_tracing(bool on);
  std::vector<TraceEvent> take_trace();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hybridsync
