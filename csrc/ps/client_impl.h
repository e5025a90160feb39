// What the Client's source files share and no one else needs. A rank is both a worker (its
// caller's operations: client.cc, exchange.cc, access.cc) and a server (its shards: server.cc).
// The server keeps one queue of requests per source rank and works through them in order:
// one-sided requests as soon as they reach the front, a collective operation once every rank's
// request for it is at the front of its queue. Whoever holds the lock drives it: the caller
// while it waits for replies, the serving thread while no caller is inside.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../transport/transport.h"
#include "../transport/wait.h"
#include "bounded.h"
#include "dedup.h"
#include "dynamic_store.h"
#include "hybridsync/ps.h"
#include "partitioner.h"
#include "protocol.h"
#include "routing.h"
#include "shard.h"
#include "tiered_rows.h"
#include "trace.h"

namespace hybridsync {

// A registered table and this rank's part of it.
struct Table {
  TableSpec spec;
  Partitioner part;
  std::unique_ptr<Shard> shard;  // null when this rank holds no shard of the table
  RowAggregator sums;            // server side: a round's gradients summed over workers
  bool dropped = false;          // drop_table(): the handle stays taken, its use throws
  RoundStats last_round;         // server side: this shard's part of the newest round's statistics
  BoundedState bounded;          // staleness k > 0: clocks and lag counters (bounded.cc)
  std::unique_ptr<DynamicStore> dynamic;  // a dynamic table's id map (its rows: `shard`, an arena)
  std::unique_ptr<TieredRows> tiered;     // a fixed table with a disk tier (its memory: `shard`, an arena)
  std::map<std::pair<int, int64_t>, int64_t> handed_over;  // server side: (slot, first row) -> readers served
};

// The row type a table's spec names (rows on the wire are in it, shard or not).
RowType row_type_of(const TableSpec& spec);
// Rows of a fixed table this rank's shard holds (0 without a shard).
int64_t rows_held(const Table& t);

// Throws PSError naming a dynamic table for an operation that needs a fixed row count.
void check_fixed(const Table& t, const char* op);

// A request waiting in a server's queue: its head, parsed; the body is read when it is served.
struct Request {
  RequestKind kind = RequestKind::kError;
  int64_t seq = -1;
  std::vector<char> msg;
  mutable bool held = false;  // a bounded pull the server held back (a peer's push was missing)
};

// One table's entry in a pull or push request: its rows (and, for a push, gradients and lr).
struct Entry {
  int table;
  GradientRows rows;
  double lr = -1.0;
};

// Parses a pull/push request body (after its head) into entries; grads follow all row indices.
std::vector<Entry> read_entries(Reader& r, bool with_grads, float* scale, const std::function<int64_t(int)>& dim_of);

// One batch of a worker's operation, routed; for a push, `rows` are its unique ids' gradients.
struct Routed {
  int table;
  int64_t dim;
  Routing routing;
  const float* rows = nullptr;
  GradientBuffer summed;  // gradients of duplicate ids added up (only when there are some)
  float* out = nullptr;       // a pull's rows in input order (TableBatch::out)
  int64_t clock = 0, bound = -1;  // a bounded pull: this rank's pushes of the table so far, and k
  RowType type = RowType::kFloat32;  // how a pull's rows come (16 bits: decoded on arrival)
};

// A worker's view of the statistics replies carry: each shard's part per (table, round) until
// every shard of the table has reported, then their sum -- in the shards' rank order, so that every
// rank adds the same numbers alike, bit for bit, whatever order the replies came in (the adaptive
// batch's decisions are taken from them on every rank).
struct StatsCollector {
  struct Partial {
    std::map<int, RoundStats> parts;  // shard's rank -> its part
  };
  std::map<int, std::map<int64_t, Partial>> partial;  // table -> round -> parts so far
  std::map<int, RoundStats> done;                     // table -> newest complete round
  void add(int table, int shards, int source, const RoundStats& part);
};

struct detail::ClientState {
  std::unique_ptr<Transport> transport;
  WaitPolicy policy;
  std::vector<std::unique_ptr<Table>> tables;
  bool broken = false;
  std::string broken_reason;
  Tracer tracer;
  StatsCollector stats;
  // Serialises every method and the serving thread; taken once per call, never inside a loop.
  mutable std::mutex mu;

