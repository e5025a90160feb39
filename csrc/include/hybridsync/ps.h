// hybridsync parameter server, public C++ surface: the Client every rank holds, the table specs
// it takes and the errors it throws. A table (int64 id -> float32 row of `dim`) is split over
// shards; every rank's Client holds that rank's shards and serves them to its peers -- from a
// thread of its own, so a rank busy computing still answers -- and runs the operations on them
// over a Transport. No torch or TensorFlow here: adapters hand in contiguous buffers.
// Internals (shards, update rules, partitioning, the wire protocol, the server) are in csrc/ps/.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace hybridsync {

// Bad input from the caller (unknown hyper-parameter, shape or dtype mismatch); -> ValueError.
struct PSError : std::runtime_error { using std::runtime_error::runtime_error; };
// An id outside [0, num_rows) of its table; -> IndexError.
struct PSIndexError : PSError { using PSError::PSError; };
// A peer reported bad input in a collective operation (every rank throws); -> RuntimeError.
struct PSRemoteError : std::runtime_error { using std::runtime_error::runtime_error; };
// The transport failed, a peer left or ranks disagreed on the protocol: the Client is unusable
// afterwards, on every rank (the one that saw it tells the others).
struct PSTransportError : PSRemoteError { using PSRemoteError::PSRemoteError; };

// kCyclic (id mod shards) keeps hot small ids apart; kBlock gives each shard one range; kHash
// (a hash of the id mod shards) spreads a dynamic table's raw 64-bit ids.
enum class PartitionKind : int { kBlock = 0, kCyclic = 1, kHash = 2 };

// A dynamic table (on: true): any int64 id, rows created on first touch (csrc/ps/dynamic_store.h).
// capacity 0: unbounded; each shard holds at most its share. ttl_steps 0: no expiry.
struct DynamicSpec {
  bool on = false;
  int64_t capacity = 0, admit_after = 1, ttl_steps = 0;
  std::string evict = "none";  // none | lru | lfu
  uint64_t seed = 0;
  std::string init = "normal";  // normal (mean a, std b) | uniform (low a, high b)
  double init_a = 0.0, init_b = 1.0;
};

// A dynamic shard's contents, for checkpoints (slots[k]: optimizer slot k, like rows).
struct DynamicState {
  int64_t dim = 0;
  std::vector<int64_t> ids, counts, last_touch;
  std::vector<float> rows;
  std::vector<std::vector<float>> slots;
  std::vector<int64_t> pending_ids, pending_counts, pending_last;  // seen, not admitted yet
};

// How write_dynamic writes a state: kUpsert adds or overwrites its entries; kReplace first
// empties every shard and sets its step, so the table then holds exactly the state; kSlots
// writes the optimizer slots of the state's ids that are stored (rows, counts and pending ids
// unused; absent ids are skipped).
enum class DynamicWrite : int { kUpsert = 0, kReplace = 1, kSlots = 2 };

// A dynamic shard's counters: cumulative, and of the newest round (last_*).
struct DynamicStats {
  int64_t stored = 0, capacity = 0, pending = 0;
  int64_t admitted = 0, evicted = 0, expired = 0, rejected = 0;
  int64_t last_admitted = 0, last_evicted = 0, last_expired = 0;
  int64_t map_bytes = 0, row_bytes = 0;  // the id map and per-row metadata; rows and slots
};

// How a table stores its rows (docs/storage-tiers.md). dtype: float32, float16 or bfloat16 rows,
// on the shards and on the wire (optimizer slots stay float32); rounding: "nearest" (even) or
// "stochastic", from bits of (seed, id, step) -- the same at any world size. With a path (a
// directory on each rank's local disk), rows beyond memory_rows (over all shards, shared out
// as a dynamic table's capacity is) live in a file per shard there; a dynamic table holds at
// most disk_rows more there (0: unbounded), and its capacity must be 0 then.
struct StorageSpec {
  std::string dtype = "float32", rounding = "nearest", path;
  int64_t memory_rows = 0, disk_rows = 0;
  uint64_t seed = 0;
};

// A table's storage on this rank's shard: rows in memory and on disk, stored rows that lookups
// (pull prefetches, pushes, writes) found in memory (hits) and read back from disk (loads), the
// bytes its disk tier read and wrote, and the push rounds (steps) so far.
// How a fixed table's rows start before anything writes them: kind "zeros", "normal" (a, b: mean
// and standard deviation) or "uniform" (a, b: low and high), a function of (seed, row id).
struct RowInitSpec {
  std::string kind = "zeros";
  uint64_t seed = 0;
  double a = 0.0, b = 0.0;
};

