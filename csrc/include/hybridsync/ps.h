// hybridsync parameter server, public C++ surface. A table (int64 id -> float32 row of `dim`)
// is split over shards by a Partitioner; a Client on every rank holds that rank's shards and
// runs the collective operations over a Transport. No torch or TensorFlow here: adapters hand
// in contiguous buffers. Internals (dedup, routing, push rounds, wire, tracing) are in csrc/ps/.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace hybridsync {

// Bad input from the caller (unknown hyper-parameter, shape or dtype mismatch); -> ValueError.
struct PSError : std::runtime_error { using std::runtime_error::runtime_error; };
// An id outside [0, num_rows) of its table; -> IndexError.
struct PSIndexError : PSError { using PSError::PSError; };
// A peer reported bad input in a collective operation (every rank throws); -> RuntimeError.
struct PSRemoteError : std::runtime_error { using std::runtime_error::runtime_error; };
// The transport failed or ranks disagreed on the protocol: the Client is unusable afterwards.
struct PSTransportError : PSRemoteError { using PSRemoteError::PSRemoteError; };

// kCyclic (id mod shards) keeps hot small ids apart; kBlock gives each shard one range.
enum class PartitionKind : int { kBlock = 0, kCyclic = 1 };

// Maps a global row id to (shard, local index) and back; mirrored by hybridsync/partition.py.
class Partitioner {
 public:
  Partitioner(int64_t num_rows, int num_shards, PartitionKind kind);
  // Shard owning `id`, its position in that shard, and the inverse (ids must be in range).
  int shard_of(int64_t id) const;
  int64_t local_index(int64_t id) const;
  int64_t global_id(int shard, int64_t local) const;
  // Rows shard `shard` stores.
  int64_t shard_rows(int shard) const;
  int64_t num_rows() const { return num_rows_; }

 private:
  int64_t num_rows_;
  int num_shards_;
  PartitionKind kind_;
  int64_t block_;  // rows per shard for kBlock (the last shard may hold fewer)
};

// A server-side optimizer for one shard: per-row state lives in the shard's slots, scalars
// here. begin_step() runs once per push round, so apply(), the per-row loop, reads constants.
class UpdateRule {
 public:
  explicit UpdateRule(std::map<std::string, double> hparams) : hp_(std::move(hparams)) {}
  virtual ~UpdateRule() = default;
  // The registered name (specs and errors show it).
  virtual std::string name() const = 0;
  // Per-row state slots (each `dim` floats), in storage order, and their initial value.
  virtual std::vector<std::string> slot_names() const = 0;
  virtual float slot_init(int) const { return 0.0f; }
  // Advances the step counter and refreshes per-step constants.
  virtual void begin_step() { ++step_; }
  // Updates one row in place from its summed gradient; slots[k] points at slot k's row.
  virtual void apply(float* row, float* const* slots, const float* grad, int64_t dim) const = 0;
  // Throws PSError naming the first out-of-range hyper-parameter.
  virtual void validate() const = 0;
  const std::map<std::string, double>& hyperparameters() const { return hp_; }
  // Changes one hyper-parameter (e.g. "lr" from a schedule); a bad name or value throws.
  void set_hyperparameter(const std::string& key, double value);
  // Steps taken (bias corrections and decays use it); settable for checkpoint restores.
  int64_t step() const { return step_; }
  void set_step(int64_t step) { step_ = step; }

 protected:
  std::map<std::string, double> hp_;
  int64_t step_ = 0;
};

// The rule registered as `name` (each rule's .cc registers itself); PSError lists known names.
std::unique_ptr<UpdateRule> make_update_rule(const std::string& name, const std::map<std::string, double>& hparams);

// Memory that reads as zeros and costs nothing until written: blocks of 1 MiB and more come
// straight from mmap (untouched pages, huge ones where granted), smaller ones from calloc. Default construction writes
// nothing, so a fresh vector<T, ZeroPages<T>>(n) holds n zeros and no resident memory yet: a
// shard's rows become resident as they are written (a table being loaded from a whole copy
// does not hold the shard and the copy at once). Only fresh allocations are zero: grow such a
// vector with resize() only from empty.
template <class T>
struct ZeroPages {
  using value_type = T;
  static constexpr size_t kMmapBytes = size_t{1} << 20;
  ZeroPages() = default;
  template <class U>
  ZeroPages(const ZeroPages<U>&) noexcept {}
  T* allocate(size_t n);
  void deallocate(T* p, size_t n) noexcept;
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <class U>
  void construct(U*) noexcept {}  // the zeros are already there
  template <class U>
  bool operator==(const ZeroPages<U>&) const noexcept { return true; }
  template <class U>
  bool operator!=(const ZeroPages<U>&) const noexcept { return false; }
};