  // -- worker -------------------------------------------------------------------------------
  int64_t last_seq = 0;  // collective calls so far: the number of the newest one
  int64_t one_sided_ids = 0;  // numbers this rank's one-sided requests, to match their replies
  int64_t join_seq = -1;      // the number of this rank's join, between join_begin and join_finish
  std::set<std::pair<int64_t, int64_t>> told;  // (rank, id) of the failed bounded pushes raised here
  // add_table's table while the collective runs (the local server creates it from this).
  std::unique_ptr<Table> adding;
  std::string adding_description;

  // -- server -------------------------------------------------------------------------------
  std::vector<std::deque<Request>> queues;         // per source, in arrival order
  std::vector<std::vector<ErrorNote>> deferred;     // per destination: failed pushes to report next
  std::thread serving;
  std::atomic<bool> stopping{false};

  int rank() const { return transport->rank(); }
  int size() const { return transport->size(); }
  Table& table_at(int table) const;
  void check_usable() const;

  // Serves whatever can be served now; true if it did anything. Throws PSTransportError (after
  // telling every peer) when the protocol broke.
  bool progress();
  bool serve_ready();
  // Waits until `ready()`, driving the server meanwhile; `peer` as in wait_until.
  template <class Ready>
  void drive_until(Ready ready, const std::string& what, int peer = -1);
  // Waits until this rank's own requests were all served (its collective calls applied here).
  void settle();
  // A rank whose request this rank's server still lacks for the oldest collective it holds
  // (-1: none), for stall warnings.
  int late_rank() const;
  // The serving thread's loop.
  void serve_in_background();
  // Marks the engine unusable and tells every peer why (they fail too, instead of waiting).
  [[noreturn]] void fail(const std::string& reason);

  // Server: one-sided requests and whole collective operations.
  void serve_one_sided(int source, const Request& request);
  void run_collective(std::vector<Request>& requests);
  void serve_pulls(std::vector<Request>& requests, const std::vector<ErrorNote>& errors);
  // Tables with a disk tier: every rank's pulled rows into memory first (a failure: *errors).
  // *positions: per dynamic table, the arena positions of every rank's rows, in request order.
  void prefetch_pulls(std::vector<Request>& requests, std::vector<ErrorNote>* errors,
                      std::map<int, std::vector<int64_t>>* positions);
  void apply_push_round(std::vector<Request>& requests, const std::vector<ErrorNote>& errors, bool with_updates);
  void finish_add_table(std::vector<Request>& requests, std::vector<ErrorNote> errors);
  void finish_join();
  // rescale_accumulators: the ranks' requests compared, then every named table's shard here.
  void rescale_round(std::vector<Request>& requests, std::vector<ErrorNote>* errors);
  void serve_step(int source, const Request& request, Reader& r);
  void hand_over(Table& t, int slot, int64_t begin, int64_t n, int64_t readers);
  // A dynamic shard read or written one-sided (dynamic_access.cc).
  void serve_dynamic(int source, const Request& request, Reader& r);
  void reply(int dest, Writer& w);
  void reply_head(Writer& w, int dest, RequestKind kind, int64_t seq, std::vector<ErrorNote> errors);

  // Bounded staleness (bounded.cc). Whether `table`'s pulls and pushes go asynchronously.
  bool is_bounded(int table) const;
  // Server: whether `source`'s one-sided request can be served now (a bounded pull waits for
  // the bound; it is marked held then).
  bool ready_to_serve(int source, const Request& request) const;
  void serve_bounded(int source, const Request& request);
  void serve_bounded_error(int source, const Request& request);
  // Worker: sends a bounded push (every table's shards count it as one step of this rank). Bad
  // input (`error`, or found routing the ids): with `alone` (no synchronous round follows to carry
  // it) every rank is told, the step still counts, and it throws; else it sends nothing and
  // leaves the error in *error for the round.
  void push_bounded(const std::vector<TableBatch>& batches, float scale, bool alone, std::string* error,
                    bool* index_error);
  // Worker: whether a peer's error note is news (a failed bounded push is told by every shard).
  bool first_telling(const ErrorNote& e);
  // Worker: a bounded pull reply's part before its rows (each shard's lag).
  void read_bounded_reply(Reader& r, const std::vector<Routed>& routed, std::vector<int64_t>* lag, bool* held);
  // Both: every clock restarts from 0 (all ranks joined: no push is in flight anywhere).
  void restart_bounded_clocks();

