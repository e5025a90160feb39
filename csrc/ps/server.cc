// The server side of every rank: its shards answer the peers' requests (see client_impl.h).
//
// Requests from one source are served in the order it sent them, so a worker's one-sided read
// sees its own earlier pushes, and a server never applies a push before the pulls that came
// first. A collective operation runs once every rank's request for it is at the front of its
// queue -- so push rounds are applied in order, and a pull sees every push started before it --
// and if the ranks' requests name different operations (or numbers), every rank fails at once,
// naming both sides. Rounds with bad input from any rank change no row anywhere.
#include <algorithm>
#include <cstring>
#include <functional>

#include "../transport/wait.h"
#include "client_impl.h"

namespace hybridsync {
namespace {

// The request body's kind of operation, a failed one counting as the one it stands for.
RequestKind intended(const Request& q) {
  if (q.kind != RequestKind::kError) return q.kind;
  Reader r(q.msg);
  r.i64();
  r.i64();
  return static_cast<RequestKind>(r.i64());
}

// What a rank called, for a mismatch error: the operation, and what a barrier was for.
std::string called(const Request& q) {
  const RequestKind kind = intended(q);
  if (q.kind == RequestKind::kBarrier) {
    Reader r(q.msg);
    r.i64();
    r.i64();
    const std::string what = r.text();
    if (what == "shutdown") return "shutdown (its program is ending)";
    return "barrier (" + what + ")";
  }
  return operation_name(kind);
}

ErrorNote error_of(const Request& q, int source) {
  Reader r(q.msg);
  r.i64();
  r.i64();
  r.i64();
  ErrorNote e;
  e.rank = source;
  e.index_error = r.i64() != 0;
  e.message = r.text();
  return e;
}

// A one-sided request's rows as sent: a range of local rows, or a list. A range carries no
// bytes to check its length against, so it is spelled out only once it is known to lie within
// the table's shard (rows_of).
struct RowsAsked {
  RowsBy by = RowsBy::kList;
  int64_t begin = 0, n = 0;
  int64_t readers = 0;  // a hand-over range: the ranks that each read it once
  std::vector<int64_t> list;
};

RowsAsked read_rows_asked(Reader& r) {
  RowsAsked asked;
  asked.by = static_cast<RowsBy>(r.i64());
  asked.n = r.i64();
  if (asked.by == RowsBy::kRange || asked.by == RowsBy::kRangeHandOver) {
    asked.begin = r.i64();
    if (asked.by == RowsBy::kRangeHandOver) asked.readers = r.i64();
    if (asked.n < 0 || asked.begin < 0 || (asked.by == RowsBy::kRangeHandOver && asked.readers < 1)) Reader::fail();
  } else if (asked.by == RowsBy::kList) {
    asked.list = r.i64s(r.count(asked.n, sizeof(int64_t)));
  } else {
    Reader::fail();
  }
  return asked;
}

std::vector<int64_t> rows_of(RowsAsked&& asked, const Table& t, const char* op) {
  if (asked.by == RowsBy::kList) return std::move(asked.list);
  const int64_t rows = rows_held(t);
  if (asked.n > rows || asked.begin > rows - asked.n) {  // (no begin + n: it could overflow)
    throw PSTransportError(std::string(op) + " for table '" + t.spec.name + "': bad row range");
  }
  std::vector<int64_t> local(static_cast<size_t>(asked.n));
  for (int64_t i = 0; i < asked.n; ++i) local[static_cast<size_t>(i)] = asked.begin + i;
  return local;
}

}  // namespace

std::vector<Entry> read_entries(Reader& r, bool with_grads, float* scale, const std::function<int64_t(int)>& dim_of) {
  const int64_t n = r.i64();
  if (with_grads) *scale = static_cast<float>(r.f64());
  // (each entry's head: table and row count, and the learning rate with gradients)
  std::vector<Entry> entries(r.count(n, (with_grads ? 3 : 2) * sizeof(int64_t)));
  for (auto& e : entries) {
    e.table = static_cast<int>(r.i64());
    e.rows.n = r.i64();
    if (with_grads) e.lr = r.f64();
  }
  for (auto& e : entries) e.rows.rows = r.i64_view(r.count(e.rows.n, sizeof(int64_t)));
  if (with_grads) {
    for (auto& e : entries) e.rows.grads = r.f32s(e.rows.n, dim_of(e.table));
  }
  return entries;
}

void StatsCollector::add(int table, int shards, int source, const RoundStats& part) {
  auto& rounds = partial[table];
  Partial& p = rounds[part.round];
  p.parts[source] = part;
  if (static_cast<int>(p.parts.size()) < shards) return;
  RoundStats sum;
  sum.round = part.round;
  for (const auto& entry : p.parts) {  // (in rank order: see StatsCollector)
    const RoundStats& s = entry.second;
    sum.local_sq += s.local_sq;
    sum.combined_sq += s.combined_sq;
    sum.ranks = std::max(sum.ranks, s.ranks);
    sum.rows += s.rows;
    sum.pushed += s.pushed;
  }
  RoundStats& newest = done[table];
  if (part.round > newest.round) newest = sum;
  rounds.erase(rounds.begin(), rounds.upper_bound(part.round));  // older rounds can no longer complete
}

std::vector<char> error_request(RequestKind kind, int64_t seq, const std::string& message, bool index_error) {
  Writer w = request_writer(RequestKind::kError, seq);
  w.i64(static_cast<int64_t>(kind));
  w.i64(index_error ? 1 : 0);
  w.text(message);
  return w.take();
}

void check_rows(const Shard* shard, const std::string& table, const int64_t* local, int64_t n, const char* op) {
  if (n == 0) return;
  if (!shard) throw PSTransportError(std::string(op) + " for table '" + table + "' reached a rank without its shard");
  for (int64_t i = 0; i < n; ++i) {
    if (local[i] < 0 || local[i] >= shard->rows()) {
      throw PSTransportError(std::string(op) + " for table '" + table + "': bad row index");
    }
  }
}

void check_rows(const Table& t, const int64_t* local, int64_t n, const char* op) {
  if (n && !t.shard) check_rows(nullptr, t.spec.name, local, n, op);
  if (t.dynamic) return;
  const int64_t rows = rows_held(t);
  for (int64_t i = 0; i < n; ++i) {
    if (local[i] < 0 || local[i] >= rows) {
      throw PSTransportError(std::string(op) + " for table '" + t.spec.name + "': bad row index");
    }
  }
}

RowType row_type_of(const TableSpec& spec) {
  RowType type = RowType::kFloat32;
  parse_row_type(spec.storage.dtype, &type);  // (add_table checked the name)
  return type;
}

int64_t rows_held(const Table& t) {
  if (!t.shard || t.dynamic) return 0;
  return t.tiered ? t.tiered->rows() : t.shard->rows();
}

void gather_rows(const Table& t, const int64_t* local, int64_t n, float* out, int slot) {
  if (t.dynamic) {
    t.dynamic->read(*t.shard, local, n, out, slot);
  } else if (t.tiered) {
    t.tiered->gather(*t.shard, local, n, out, slot);
  } else {
    t.shard->gather(local, n, out, slot);
  }
}

void gather_wire(const Table& t, const int64_t* local, int64_t n, char* out, const int64_t* positions) {
  if (t.dynamic) {
    t.dynamic->read_raw(*t.shard, local, n, out, positions);
  } else if (t.tiered) {
    t.tiered->gather_raw(*t.shard, local, n, out);
  } else {
    t.shard->gather_raw(local, n, out);
  }
}

void scatter_rows(Table& t, const int64_t* local, int64_t n, const float* values, int slot) {
  if (t.tiered) {
    t.tiered->scatter(*t.shard, local, n, values, slot);
  } else {
    t.shard->scatter(local, n, values, slot);
  }
}

void prefetch_rows(Table& t, const int64_t* local, int64_t n, std::vector<int64_t>* positions) {
  if (t.tiered) {
    t.tiered->disk().check();
    t.tiered->prefetch(*t.shard, local, n);
  } else if (t.dynamic && t.dynamic->disk()) {
    t.dynamic->disk()->check();
    t.dynamic->prefetch(t.shard, local, n, positions);
  }
}

void detail::ClientState::fail(const std::string& reason) {
  if (!broken) {
    broken = true;
    broken_reason = reason;
    Writer w = request_writer(RequestKind::kAbort, last_seq);
    w.text("rank " + std::to_string(rank()) + ": " + reason);
    const std::vector<char> notice = w.take();
    for (int d = 0; d < size(); ++d) {
      if (d == rank()) continue;
      try {
        transport->send(d, kTagRequest, notice);
      } catch (...) {
        // Best effort: a peer we cannot reach learns from its own heartbeat.
      }
    }
  }
  throw PSTransportError(reason);
}

void detail::ClientState::reply(int dest, Writer& w) { transport->send(dest, kTagReply, w.take()); }

void detail::ClientState::reply_head(Writer& w, int dest, RequestKind kind, int64_t seq, std::vector<ErrorNote> errors) {
  auto& late = deferred[dest];
  errors.insert(errors.end(), late.begin(), late.end());
  late.clear();
  write_reply_head(w, kind, seq, errors);
}

bool detail::ClientState::progress() {
  try {
    return serve_ready();
  } catch (const PSTransportError&) {
    throw;  // fail() already told the peers
  } catch (const std::exception& e) {
    fail(std::string("hybridsync: the parameter server failed: ") + e.what());
  }
}

bool detail::ClientState::serve_ready() {
  const int P = size();
  bool worked = false;
  Message m;
  while (transport->try_recv(kAnySource, kTagRequest, &m)) {
    Reader r(m.data);
    Request q;
    q.kind = static_cast<RequestKind>(r.i64());
    q.seq = r.i64();
    if (q.kind == RequestKind::kAbort) {
      const std::string why = r.text();
      fail("hybridsync: the parameter server failed on " + why);
    }
    q.msg = std::move(m.data);
    queues[m.source].push_back(std::move(q));
  }
  for (bool again = true; again;) {
    again = false;
    for (int src = 0; src < P; ++src) {
      auto& queue = queues[src];
      while (!queue.empty() && !is_collective(queue.front().kind) && ready_to_serve(src, queue.front())) {
        serve_one_sided(src, queue.front());
        queue.pop_front();
        again = worked = true;
      }
    }
    // A collective runs once every rank's request for it is at the front of its queue; a rank
    // that joined (hvd.join()) takes no part until every rank has joined.
    bool all_in = true, any_active = false;
    for (int src = 0; src < P && all_in; ++src) {
      all_in = !queues[src].empty() && is_collective(queues[src].front().kind);  // (not a held bounded pull)
      any_active = any_active || (all_in && queues[src].front().kind != RequestKind::kJoin);
    }
    if (!all_in) break;
    if (!any_active) {
      finish_join();
      again = worked = true;
      continue;
    }
    std::vector<Request> requests(P);
    for (int src = 0; src < P; ++src) {
      if (queues[src].front().kind == RequestKind::kJoin) {
        requests[src].kind = RequestKind::kJoin;  // stays queued: the joined rank's placeholder
        continue;
      }
      requests[src] = std::move(queues[src].front());
      queues[src].pop_front();
    }
    run_collective(requests);
    again = worked = true;
  }
  return worked;
}

void detail::ClientState::run_collective(std::vector<Request>& requests) {
  const int P = size();
  auto joined = [&](int src) { return requests[src].kind == RequestKind::kJoin; };
  int first = 0;
  while (joined(first)) ++first;
  const RequestKind kind = intended(requests[first]);
  for (int src = first + 1; src < P; ++src) {
    if (joined(src)) continue;
    if (requests[src].seq != requests[first].seq || intended(requests[src]) != kind) {
      fail("hybridsync: ranks called different PS operations: rank " + std::to_string(first) + " called " +
           called(requests[first]) + " (its PS call #" + std::to_string(requests[first].seq) + "), rank " +
           std::to_string(src) + " called " + called(requests[src]) + " (its PS call #" +
           std::to_string(requests[src].seq) +
           "); every rank must make the same PS calls in the same order (uneven data? see hvd.join())");
    }
  }
  std::vector<ErrorNote> errors;
  for (int src = 0; src < P; ++src) {
    if (requests[src].kind == RequestKind::kError) errors.push_back(error_of(requests[src], src));
  }
  const int64_t seq = requests[first].seq;
  switch (kind) {
    case RequestKind::kPull:
      serve_pulls(requests, errors);
      return;
    case RequestKind::kPush:
    case RequestKind::kPushUpdates:
      apply_push_round(requests, errors, kind == RequestKind::kPushUpdates);
      return;
    case RequestKind::kAddTable:
    case RequestKind::kDropTable:
      for (int src = 0; src < P; ++src) {
        if (joined(src) && errors.empty()) {
          errors.push_back(ErrorNote{src, false, "rank " + std::to_string(src) + " has joined (hvd.join()): tables "
                                     "cannot be added or dropped until every rank has joined", ""});
        }
      }
      if (kind == RequestKind::kAddTable) {
        finish_add_table(requests, errors);
        return;
      }
      if (errors.empty()) {
        Reader r(requests[rank()].msg);
        r.i64();
        r.i64();
        Table& t = *tables.at(static_cast<size_t>(r.i64()));
        t.shard.reset();
        t.sums = RowAggregator{};
        t.dropped = true;
      }
      break;
    case RequestKind::kBarrier:
      break;
    case RequestKind::kRescaleAccumulators:
      rescale_round(requests, &errors);
      break;
    default:
      fail("hybridsync: a peer sent an unknown PS operation");
  }
  for (int dest = 0; dest < P; ++dest) {  // barrier, drop_table, rescale: an answer that says only what failed
    if (joined(dest)) continue;
    Writer w;
    reply_head(w, dest, kind, seq, errors);
    reply(dest, w);
  }
}

void detail::ClientState::rescale_round(std::vector<Request>& requests, std::vector<ErrorNote>* errors) {
  if (!errors->empty()) return;  // a rank's input was bad: no row changes anywhere
  // Every rank that takes part must ask for the same thing, to the bit: the factor is computed on
  // each rank, and shards rescaled by different factors would train apart silently.
  int first = -1;
  for (int src = 0; src < size(); ++src) {
    if (requests[src].kind == RequestKind::kJoin) continue;
    if (first < 0) {
      first = src;
    } else if (requests[src].msg.size() != requests[first].msg.size() ||
               std::memcmp(requests[src].msg.data() + 2 * sizeof(int64_t), requests[first].msg.data() + 2 * sizeof(int64_t),
                           requests[src].msg.size() - 2 * sizeof(int64_t)) != 0) {
      errors->push_back(ErrorNote{src, false, "rescale_accumulators: rank " + std::to_string(src) +
                                                  " asked for other tables or another factor than rank " +
                                                  std::to_string(first) + " (every rank must pass the same, bit for bit)",
                                  ""});
      return;
    }
  }
  Reader r(requests[first].msg);
  r.i64();
  r.i64();
  const auto factor = static_cast<float>(r.f64());
  const size_t n = r.count(r.i64(), sizeof(int64_t));
  const int64_t start = tracer.start();
  int64_t rows = 0;
  for (size_t i = 0; i < n; ++i) {
    Table& t = table_at(static_cast<int>(r.i64()));
    if (!t.shard || t.shard->rule().accumulating_slots().empty()) continue;
    try {
      if (t.dynamic) {
        t.dynamic->rescale_accumulators(*t.shard, factor);
        rows += t.dynamic->stored();
      } else if (t.tiered) {
        t.tiered->rescale_accumulators(*t.shard, factor);
        rows += t.tiered->rows();
      } else {
        t.shard->rescale_accumulators(t.shard->rows(), factor);
        rows += t.shard->rows();
      }
    } catch (const PSError& e) {  // a disk tier that cannot be read or rewritten
      errors->push_back(ErrorNote{rank(), false, e.what(), ""});
    }
  }
  tracer.record("rescale accumulators", start, rows);
}

void detail::ClientState::finish_join() {
  restart_bounded_clocks();  // every push sent before the joins is applied here by now
  int64_t newest = 0;
  for (const auto& queue : queues) newest = std::max(newest, queue.front().seq);
  for (int dest = 0; dest < size(); ++dest) {
    Writer w;
    reply_head(w, dest, RequestKind::kJoin, queues[dest].front().seq, {});
    w.i64(newest);
    reply(dest, w);
    queues[dest].pop_front();
  }
}

void detail::ClientState::serve_pulls(std::vector<Request>& requests, const std::vector<ErrorNote>& given) {
  const int64_t start = tracer.start();
  int64_t served_rows = 0;
  auto dim_of = [&](int table) { return table_at(table).spec.dim; };
  std::vector<ErrorNote> errors = given;
  // A dynamic table's prefetch leaves its rows' positions: the reads below need not look them up
  // again (every rank's rows in request order; nothing changes the shard in between).
  std::map<int, std::vector<int64_t>> prefetched;
  std::map<int, size_t> prefetched_used;
  if (errors.empty()) prefetch_pulls(requests, &errors, &prefetched);
  for (int src = 0; src < size(); ++src) {
    if (requests[src].kind == RequestKind::kJoin) continue;
    Writer w;
    reply_head(w, src, RequestKind::kPull, requests[src].seq, errors);
    if (errors.empty()) {
      Reader r(requests[src].msg);
      r.i64();
      r.i64();
      std::vector<Entry> entries = read_entries(r, false, nullptr, dim_of);
      // Statistics of the newest round of each table held here, then the rows.
      int64_t held = 0;
      for (const Entry& e : entries) held += table_at(e.table).shard ? 1 : 0;
      w.i64(held);
      for (const Entry& e : entries) {
        const Table& t = table_at(e.table);
        if (!t.shard) continue;
        w.i64(e.table);
        w.i64(t.last_round.round);
        w.i64(t.last_round.ranks);
        w.f64(t.last_round.local_sq);
        w.f64(t.last_round.combined_sq);
        w.i64(t.last_round.rows);
        w.i64(t.last_round.pushed);
      }
      int64_t floats = 0;
      for (const Entry& e : entries) floats += e.rows.n * dim_of(e.table);
      w.reserve(static_cast<size_t>(floats) * sizeof(float) + 4096);
      for (const Entry& e : entries) {
        Table& t = table_at(e.table);
        check_rows(t, e.rows.rows, e.rows.n, "pull");
        const int64_t* at = nullptr;
        if (auto it = prefetched.find(e.table); it != prefetched.end()) {
          size_t& used = prefetched_used[e.table];
          if (used + static_cast<size_t>(e.rows.n) <= it->second.size()) at = it->second.data() + used;
          used += static_cast<size_t>(e.rows.n);
        }
        if (e.rows.n) {
          gather_wire(t, e.rows.rows, e.rows.n, w.bytes_slot(static_cast<size_t>(e.rows.n * t.shard->row_size())), at);
        }
        served_rows += e.rows.n;
      }
    }
    reply(src, w);
  }
  tracer.record("serve pulls", start, served_rows);
}

void detail::ClientState::prefetch_pulls(std::vector<Request>& requests, std::vector<ErrorNote>* errors,
                                        std::map<int, std::vector<int64_t>>* positions) {
  // Every rank's rows of each table with a disk tier, brought into memory at once (and rows not
  // needed moved to disk to make room): the push that follows finds them there. A tier that
  // fails (a full disk, a missing file) fails this pull on every rank, before any row changes.
  auto dim_of = [&](int table) { return table_at(table).spec.dim; };
  std::map<int, std::vector<int64_t>> wanted;
  for (int src = 0; src < size(); ++src) {
    if (requests[src].kind == RequestKind::kJoin) continue;
    Reader r(requests[src].msg);
    r.i64();
    r.i64();
    for (const Entry& e : read_entries(r, false, nullptr, dim_of)) {
      Table& t = table_at(e.table);
      if (!t.tiered && !(t.dynamic && t.dynamic->disk())) continue;
      check_rows(t, e.rows.rows, e.rows.n, "pull");
      wanted[e.table].insert(wanted[e.table].end(), e.rows.rows, e.rows.rows + e.rows.n);
    }
  }
  for (auto& [table, rows] : wanted) {
    const int64_t start = tracer.start();
    Table& t = *tables[static_cast<size_t>(table)];
    try {
      std::vector<int64_t>* at = t.dynamic ? &(*positions)[table] : nullptr;
      prefetch_rows(t, rows.data(), static_cast<int64_t>(rows.size()), at);
      if (at && at->size() != rows.size()) positions->erase(table);  // (none given: the reads look up)
    } catch (const PSError& e) {
      positions->clear();
      errors->push_back(ErrorNote{rank(), false, e.what(), ""});
      return;
    }
    tracer.record("tier prefetch", start, static_cast<int64_t>(rows.size()));
  }
}

void detail::ClientState::apply_to_table(Table& t, const std::vector<GradientRows>& sources, float scale, double lr,
                                  int64_t round, int ranks) {
  if (lr >= 0) t.shard->rule().set_hyperparameter("lr", lr);
  if (t.dynamic) {
    t.sums.sum(t.spec.dim, sources, scale);
    t.dynamic->step(t.shard, t.sums.rows(), t.sums.size(), t.sums.sums());
  } else if (t.tiered) {
    t.sums.sum(t.spec.dim, sources, scale);
    t.tiered->apply(*t.shard, t.sums.rows(), t.sums.size(), t.sums.sums());
  } else {
    t.sums.step(*t.shard, sources, scale);
  }
  int64_t pushed = 0;
  for (const GradientRows& s : sources) pushed += s.n;
  t.last_round = RoundStats{round, t.sums.local_sq(), t.sums.combined_sq(), ranks, t.sums.size(), pushed};
}

void detail::ClientState::apply_push_round(std::vector<Request>& requests, const std::vector<ErrorNote>& errors,
                                    bool with_updates) {
  const int P = size();
  int64_t seq = -1;
  for (const Request& q : requests) seq = std::max(seq, q.seq);  // (a joined rank's placeholder has none)
  const int64_t start = tracer.start();
  int64_t applied_rows = 0;
  std::map<int, int64_t> changed;  // table -> rows applied here
  if (errors.empty()) {
    auto dim_of = [&](int table) { return table_at(table).spec.dim; };
    std::map<int, std::vector<GradientRows>> by_table;  // ordered: deterministic apply order
    std::map<int, double> lr;
    std::map<int, int> ranks;
    float scale = 1.0f;
    for (int src = P - 1; src >= 0; --src) {  // sources in rank order below; rank 0's scale and lr win
      if (requests[src].kind == RequestKind::kJoin) continue;
      Reader r(requests[src].msg);
      r.i64();
      r.i64();
      for (const Entry& e : read_entries(r, true, &scale, dim_of)) {
        Table& t = table_at(e.table);
        check_rows(t, e.rows.rows, e.rows.n, "push");
        if (e.lr >= 0) lr[e.table] = e.lr;
        ++ranks[e.table];
      }
    }
    for (int src = 0; src < P; ++src) {  // a deterministic sum order
      if (requests[src].kind == RequestKind::kJoin) continue;
      Reader r(requests[src].msg);
      r.i64();
      r.i64();
      float ignored;
      for (const Entry& e : read_entries(r, true, &ignored, dim_of)) by_table[e.table].push_back(e.rows);
    }
    for (auto& [table, sources] : by_table) {
      Table& t = *tables[table];
      if (!t.shard) continue;
      auto it = lr.find(table);
      try {
        apply_to_table(t, sources, scale, it == lr.end() ? -1.0 : it->second, seq, ranks[table]);
      } catch (const PSError& e) {
        // This shard's part of the round failed before changing a row (a disk tier that cannot
        // take or give rows): every rank hears of it with this server's next answer.
        for (int dest = 0; dest < P; ++dest) deferred[dest].push_back(ErrorNote{rank(), false, e.what(), "push"});
        continue;
      }
      changed[table] = t.sums.size();
      applied_rows += t.sums.size();
    }
  } else if (!with_updates) {
    // Nobody waits for a plain push: its failure is told with this server's next answer to each.
    for (int dest = 0; dest < P; ++dest) {
      for (ErrorNote e : errors) {
        e.op = "push";
        if (e.rank != dest) deferred[dest].push_back(std::move(e));  // the rank at fault already threw
      }
    }
  }
  tracer.record("server apply", start, applied_rows);
  if (!with_updates) return;
  // Every shard tells every rank which rows changed, so all replicas stay identical.
  Writer body;
  body.i64(static_cast<int64_t>(changed.size()));
  for (const auto& [table, n] : changed) {
    Table& t = *tables[table];
    body.i64(table);
    body.i64(n);
    body.i64(t.last_round.round);
    body.i64(t.last_round.ranks);
    body.f64(t.last_round.local_sq);
    body.f64(t.last_round.combined_sq);
    body.i64(t.last_round.rows);
    body.i64(t.last_round.pushed);
    for (int64_t k = 0; k < n; ++k) body.i64(t.part.global_id(rank(), t.sums.rows()[k]));
    gather_rows(t, t.sums.rows(), n, body.f32_slot(static_cast<size_t>(n * t.spec.dim)));
  }
  const std::vector<char> payload = body.take();
  for (int dest = 0; dest < P; ++dest) {
    if (requests[dest].kind == RequestKind::kJoin) continue;
    Writer w;
    reply_head(w, dest, RequestKind::kPushUpdates, seq, errors);
    if (errors.empty()) {
      std::vector<char> head = w.take();
      head.insert(head.end(), payload.begin(), payload.end());
      transport->send(dest, kTagReply, std::move(head));
    } else {
      reply(dest, w);
    }
  }
}

void detail::ClientState::finish_add_table(std::vector<Request>& requests, std::vector<ErrorNote> errors) {
  const int P = size();
  std::vector<std::string> described(P);
  for (int src = 0; src < P; ++src) {
    if (requests[src].kind == RequestKind::kError || requests[src].kind == RequestKind::kJoin) continue;
    Reader r(requests[src].msg);
    r.i64();
    r.i64();
    described[src] = r.text();
  }
  if (errors.empty()) {
    for (int src = 1; src < P; ++src) {
      if (described[src] != described[0]) {
        errors.push_back(ErrorNote{src, false, "PS table #" + std::to_string(tables.size()) +
                                                   " differs between ranks: rank 0 has " + described[0] + ", rank " +
                                                   std::to_string(src) + " has " + described[src] +
                                                   " (every rank must build the same model)",
                                       ""});
        break;
      }
    }
  }
  if (errors.empty()) {
    tables.push_back(std::move(adding));
  }
  adding.reset();
  for (int dest = 0; dest < P; ++dest) {
    if (requests[dest].kind == RequestKind::kJoin) continue;
    Writer w;
    reply_head(w, dest, RequestKind::kAddTable, requests[dest].seq, errors);
    reply(dest, w);
  }
}

void detail::ClientState::serve_one_sided(int source, const Request& request) {
  Reader r(request.msg);
  r.i64();
  r.i64();
  if (request.kind == RequestKind::kReadStep || request.kind == RequestKind::kWriteStep) {
    serve_step(source, request, r);
    return;
  }
  if (request.kind == RequestKind::kReadDynamic || request.kind == RequestKind::kWriteDynamic) {
    serve_dynamic(source, request, r);
    return;
  }
  if (request.kind == RequestKind::kBoundedPush || request.kind == RequestKind::kBoundedPull ||
      request.kind == RequestKind::kBoundedError) {
    serve_bounded(source, request);
    return;
  }
  const int table = static_cast<int>(r.i64());
  const int slot = static_cast<int>(r.i64());
  RowsAsked asked = read_rows_asked(r);
  const RowsAsked handed = {asked.by, asked.begin, asked.n, asked.readers, {}};
  std::vector<int64_t> rows;
  Writer w;
  std::string error;
  const int64_t start = tracer.start();
  Table* t = nullptr;
  try {
    t = &table_at(table);
    if (t->shard && slot >= t->shard->num_slots()) {
      throw PSError("table '" + t->spec.name + "': optimizer '" + t->spec.rule + "' has no state slot " +
                    std::to_string(slot));
    }
    rows = rows_of(std::move(asked), *t, operation_name(request.kind));
    check_rows(*t, rows.data(), static_cast<int64_t>(rows.size()), operation_name(request.kind));
  } catch (const PSTransportError&) {
    throw;
  } catch (const PSError& e) {
    error = e.what();
  }
  std::vector<ErrorNote> errors;
  if (!error.empty()) errors.push_back(ErrorNote{source, false, error, ""});
  const auto n = static_cast<int64_t>(rows.size());
  if (request.kind == RequestKind::kRead) {
    write_reply_head(w, request.kind, request.seq, errors);  // deferred push errors wait for a collective
    try {
      if (error.empty() && n && slot < 0) {  // rows as stored (16-bit ones stay 16-bit on the wire)
        gather_wire(*t, rows.data(), n, w.bytes_slot(static_cast<size_t>(n * t->shard->row_size())));
      } else if (error.empty() && n) {
        gather_rows(*t, rows.data(), n, w.f32_slot(static_cast<size_t>(n * t->spec.dim)), slot);
      }
    } catch (const PSError& e) {  // a disk tier that cannot be read: the reader's error
      Writer failed;
      write_reply_head(failed, request.kind, request.seq, {ErrorNote{source, false, e.what(), ""}});
      w = std::move(failed);
      error = e.what();
    }
    if (error.empty() && handed.by == RowsBy::kRangeHandOver) hand_over(*t, slot, handed.begin, handed.n, handed.readers);
    tracer.record("serve reads", start, n);
  } else {
    if (error.empty() && n) {
      const float* values = r.f32s(n, t->spec.dim);
      try {
        if (t->dynamic) {
          t->dynamic->write(t->shard, rows.data(), n, values, slot);
        } else {
          scatter_rows(*t, rows.data(), n, values, slot);
        }
      } catch (const PSError& e) {  // a full dynamic shard, a disk tier that failed: the writer's error
        errors.push_back(ErrorNote{source, false, e.what(), ""});
      }
    }
    write_reply_head(w, request.kind, request.seq, errors);
    tracer.record("serve writes", start, n);
  }
  reply(source, w);
}

// A hand-over read of `n` rows from `begin` was served: once all `readers` have had them, the
// shard's memory for them goes back to the system (the table is dropped after the read).
void detail::ClientState::hand_over(Table& t, int slot, int64_t begin, int64_t n, int64_t readers) {
  int64_t& served = t.handed_over[{slot, begin}];
  if (++served < readers) return;
  t.handed_over.erase({slot, begin});
  if (!t.tiered && !t.dynamic) t.shard->release(slot, begin, n);  // (a tier's arena is reused, not freed)
}

void detail::ClientState::serve_step(int source, const Request& request, Reader& r) {
  const int table = static_cast<int>(r.i64());
  std::vector<ErrorNote> errors;
  int64_t step = -1;
  try {
    Table& t = table_at(table);
    if (request.kind == RequestKind::kWriteStep) {
      const int64_t value = r.i64();
      if (t.shard) t.shard->rule().set_step(value);
    }
    step = t.shard ? t.shard->rule().step() : -1;
  } catch (const PSError& e) {
    errors.push_back(ErrorNote{source, false, e.what(), ""});
  }
  Writer w;
  write_reply_head(w, request.kind, request.seq, errors);
  w.i64(step);
  reply(source, w);
}

}  // namespace hybridsync