// One table's rows held by this rank, with their optimizer state; the Client serialises access.
// Rows are owned, or alias a caller's full-table buffer (row l at base + (l*stride + offset)*dim).
class Shard {
 public:
  Shard(std::string table, int64_t rows, int64_t dim, std::unique_ptr<UpdateRule> rule);
  // The table's name, for errors (known only after the model is built).
  const std::string& table() const { return table_; }
  void rename(std::string table) { table_ = std::move(table); }
  int64_t rows() const { return rows_; }
  int64_t dim() const { return dim_; }
  UpdateRule& rule() { return *rule_; }
  const UpdateRule& rule() const { return *rule_; }
  // Local row l; inline because the hot loops call it per row.
  float* row(int64_t l) { return base_ + (l * stride_ + offset_) * dim_; }
  const float* row(int64_t l) const { return base_ + (l * stride_ + offset_) * dim_; }
  // Copies rows local[i] to out[i*dim...], or overwrites them from values[i*dim...].
  void gather(const int64_t* local, int64_t n, float* out) const;
  void scatter(const int64_t* local, int64_t n, const float* values);
  // Runs the rule on unique rows local[i] with gradients grads[i*dim...] (no begin_step()).
  void apply(const int64_t* local, int64_t n, const float* grads);
  // Replaces the optimizer; its state slots start fresh.
  void set_rule(std::unique_ptr<UpdateRule> rule);
  // Rows live in the caller's memory until detach() copies them back into owned memory.
  void attach(float* base, int64_t stride, int64_t offset);
  void detach();
  bool attached() const { return owned_.empty() && rows_ > 0; }
  // Optimizer state slot k (rows x dim, row-major), for checkpoints.
  float* slot(int k) { return slots_[k].data(); }
  const float* slot(int k) const { return slots_[k].data(); }
  int num_slots() const { return static_cast<int>(slots_.size()); }
  // Bytes held by owned rows (0 when attached), and by the optimizer state.
  int64_t row_bytes() const;
  int64_t state_bytes() const;

 private:
  std::string table_;
  int64_t rows_, dim_;
  std::unique_ptr<UpdateRule> rule_;
  std::vector<float, ZeroPages<float>> owned_;
  float* base_ = nullptr;
  int64_t stride_ = 1, offset_ = 0;
  std::vector<std::vector<float>> slots_;
};

// Point-to-point messaging, made by name (csrc/transport/transport.h).
class Transport;
// One timed piece of server-side work (csrc/ps/trace.h).
struct TraceEvent;

// A table registered with a Client; num_shards 0 means every rank holds a shard.
struct TableSpec {
  std::string name;
  int64_t num_rows = 0, dim = 0;
  int num_shards = 0;
  PartitionKind partition = PartitionKind::kCyclic;
  std::string rule = "sgd";
  std::map<std::string, double> hparams;
};

// One table's input to a pull or push; grads (n x dim) and lr (< 0: unchanged) are push-only.
// out (pull-only, n x dim, valid until Wait()): rows land there in input order instead, the
// one copy an embedding's output needs; a world of one copies them straight from its shard.
struct TableBatch {
  int table = -1;
  const int64_t* ids = nullptr;
  int64_t n = 0;
  const float* grads = nullptr;
  double lr = -1.0;
  float* out = nullptr;
};

// One table's pull: rows (unique.size() x dim) of the unique ids; ids[i] is unique[inverse[i]].
// A batch with `out` leaves rows empty; in a world of one its unique and inverse too (nothing
// is deduplicated where no row crosses a wire).
struct PullResult {
  std::vector<int64_t> unique, inverse;
  std::vector<float> rows;
};

// Rows a push changed (ids.size() x dim), for ranks keeping a replica of the table.
struct RowUpdates {
  std::vector<int64_t> ids;
  std::vector<float> rows;
};

// Per batch: pulled rows (a pull), or changed rows (a push that asked for them).
struct Completion {
  std::vector<PullResult> pulled;
  std::vector<RowUpdates> updates;
};