  // Worker: sends one request per rank and collects one reply from each (handle(source, reader)
  // reads each reply's body); throws the errors the replies name.
  int64_t next_seq() { return ++last_seq; }
  void send_request(int dest, std::vector<char> payload);
  template <class Handle>
  void collect_replies(RequestKind kind, int64_t seq, const char* op, Handle handle);
  // The errors of an operation as an exception: this rank's own input first, then a peer's.
  static void throw_errors(const std::vector<ErrorNote>& errors, int self, const char* op);

  // World of one: a push applied from the caller's rows at once, no message at all.
  void apply_local(const std::vector<TableBatch>& batches, float scale);
  // Applies gradient rows from several sources to a table as one round (server and world of one).
  void apply_to_table(Table& t, const std::vector<GradientRows>& sources, float scale, double lr, int64_t round,
                      int ranks);
};

// One message of a one-sided exchange: where it goes, its payload (made when it is sent, so at
// most a window of them exists at once) and what to do with the answer.
struct Chunk {
  int dest;
  std::function<std::vector<char>(int64_t id)> make;
  std::function<void(Reader&)> on_reply;
};

// Sends the chunks (a few unanswered at a time), driving this rank's server meanwhile; replies
// come in order per destination. Throws the first error any of them met (access.cc).
void exchange_chunks(detail::ClientState& c, std::vector<Chunk>& chunks, RequestKind kind, const char* op);

// Starts a request's body: its kind and number.
inline Writer request_writer(RequestKind kind, int64_t seq) {
  Writer w;
  w.i64(static_cast<int64_t>(kind));
  w.i64(seq);
  return w;
}

// A request announcing that the sender's input to collective `kind` was bad.
std::vector<char> error_request(RequestKind kind, int64_t seq, const std::string& message, bool index_error);

// A server's sanity check of row positions a worker sent (they come from our partitioner).
void check_rows(const Shard* shard, const std::string& table, const int64_t* local, int64_t n, const char* op);
// The same for any table (a dynamic one takes every id).
void check_rows(const Table& t, const int64_t* local, int64_t n, const char* op);
// Rows (slot < 0) or slot values of a shard's local rows / a dynamic shard's ids into out.
void gather_rows(const Table& t, const int64_t* local, int64_t n, float* out, int slot = -1);
// Rows as the table stores them (what pull replies carry), row_size bytes each. positions: a
// dynamic table's arena positions of the ids from its prefetch, if there was one.
void gather_wire(const Table& t, const int64_t* local, int64_t n, char* out, const int64_t* positions = nullptr);
// Overwrites rows (slot < 0) or slot values of a fixed table's local rows.
void scatter_rows(Table& t, const int64_t* local, int64_t n, const float* values, int slot = -1);
// A pull's prefetch: the stored rows of a table with a disk tier are in memory afterwards (and
// *positions, if given, a dynamic table's arena positions of them).
void prefetch_rows(Table& t, const int64_t* local, int64_t n, std::vector<int64_t>* positions = nullptr);

template <class Ready>
void detail::ClientState::drive_until(Ready ready, const std::string& what, int peer) {
  wait_until(
      [&] {
        check_usable();
        progress();
        return ready();
      },
      policy, what, peer, [&] { return late_rank(); });
}

template <class Handle>
void detail::ClientState::collect_replies(RequestKind kind, int64_t seq, const char* op, Handle handle) {
  const int P = size();
  std::vector<bool> got(P, false);
  int remaining = P;
  std::vector<ErrorNote> errors;
  drive_until(
      [&] {
        Message m;
        while (remaining > 0 && transport->try_recv(kAnySource, kTagReply, &m)) {
          Reader r(m.data);
          ReplyHead head = read_reply_head(r);
          if (head.kind != kind || head.seq != seq || got[m.source]) {
            fail(std::string("hybridsync: rank ") + std::to_string(m.source) + " answered " +
                 operation_name(head.kind) + " #" + std::to_string(head.seq) + " while this rank waited for " + op +
                 " #" + std::to_string(seq) + " (a protocol error)");
          }
          got[m.source] = true;
          --remaining;
          for (ErrorNote& e : head.errors) {
            if (first_telling(e)) errors.push_back(std::move(e));
          }
          if (errors.empty()) handle(m.source, r);
        }
        return remaining == 0;
      },
      std::string(op) + " #" + std::to_string(seq) + " (every rank takes part)");
  throw_errors(errors, rank(), op);
}

}  // namespace hybridsync