struct TierStats {
  std::string dtype = "float32", path;  // path: the disk tier's file ("" without one)
  int64_t memory_rows = 0, disk_rows = 0, memory_share = 0;
  int64_t hits = 0, loads = 0, bytes_read = 0, bytes_written = 0, steps = 0;
};

// A table registered with a Client; num_shards 0 means every rank holds a shard.
struct TableSpec {
  std::string name;
  int64_t num_rows = 0, dim = 0;
  int num_shards = 0;
  PartitionKind partition = PartitionKind::kCyclic;
  std::string rule = "sgd";
  std::map<std::string, double> hparams;
  DynamicSpec dynamic;  // num_rows is ignored (-1) when dynamic.on
  StorageSpec storage;
};

// One table's input to a pull or push; grads (n x dim) and lr (< 0: unchanged) are push-only.
// out (pull-only, n x dim): rows land there in input order instead, the one copy an
// embedding's output needs; a world of one copies them straight from its shard.
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

// One table's gradient statistics of one synchronous push round, summed over its shards (each
// shard computes its part where the rows are; only these scalars travel): `local_sq` is the sum
// over ranks of each rank's |gradient|^2, `combined_sq` the |sum over ranks|^2, both before the
// push's scale. round < 0: none complete yet. `rows` are the distinct rows the round updated,
// `pushed` the rows it received (each rank's distinct rows, summed over ranks): how often rows
// repeat across ranks, which the adaptive batch's row-frequency model reads.
struct RoundStats {
  int64_t round = -1;
  double local_sq = 0.0, combined_sq = 0.0;
  int ranks = 0;  // ranks whose push reached the table in that round
  int64_t rows = 0, pushed = 0;
};

// A table's bounded staleness as this rank saw it (csrc/ps/bounded.cc). Lag: how many of the
// other ranks' newest steps (pushes) a pull's rows missed, the most over the ranks and the shards
// that answered it; never more than `staleness`.
struct StalenessStats {
  int staleness = 0;      // k (0: synchronous)
  int64_t clock = 0;      // this rank's pushes of the table so far
  int64_t pulls = 0;      // bounded pulls so far
  int64_t last_lag = 0, max_lag = 0, lag_sum = 0;
  int64_t held = 0;       // pulls a shard held back until a slower rank's push came (the bound)
  double wait_s = 0.0;    // time spent in bounded pulls
};

// This rank's PS traffic, payload bytes.
struct TrafficStats {
  int64_t bytes_sent = 0, bytes_received = 0, messages_sent = 0;
  int64_t largest_message = 0;  // the largest single network message sent
};

// One timed piece of server-side work (steady_clock nanoseconds), for timelines.
struct TraceEvent {
  std::string name;
  int64_t start_ns = 0, end_ns = 0;
  int64_t rows = 0;
};

// The hyper-parameters server optimizer `rule` runs with: `given` with defaults filled in.
// Throws PSError naming an unknown rule, an unknown key or a bad value.
std::map<std::string, double> resolve_rule(const std::string& rule, const std::map<std::string, double>& given);

// How waiting for peers behaves: poll (yielding the core) for a while, then sleep with
// back-off, so an idle or waiting rank does not burn a core another rank needs.
struct WaitPolicy {
  double spin_us = 50.0;          // poll this long first
  double max_sleep_us = 200.0;    // back-off cap between polls
  double stall_warning_s = 60.0;  // print a warning naming the peer after this long
  double timeout_s = 600.0;       // give up (throw) after this long; <= 0 waits forever
  double peer_timeout_s = 60.0;   // a peer the heartbeat has not heard from this long fails the wait
};

class Client;
namespace detail {
struct ClientState;  // a Client's private state (csrc/ps/client_impl.h)
}  // namespace detail

// This rank's Client over the transport registered as `transport` ("mpi": `native` is the
// MPI_Comm* whose duplicate it uses). max_message_bytes: the largest single network message
// (longer ones travel in fragments; <= 0: the network's own limit); it must be the same on
// every rank. serve_in_background: a thread serves the peers while no caller is inside the
// Client (off only in tests that need every step on the caller's thread).
std::unique_ptr<Client> make_client(const std::string& transport, void* native, const WaitPolicy& wait,
                                    int64_t max_message_bytes = 0, bool serve_in_background = true);

// One rank's endpoint. Three kinds of methods:
//  - collective: every rank calls them in the same order (else all throw, naming both calls);
//    local bad input is announced to every peer inside the operation, so all ranks throw;
//  - one-sided: this rank alone reads or writes rows of any shard; the shards' owners answer
//    whatever they are doing, and see this rank's earlier operations first;
//  - local: this rank's shards only.
// One lock inside makes every method safe to call from several threads.
class Client {
 public:
  ~Client();
  // Stops serving the peers (before MPI is finalised); every later call throws. Call it after a
  // last barrier, so no peer still needs this rank's shards.
  void close();
  // False once the Client failed (or was closed): every call would throw.
  bool usable() const;
  int rank() const;
  int size() const;

