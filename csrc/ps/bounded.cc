// Bounded staleness (stale synchronous parallel): tables whose pulls may miss at most the other
// ranks' last k pushes, so a slow rank holds the others back only once it is k steps behind.
//
// A push of such a table is one-sided: each shard applies a rank's rows as soon as they arrive
// (no round waits for the other ranks) and counts them -- applied[source], the source's clock as
// this shard knows it. A pull carries the puller's clock c (its own pushes of the table so far)
// and k; a shard serves it once every other rank's clock there is at least c - k (ranks that
// joined, hvd.join(), excepted), so its rows miss at most k steps of any rank. Until then the
// pull stays at the front of the puller's queue, held, while everything else is served. The
// puller's own pushes reached each shard before its pull, in the same first-in-first-out queue:
// they are always in its rows. Each reply tells how many steps its rows missed (the lag).
// A barrier (checkpoints, shutdown) runs after every push sent before it, bounded or not, so a
// save loses nothing in flight. The worker side (requests, replies) is in exchange.cc.
#include <algorithm>

#include "client_impl.h"

namespace hybridsync {
namespace {

struct BoundedPullEntry {
  int table;
  int64_t n, clock, bound;
  const int64_t* rows;
};

// A request's body after its kind and number.
Reader body_of(const Request& request) {
  Reader r(request.msg);
  r.i64();
  r.i64();
  return r;
}

std::vector<BoundedPullEntry> read_bounded_pull(Reader& r) {
  const int64_t n = r.i64();
  std::vector<BoundedPullEntry> entries(r.count(n, 4 * sizeof(int64_t)));  // (table, n, clock, bound)
  for (auto& e : entries) {
    e.table = static_cast<int>(r.i64());
    e.n = r.i64();
    e.clock = r.i64();
    e.bound = r.i64();
  }
  for (auto& e : entries) e.rows = r.i64_view(r.count(e.n, sizeof(int64_t)));
  return entries;
}

int64_t applied_of(const Table& t, int source) {
  return t.bounded.applied.empty() ? 0 : t.bounded.applied[static_cast<size_t>(source)];
}

}  // namespace

bool detail::ClientState::is_bounded(int table) const {
  if (size() == 1 || table < 0 || table >= static_cast<int>(tables.size())) return false;
  const Table& t = *tables[static_cast<size_t>(table)];
  return !t.dropped && t.bounded.staleness > 0;
}

// Steps of the other ranks that rows of `t` read here now would miss, for a puller at `clock`.
static int64_t lag_here(const detail::ClientState& c, const Table& t, int source, int64_t clock) {
  int64_t lag = 0;
  for (int s = 0; s < c.size(); ++s) {
    if (s == source) continue;
    const auto& queue = c.queues[static_cast<size_t>(s)];
    if (!queue.empty() && queue.front().kind == RequestKind::kJoin) continue;  // joined: pushes no more
    lag = std::max(lag, clock - applied_of(t, s));
  }
  return lag;
}

bool detail::ClientState::ready_to_serve(int source, const Request& request) const {
  if (request.kind != RequestKind::kBoundedPull) return true;
  Reader r = body_of(request);
  for (const BoundedPullEntry& e : read_bounded_pull(r)) {
    if (e.n == 0 || e.table < 0 || e.table >= static_cast<int>(tables.size())) continue;  // (errors: when served)
    const Table& t = *tables[static_cast<size_t>(e.table)];
    if (t.shard && lag_here(*this, t, source, e.clock) > e.bound) {
      request.held = true;
      return false;
    }
  }
  return true;
}

void detail::ClientState::serve_bounded(int source, const Request& request) {
  Reader r = body_of(request);
  auto dim_of = [&](int table) { return table_at(table).spec.dim; };
  const int64_t start = tracer.start();
  int64_t rows = 0;
  if (request.kind == RequestKind::kBoundedPush) {
    float scale = 1.0f;
    for (const Entry& e : read_entries(r, true, &scale, dim_of)) {
      Table& t = table_at(e.table);
      if (!t.shard) continue;
      check_rows(t, e.rows.rows, e.rows.n, "push");
      try {
        apply_to_table(t, {e.rows}, scale, e.lr, request.seq, 1);  // this rank's rows alone: a round of its own
      } catch (const PSError& error) {  // (a disk tier failed; no row changed): every rank hears of it
        for (int dest = 0; dest < size(); ++dest) {
          deferred[static_cast<size_t>(dest)].push_back(ErrorNote{rank(), false, error.what(), "push"});
        }
      }
      if (t.bounded.applied.empty()) t.bounded.applied.assign(static_cast<size_t>(size()), 0);
      ++t.bounded.applied[static_cast<size_t>(source)];
      rows += e.rows.n;
    }
    tracer.record("server apply (bounded)", start, rows);
    return;  // nobody waits for a push
  }
  if (request.kind == RequestKind::kBoundedError) {
    serve_bounded_error(source, request);
    return;
  }
  const std::vector<BoundedPullEntry> entries = read_bounded_pull(r);
  std::vector<ErrorNote> errors;
  for (const BoundedPullEntry& e : entries) {  // (tables with a disk tier: the rows into memory first)
    Table& t = table_at(e.table);
    check_rows(t, e.rows, e.n, "pull");
    try {
      if (e.n) prefetch_rows(t, e.rows, e.n);
    } catch (const PSError& error) {
      errors.push_back(ErrorNote{rank(), false, error.what(), ""});
      break;
    }
  }
  Writer w;
  reply_head(w, source, RequestKind::kBoundedPull, request.seq, errors);
  if (!errors.empty()) {
    reply(source, w);
    return;
  }
  w.i64(request.held ? 1 : 0);
  for (const BoundedPullEntry& e : entries) {
    const Table& t = table_at(e.table);
    w.i64(e.n > 0 && t.shard ? lag_here(*this, t, source, e.clock) : -1);
  }
  for (const BoundedPullEntry& e : entries) {
    Table& t = table_at(e.table);
    if (e.n) gather_wire(t, e.rows, e.n, w.bytes_slot(static_cast<size_t>(e.n * t.shard->row_size())));
    rows += e.n;
  }
  reply(source, w);
  tracer.record("serve pulls (bounded)", start, rows);
}

// A bounded push that failed at its sender (exchange.cc): its step counts, as a push without
// rows; the other ranks learn of it with this shard's next answer to each (the sender raised
// it already). Every shard tells, so a rank raises it once (first_telling).
void detail::ClientState::serve_bounded_error(int source, const Request& request) {
  Reader r = body_of(request);
  const int64_t n = r.i64();
  std::vector<int64_t> listed = r.i64s(r.count(n, sizeof(int64_t)));
  ErrorNote note;
  note.rank = source;
  note.index_error = r.i64() != 0;
  note.message = r.text();
  note.op = operation_name(RequestKind::kBoundedError);
  note.id = request.seq;
  for (const int64_t table : listed) {
    Table& t = table_at(static_cast<int>(table));
    if (!t.shard) continue;
    if (t.bounded.applied.empty()) t.bounded.applied.assign(static_cast<size_t>(size()), 0);
    ++t.bounded.applied[static_cast<size_t>(source)];
  }
  for (int dest = 0; dest < size(); ++dest) {
    if (dest != source) deferred[static_cast<size_t>(dest)].push_back(note);
  }
}

void detail::ClientState::read_bounded_reply(Reader& r, const std::vector<Routed>& routed, std::vector<int64_t>* lag,
                                      bool* held) {
  *held = r.i64() != 0 || *held;
  for (size_t b = 0; b < routed.size(); ++b) (*lag)[b] = std::max((*lag)[b], r.i64());
}

void detail::ClientState::restart_bounded_clocks() {
  for (auto& t : tables) {
    t->bounded.seen.clock = 0;
    std::fill(t->bounded.applied.begin(), t->bounded.applied.end(), 0);
  }
}

void Client::set_staleness(int table, int k) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Table& t = impl_->table_at(table);
  if (k < 0) throw PSError("table '" + t.spec.name + "': staleness must be >= 0, got " + std::to_string(k));
  if (k > 0 && t.spec.dynamic.on) {  // (its rounds are where rows are admitted and evicted)
    throw PSError("table '" + t.spec.name + "' is dynamic: bounded staleness applies to fixed tables only");
  }
  t.bounded.staleness = k;
}

StalenessStats Client::staleness(int table) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Table& t = impl_->table_at(table);
  StalenessStats out = t.bounded.seen;
  out.staleness = t.bounded.staleness;
  return out;
}

}  // namespace hybridsync