// This rank's PS traffic, payload bytes.
struct TrafficStats {
  int64_t bytes_sent = 0, bytes_received = 0, messages_sent = 0;
};

// One rank's endpoint: its shards of every table and the operations on them. Every rank calls
// the collective methods in the same order. Local bad input (`error`, a bad id) is announced to
// every peer inside the operation, so all ranks throw and none waits. One lock inside makes
// every method safe to call from several threads.
class Client {
 public:
  explicit Client(std::unique_ptr<Transport> transport);
  ~Client();
  int rank() const;
  int size() const;
  // Collective. Registers a table (the same on every rank, else all throw naming it); its handle.
  int add_table(const TableSpec& spec, const std::string& error = "");
  TableSpec spec(int table) const;

  // A started operation; Wait() completes it exactly once.
  using Handle = int64_t;
  // Collective. Sends the pull requests now; Wait() serves peers and collects the rows.
  Handle Pull(const std::vector<TableBatch>& batches, const std::string& error = "");
  // Collective. Sends the push: shards sum rows over ranks, scale, apply their rule once per row.
  // With return_updates Wait() applies it and returns changed rows; else the next operation does
  // (a world of one: Push itself).
  Handle Push(const std::vector<TableBatch>& batches, float scale, bool return_updates = false,
              const std::string& error = "");
  // Completes `handle`: its rows, or the exception the operation met.
  Completion Wait(Handle handle);
  // Pull or Push, then Wait, with no other thread's operation in between.
  std::vector<PullResult> pull(const std::vector<TableBatch>& batches, const std::string& error = "");
  std::vector<RowUpdates> push(const std::vector<TableBatch>& batches, float scale, bool return_updates = false,
                               const std::string& error = "");
  // Collective. Applies any push still pending.
  void flush();
  // Collective. Rank `root`'s full table becomes the shards' rows; its `error` throws everywhere.
  // consume: the root gives `values` up -- its pages go back to the system as their rows reach
  // the shards (they read as zeros afterwards), so the root never holds the table and its own
  // shard at once.
  void load_from_root(int table, const float* values, int root, const std::string& error = "",
                      bool consume = false);
  // Collective. The full table (slot < 0) or an optimizer slot, on every rank.
  std::vector<float> gather(int table, int slot);

  // Local. This rank's rows (slot < 0) or a slot, copied from a full-table array.
  void load_local(int table, int slot, const float* values);
  // Local. Rows alias `full_table` (a replica) from now on; nullptr copies them back.
  void attach_replica(int table, float* full_table);
  // Local. Writes the rows (slot < 0) or slot values among `ids` that this rank holds.
  void write_local(int table, int slot, const int64_t* ids, int64_t n, const float* rows);
  // Local. This rank's rows (slot < 0) or a slot, in storage order (shard_rows x dim), to save.
  std::vector<float> local_values(int table, int slot) const;
  // Collective (no messages: every rank calls it at the same point). Applies the pushes already
  // started, then frees this rank's shard of `table` (rows and optimizer state); the handle stays
  // taken and any later use of it throws naming the table.
  void drop_table(int table);
  // Local. The name errors use for `table` (its path in the model, known after creation).
  void rename_table(int table, const std::string& name);
  // Local. Replaces `table`'s server optimizer (state restarts).
  void set_rule(int table, const std::string& rule, const std::map<std::string, double>& hparams);
  // Local. Seeded rows that do not depend on the number of shards.
  void init_normal(int table, uint64_t seed, float mean, float stddev);
  void init_uniform(int table, uint64_t seed, float low, float high);
  // Local. The shard's step counter (-1 without a shard), for checkpoints.
  void set_step(int table, int64_t step);
  int64_t step(int table) const;
  // Local. The optimizer's slot names and current hyper-parameters.
  std::vector<std::string> slot_names(int table) const;
  std::map<std::string, double> hyperparameters(int table) const;
  // Local. Rows of `table` held here; bytes of rows and of optimizer state held here.
  int64_t shard_rows(int table) const;
  int64_t row_store_bytes() const;
  int64_t state_bytes() const;
  // Local. Traffic counters; server-side work recorded for timelines while tracing is on.
  TrafficStats traffic() const;
  void reset_traffic();
  void set_tracing(bool on);
  std::vector<TraceEvent> take_trace();

  // Private state (csrc/ps/client_impl.h), named here so internal helpers can take it.
  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hybridsync