  // -- collective ---------------------------------------------------------------------------
  // Registers a table (the same on every rank, else all throw naming it); its handle.
  int add_table(const TableSpec& spec, const std::string& error = "");
  // Rows of the batches' ids, with every push started before applied.
  std::vector<PullResult> pull(const std::vector<TableBatch>& batches, const std::string& error = "");
  // Shards sum rows over ranks, multiply by `scale`, apply their rule once per row. Without
  // return_updates it returns at once (the shards apply it as soon as every rank's part is in);
  // with it, waits and returns every row any shard changed.
  std::vector<RowUpdates> push(const std::vector<TableBatch>& batches, float scale, bool return_updates = false,
                               const std::string& error = "");
  // Waits until every operation started anywhere before it is applied everywhere; `what` names
  // it in errors (e.g. "shutdown": a peer still pulling is told this rank is leaving).
  void barrier(const std::string& what = "flush");
  // Rank `root`'s full table becomes the shards' rows; its `error` throws everywhere.
  // consume: the root gives `values` up -- its pages go back to the system as their rows reach
  // the shards (they read as zeros afterwards), so it never holds the table and its shard at once.
  void load_from_root(int table, const float* values, int root, const std::string& error = "",
                      bool consume = false);
  // Frees this rank's shard of `table` (rows and optimizer state) once every push started before
  // is applied; the handle stays taken and any later use of it throws naming the table.
  void drop_table(int table);
  // Multiplies what the server optimizer of each of `tables` accumulated over every step (its
  // accumulating slots: Adagrad's sums of squared gradients; tables whose rule has none are left
  // alone) by `factor`, for every row each shard stores -- in memory, on its disk tier, a dynamic
  // table's -- once every push started before it is applied and before any started after it.
  // A slot still at its initial value stays there; above it, only what was accumulated is scaled.
  // Every rank passes the same tables and the same factor bit for bit (else all throw); factor
  // must be finite and > 0. The adaptive batch size calls it when the global batch changes.
  void rescale_accumulators(const std::vector<int>& tables, double factor);
  // hvd.join() for the parameter server, in two halves around the dense backend's own join:
  // join_begin() tells every rank this one has run out of data -- it takes no part in their
  // operations from then on, while its shards keep serving them -- and join_finish() waits until
  // every rank has joined. Nothing else may be called in between.
  void join_begin();
  void join_finish();

  // -- one-sided ------------------------------------------------------------------------------
  // The rows (slot < 0) or an optimizer slot of `n` ids (any shard), into out (n x dim).
  void read_rows(int table, int slot, const int64_t* ids, int64_t n, float* out);
  // The whole table (slot < 0) or slot, into out (num_rows x dim), streamed from the shards in
  // chunks: this rank holds the result and one chunk per shard, the shards nothing extra.
  // hand_over: every rank reads the table (or slot) this way once, at the same point, and then
  // drops it; each shard gives a chunk's memory back as soon as every rank has read it, so a
  // rank never holds its shard and the whole table at once. Reads of it afterwards see zeros.
  void read_table(int table, int slot, float* out, bool hand_over = false);
  // Writes rows (slot < 0) or slot values of `n` ids (any shard), in chunks.
  void write_rows(int table, int slot, const int64_t* ids, int64_t n, const float* rows);
  // Writes the whole table (num_rows x dim) to its shards, in chunks.
  void write_table(int table, int slot, const float* values);
  // The server optimizer's step count of `table`, and setting it on every shard.
  int64_t table_step(int table);
  void set_table_step(int table, int64_t step);
  // A dynamic table: every shard's {step, stored rows, pending ids}, one small request each.
  std::vector<std::array<int64_t, 3>> dynamic_sizes(int table);
  // A dynamic table's shard `shard`, streamed in chunks: its ids, counts, last touches and
  // pending ids, with its rows (with_rows) and optimizer slots (with_slots); *step: its step. A
  // shard that changed between chunks (pushes of bounded staleness) is read again.
  DynamicState read_dynamic(int table, int shard, bool with_rows, bool with_slots, int64_t* step);
  // Writes `state` (ids of any shard: each goes to its owner) in chunks, as `how` says. Without
  // slots in `state`, rows it adds start with fresh slots (stored ones keep theirs).
  void write_dynamic(int table, const DynamicState& state, DynamicWrite how, int64_t step = -1);

  // -- local ----------------------------------------------------------------------------------
  TableSpec spec(int table) const;
  // This rank's rows (slot < 0) or a slot, copied from a full-table array.
  void load_local(int table, int slot, const float* values);
  // Rows alias `full_table` (a replica) from now on; nullptr copies them back.
  void attach_replica(int table, float* full_table);
  // Writes the rows (slot < 0) or slot values among `ids` that this rank holds.
  void write_local(int table, int slot, const int64_t* ids, int64_t n, const float* rows);
  // This rank's rows (slot < 0) or a slot, in storage order (shard_rows x dim), to save.
  std::vector<float> local_values(int table, int slot) const;
  // The name errors use for `table` (its path in the model, known after creation).
  void rename_table(int table, const std::string& name);
  // Replaces `table`'s server optimizer (state restarts).
  void set_rule(int table, const std::string& rule, const std::map<std::string, double>& hparams);
  // Seeded rows that do not depend on the number of shards. A table with a disk tier computes
  // a row's initial value when it is first needed, and stores nothing until the row changes.
  void init_normal(int table, uint64_t seed, float mean, float stddev);
  void init_uniform(int table, uint64_t seed, float low, float high);
  // The shard's step counter (-1 without a shard), for checkpoints.
  void set_step(int table, int64_t step);
  int64_t step(int table) const;
  // The optimizer's slot names and current hyper-parameters.
  std::vector<std::string> slot_names(int table) const;
  std::map<std::string, double> hyperparameters(int table) const;
  // Rows of `table` held here; bytes of rows and of optimizer state held here.
  int64_t shard_rows(int table) const;
  // The table's storage on this rank's shard (default values without a shard).
  TierStats tier_stats(int table) const;
  // A fixed table with a disk tier: the global ids of this shard's rows that hold something
  // other than their initial value, in memory (memory) or on disk (!memory) -- what a
  // checkpoint saves. Rows (slot < 0) or slot values of this shard's rows `ids`, wherever they
  // are (memory does not change).
  std::vector<int64_t> written_rows(int table, bool memory) const;
  // A fixed table with a disk tier: what its rows never written hold (checkpoints record it, to
  // save only the rows written).
  RowInitSpec row_init(int table) const;
  // This rank's shard: every row back to its initial value from `init`, with fresh optimizer
  // slots (before a checkpoint that saved only written rows loads over it).
  void reset_rows(int table, const RowInitSpec& init);
  void local_rows(int table, int slot, const int64_t* ids, int64_t n, float* out) const;
  int64_t row_store_bytes() const;
  int64_t state_bytes() const;
  // A dynamic table's shard here: its contents, restoring them (ids other shards own are
  // skipped, so any world size loads any checkpoint), and its counters.
  DynamicState dynamic_state(int table) const;
  // Entries [begin, begin + n) of this rank's shard, in storage order: of its stored rows (with
  // their rows and slots if `rows`) or, pending, of the ids it has seen but not admitted. A checkpoint streams a
  // shard larger than memory so, a chunk at a time; the order holds while nothing changes the
  // shard (no push or pull completes while this rank is in a save).
  DynamicState dynamic_range(int table, bool pending, int64_t begin, int64_t n, bool rows) const;
  void dynamic_restore(int table, const DynamicState& state);
  // Empties this rank's shard (before a restore: a load replaces what training stored).
  void dynamic_clear(int table);
  DynamicStats dynamic_stats(int table) const;
  // The newest complete push round's gradient statistics of `table` this rank has seen.
  RoundStats round_stats(int table) const;
  // Whether this rank's shard of `table` computes the squared norms of RoundStats (local_sq,
  // combined_sq; 0 while off, the default: they cost a pass over every pushed row). Every rank
  // sets the same before the table's first push that should count (the adaptive batch size does).
  void set_gradient_statistics(int table, bool on);
  // Bounded staleness: pulls of a table with k > 0 may miss at most the other ranks' last k
  // pushes (a rank that would miss more waits), its pushes are applied by the shards as they
  // come; this rank's own pushes are always in its pulls. Every rank sets the same k at the same
  // point, and pushes every such table once per step (rows or not). k = 0: collective rounds.
  void set_staleness(int table, int k);
  StalenessStats staleness(int table) const;
  // Traffic counters; server-side work recorded for timelines while tracing is on.
  TrafficStats traffic() const;
  void reset_traffic();
  void set_tracing(bool on);
  std::vector<TraceEvent> take_trace();

 private:
  friend std::unique_ptr<Client> make_client(const std::string&, void*, const WaitPolicy&, int64_t, bool);
  Client(std::unique_ptr<detail::ClientState> state, bool serve_in_background);
  std::unique_ptr<detail::ClientState> impl_;
};

}  // namespace hybridsync
