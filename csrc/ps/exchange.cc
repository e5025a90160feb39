// The Client's collective data operations. Protocol, per operation, on every rank:
//   1. as a worker, send one request to every rank (possibly empty, or an error notice);
//   2. as a server, receive one request from every rank and answer it;
//   3. as a worker, collect the answers.
// Pull()/Push() do step 1 and return a handle; Wait() does steps 2 and 3, so the caller can
// compute while the requests travel. Requests travel in operation order per (source, tag), so
// a server always applies a push before it serves the next pull from any rank. A push that
// returns no updates is applied lazily, at the start of the next operation (in a world of one,
// at once, with no message at all).
#include <cstring>
#include <functional>

#include "client_impl.h"
#include "wire.h"

namespace hybridsync {
namespace {

// One table's entry in a request a server received: its rows (and, for a push, gradients).
struct Entry {
  int table;
  GradientRows rows;
};

// Parses a pull/push request (after its kind) into entries; grads follow all row indices.
std::vector<Entry> read_entries(Reader& r, bool with_grads, const std::function<int64_t(int)>& dim_of) {
  const int64_t n = r.i64();
  std::vector<Entry> entries(static_cast<size_t>(n));
  for (auto& e : entries) {
    e.table = static_cast<int>(r.i64());
    e.rows.n = r.i64();
  }
  for (auto& e : entries) e.rows.rows = r.i64_view(static_cast<size_t>(e.rows.n));
  if (with_grads) {
    for (auto& e : entries) e.rows.grads = r.f32s(static_cast<size_t>(e.rows.n * dim_of(e.table)));
  }
  return entries;
}

// The request a worker sends rank `dest`: header, row positions, then (push) gradient rows.
std::vector<char> write_request(RequestKind kind, const std::vector<Routed>& batches, int dest) {
  size_t bytes = 2 * sizeof(int64_t);
  for (const Routed& b : batches) {
    const int64_t count = b.routing.count(dest);
    bytes += (2 + count) * sizeof(int64_t) + (kind == RequestKind::kPush ? count * b.dim * sizeof(float) : 0);
  }
  Writer w;
  w.reserve(bytes);
  w.i64(static_cast<int64_t>(kind));
  w.i64(static_cast<int64_t>(batches.size()));
  for (const Routed& b : batches) {
    w.i64(b.table);
    w.i64(b.routing.count(dest));
  }
  for (const Routed& b : batches) {
    w.i64s(b.routing.local.data() + b.routing.offset[dest], static_cast<size_t>(b.routing.count(dest)));
  }
  if (kind == RequestKind::kPush) {
    for (const Routed& b : batches) {
      float* out = w.f32_slot(static_cast<size_t>(b.routing.count(dest) * b.dim));
      for (int64_t k = b.routing.offset[dest]; k < b.routing.offset[dest + 1]; ++k, out += b.dim) {
        std::memcpy(out, b.rows + b.routing.order[k] * b.dim, b.dim * sizeof(float));
      }
    }
  }
  return w.take();
}

// A pull in input order in a world of one: rows straight from the shard, which holds them all
// and is current (the pending pushes were applied); no wire, so nothing to deduplicate.
void copy_in_order(const Table& t, const TableBatch& b) {
  check_ids(t.spec.name, b.ids, b.n, t.spec.num_rows);
  thread_local std::vector<int64_t> local;
  local.resize(static_cast<size_t>(b.n));
  for (int64_t i = 0; i < b.n; ++i) local[i] = t.part.local_index(b.ids[i]);
  t.shard->gather(local.data(), b.n, b.out);
}

// Routes every batch of this worker's operation; bad input becomes `error` (announced to the
// peers instead of thrown, so no rank is left waiting). For a push, duplicate ids' gradients
// are added up, so each row crosses the wire once.
std::vector<Routed> route_batches(const Client::Impl& c, const std::vector<TableBatch>& batches, bool with_grads,
                                  std::string* error, bool* index_error) {
  std::vector<Routed> routed;
  if (!error->empty()) return routed;
  try {
    for (const TableBatch& b : batches) {
      const Table& t = c.table_at(b.table);
      const int64_t dim = t.spec.dim;
      if (!with_grads && b.out && c.size() == 1 && t.shard && t.shard->rows() == t.spec.num_rows) {
        copy_in_order(t, b);
        Routed done{b.table, dim, Routing{}, nullptr, {}, nullptr};  // asks the server for nothing
        done.routing.offset.assign(2, 0);
        routed.push_back(std::move(done));
        continue;
      }
      Routed r{b.table, dim, route_ids(t.spec.name, t.part, b.ids, b.n, c.size()), nullptr, {}, b.out};
      const auto& dd = r.routing.dedup;
      if (with_grads && static_cast<int64_t>(dd.unique.size()) == b.n) {
        r.rows = b.grads;  // no duplicates: unique u is input u
      } else if (with_grads) {
        r.summed = sum_duplicates(dd, b.grads, dim);
        r.rows = r.summed.data();
      }
      routed.push_back(std::move(r));
    }
  } catch (const PSIndexError& e) {
    *error = e.what();
    *index_error = true;
  } catch (const PSError& e) {
    *error = e.what();
  }
  return routed;
}

// One request to every rank: the routed rows, or the notice of this rank's bad input.
void send_requests(Transport& transport, RequestKind kind, const std::vector<Routed>& routed,
                   const std::string& error) {
  for (int d = 0; d < transport.size(); ++d) {
    transport.send(d, kTagRequest, error.empty() ? write_request(kind, routed, d) : error_request(error));
  }
}

}  // namespace

std::unique_ptr<InFlight> Client::Impl::start_pull(const std::vector<TableBatch>& batches,
                                                   const std::string& error) {
  auto op = std::make_unique<InFlight>();
  op->handle = next_handle++;
  op->local_error = error;
  op->routed = route_batches(*this, batches, false, &op->local_error, &op->index_error);
  send_requests(*transport, RequestKind::kPull, op->routed, op->local_error);
  return op;
}

std::unique_ptr<InFlight> Client::Impl::start_push(const std::vector<TableBatch>& batches, float scale,
                                                   bool return_updates, const std::string& error) {
  auto op = std::make_unique<InFlight>();
  op->handle = next_handle++;
  op->is_push = true;
  op->return_updates = return_updates;
  op->local_error = error;
  if (size() == 1 && !return_updates) {
    // A world of one has no wire to save and no peer to wait for: no deduplication, message or
    // deferral (the shard's aggregation sums duplicate ids itself). Errors still reach Wait().
    op->applied = true;
    op->round.scale = scale;
    for (const TableBatch& b : batches) {
      if (b.lr >= 0) op->round.lr[b.table] = b.lr;
    }
    try {
      if (op->local_error.empty()) apply_local(batches, op->round);
    } catch (const PSIndexError& e) {
      op->local_error = e.what();
      op->index_error = true;
    } catch (const PSError& e) {
      op->local_error = e.what();
    }
    return op;
  }
  op->routed = route_batches(*this, batches, true, &op->local_error, &op->index_error);
  send_requests(*transport, RequestKind::kPush, op->routed, op->local_error);
  op->round.scale = scale;
  op->round.self_error_reported = !op->local_error.empty();
  if (op->local_error.empty()) {
    for (const TableBatch& b : batches) {
      op->tables.push_back(b.table);
      if (b.lr >= 0) op->round.lr[b.table] = b.lr;
    }
  }
  return op;
}

void Client::Impl::begin_collective() {
  if (in_flight) {
    std::unique_ptr<InFlight> op = std::move(in_flight);
    Finished outcome;
    try {
      outcome.done = finish(*op);
    } catch (const PSTransportError&) {
      throw;  // the Client is unusable: every later call, the owner's Wait too, says so
    } catch (...) {
      outcome.error = std::current_exception();  // the owner's Wait() throws it, not this caller
    }
    finished.emplace(op->handle, std::move(outcome));
  }
  while (!pending.empty()) {
    Round round = pending.front();
    pending.pop_front();
    apply_round(round, nullptr);
  }
}

Client::Handle Client::Pull(const std::vector<TableBatch>& batches, const std::string& error) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& c = *impl_;
  return c.guarded([&] {
    c.begin_collective();
    c.in_flight = c.start_pull(batches, error);
    return c.in_flight->handle;
  });
}

Client::Handle Client::Push(const std::vector<TableBatch>& batches, float scale, bool return_updates,
                            const std::string& error) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& c = *impl_;
  return c.guarded([&] {
    c.begin_collective();
    c.in_flight = c.start_push(batches, scale, return_updates, error);
    return c.in_flight->handle;
  });
}

Completion Client::Wait(Handle handle) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& c = *impl_;
  return c.guarded([&] {
    if (c.in_flight && c.in_flight->handle == handle) {
      std::unique_ptr<InFlight> op = std::move(c.in_flight);
      return c.finish(*op);
    }
    auto it = c.finished.find(handle);
    if (it == c.finished.end()) {
      throw PSError("unknown PS operation handle " + std::to_string(handle) + " (or one already waited for)");
    }
    Finished outcome = std::move(it->second);
    c.finished.erase(it);
    if (outcome.error) std::rethrow_exception(outcome.error);
    return std::move(outcome.done);
  });
}

// The synchronous forms hold the lock from start to finish, so a caller on another thread
// cannot slip an operation in between (which would complete this one on its behalf).
std::vector<PullResult> Client::pull(const std::vector<TableBatch>& batches, const std::string& error) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& c = *impl_;
  return c.guarded([&] {
    c.begin_collective();
    return c.finish(*c.start_pull(batches, error)).pulled;
  });
}

std::vector<RowUpdates> Client::push(const std::vector<TableBatch>& batches, float scale, bool return_updates,
                                     const std::string& error) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& c = *impl_;
  return c.guarded([&] {
    c.begin_collective();
    return c.finish(*c.start_push(batches, scale, return_updates, error)).updates;
  });
}

void Client::flush() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  Impl& c = *impl_;
  c.guarded([&] { c.begin_collective(); });
}

Completion Client::Impl::finish(InFlight& op) { return op.is_push ? finish_push(op) : finish_pull(op); }

Completion Client::Impl::finish_pull(InFlight& op) {
  const int P = size();
  // Serve every worker's request from this rank's shards.
  std::vector<std::string> errors(P);
  auto dim_of = [&](int table) { return table_at(table).spec.dim; };
  int64_t served_rows = 0;
  const int64_t serve_start = tracer.start();
  for (int src = 0; src < P; ++src) {
    auto msg = transport->recv(src, kTagRequest);
    Reader r(msg);
    const auto kind = static_cast<RequestKind>(r.i64());
    Writer reply;
    if (kind == RequestKind::kError) {
      errors[src] = r.text();
    } else if (kind == RequestKind::kPull) {
      std::vector<Entry> entries = read_entries(r, false, dim_of);
      int64_t floats = 0;
      for (const Entry& e : entries) floats += e.rows.n * dim_of(e.table);
      reply.reserve(static_cast<size_t>(floats) * sizeof(float));
      for (const Entry& e : entries) {
        Table& t = table_at(e.table);
        check_rows(t.shard.get(), t.spec.name, e.rows.rows, e.rows.n, "pull");
        if (e.rows.n) t.shard->gather(e.rows.rows, e.rows.n, reply.f32_slot(e.rows.n * t.spec.dim));
        served_rows += e.rows.n;
      }
    } else {
      throw PSTransportError("hybridsync: ranks called different PS operations (pull vs push)");
    }
    transport->send(src, kTagReply, reply.take());
  }
  tracer.record("serve pulls", serve_start, served_rows);
  // Collect the rows this worker asked for: into each batch's unique order, or for a batch
  // with `out`, straight to the first input position of each unique id (copied to the others
  // below), so the rows are copied once.
  std::vector<Routed>& routed = op.routed;
  Completion done;
  done.pulled.resize(routed.size());
  std::vector<std::vector<int64_t>> first(routed.size());  // out: unique u's first input position
  for (size_t b = 0; b < routed.size(); ++b) {
    const Dedup& dd = routed[b].routing.dedup;
    if (!routed[b].out) {
      done.pulled[b].rows.resize(dd.unique.size() * routed[b].dim);
      continue;
    }
    first[b].resize(dd.unique.size());
    int64_t seen = 0;  // uniques are in first-seen order: u first appears where inverse == u
    for (size_t i = 0; i < dd.inverse.size(); ++i) {
      if (dd.inverse[i] == seen) first[b][seen++] = static_cast<int64_t>(i);
    }
  }
  for (int d = 0; d < P; ++d) {
    auto msg = transport->recv(d, kTagReply);
    if (!op.local_error.empty() || !errors[d].empty()) continue;
    Reader r(msg);
    for (size_t b = 0; b < routed.size(); ++b) {
      const Routing& rt = routed[b].routing;
      const int64_t dim = routed[b].dim;
      const float* rows = r.f32s(static_cast<size_t>(rt.count(d) * dim));
      float* out = routed[b].out;
      for (int64_t k = rt.offset[d]; k < rt.offset[d + 1]; ++k, rows += dim) {
        float* dst = out ? out + first[b][rt.order[k]] * dim : done.pulled[b].rows.data() + rt.order[k] * dim;
        std::memcpy(dst, rows, dim * sizeof(float));
      }
    }
  }
  if (!op.local_error.empty()) {
    if (op.index_error) throw PSIndexError(op.local_error);
    throw PSError(op.local_error);
  }
  throw_remote(errors, rank(), "pull");
  for (size_t b = 0; b < routed.size(); ++b) {
    Dedup& dd = routed[b].routing.dedup;
    if (float* out = routed[b].out) {  // duplicates: from the first position that got the row
      const int64_t dim = routed[b].dim;
      for (size_t i = 0; i < dd.inverse.size(); ++i) {
        const int64_t from = first[b][dd.inverse[i]];
        if (from != static_cast<int64_t>(i)) std::memcpy(out + i * dim, out + from * dim, dim * sizeof(float));
      }
    }
    done.pulled[b].unique = std::move(dd.unique);
    done.pulled[b].inverse = std::move(dd.inverse);
  }
  return done;
}

Completion Client::Impl::finish_push(InFlight& op) {
  Completion done;
  if (op.applied) {
    // nothing left to apply
  } else if (!op.return_updates) {
    pending.push_back(op.round);  // applied at the start of the next operation
  } else {
    std::map<int, RowUpdates> updates;
    apply_round(op.round, &updates);
    for (int table : op.tables) done.updates.push_back(std::move(updates[table]));
  }
  if (!op.local_error.empty()) {
    if (op.index_error) throw PSIndexError(op.local_error);
    throw PSError(op.local_error);
  }
  return done;
}

void Client::Impl::apply_local(const std::vector<TableBatch>& batches, const Round& round) {
  // Every id is checked before any row changes (all-or-nothing, as for a round over the wire).
  std::vector<std::vector<int64_t>> local(batches.size());
  std::map<int, std::vector<GradientRows>> by_table;  // ordered: the apply order of a round
  for (size_t b = 0; b < batches.size(); ++b) {
    const TableBatch& batch = batches[b];
    const Table& t = table_at(batch.table);
    check_ids(t.spec.name, batch.ids, batch.n, t.spec.num_rows);
    local[b].resize(static_cast<size_t>(batch.n));
    for (int64_t i = 0; i < batch.n; ++i) local[b][i] = t.part.local_index(batch.ids[i]);
    by_table[batch.table].push_back(GradientRows{local[b].data(), batch.n, batch.grads});  // empty ones too: a step
  }
  const int64_t start = tracer.start();
  int64_t applied_rows = 0;
  for (auto& [table, sources] : by_table) {
    Table& t = *tables[table];
    auto lr = round.lr.find(table);
    if (lr != round.lr.end()) t.shard->rule().set_hyperparameter("lr", lr->second);
    t.sums.step(*t.shard, sources, round.scale);
    applied_rows += t.sums.size();
  }
  tracer.record("server apply", start, applied_rows);
}

void Client::Impl::apply_round(const Round& round, std::map<int, RowUpdates>* updates) {
  const int P = size();
  const int64_t start = tracer.start();
  int64_t applied_rows = 0;
  auto dim_of = [&](int table) { return table_at(table).spec.dim; };
  std::vector<std::vector<char>> msgs(P);
  std::map<int, std::vector<GradientRows>> by_table;  // ordered: deterministic apply order
  std::vector<std::string> errors(P);
  for (int src = 0; src < P; ++src) {  // sources in rank order: a deterministic sum order
    msgs[src] = transport->recv(src, kTagRequest);
    Reader r(msgs[src]);
    const auto kind = static_cast<RequestKind>(r.i64());
    if (kind == RequestKind::kError) {
      errors[src] = r.text();
      continue;
    }
    if (kind != RequestKind::kPush) {
      throw PSTransportError("hybridsync: ranks called different PS operations (push vs pull)");
    }
    for (const Entry& e : read_entries(r, true, dim_of)) {
      Table& t = table_at(e.table);
      check_rows(t.shard.get(), t.spec.name, e.rows.rows, e.rows.n, "push");
      by_table[e.table].push_back(e.rows);
    }
  }
  bool failed = false;
  for (int src = 0; src < P; ++src) failed = failed || !errors[src].empty();
  // All-or-nothing: a round with any bad input changes no row on any shard.
  std::map<int, int64_t> changed;  // table -> rows summed
  for (auto& [table, sources] : by_table) {
    Table& t = *tables[table];
    if (!t.shard || failed) continue;
    auto lr = round.lr.find(table);
    if (lr != round.lr.end()) t.shard->rule().set_hyperparameter("lr", lr->second);
    t.sums.step(*t.shard, sources, round.scale);
    changed[table] = t.sums.size();
    applied_rows += t.sums.size();
  }
  tracer.record("server apply", start, applied_rows);
  if (updates) {
    // Every shard tells every rank which rows changed, so all replicas stay identical.
    Writer w;
    w.i64(static_cast<int64_t>(changed.size()));
    for (const auto& [table, n] : changed) {
      Table& t = *tables[table];
      w.i64(table);
      w.i64(n);
      for (int64_t k = 0; k < n; ++k) w.i64(t.part.global_id(rank(), t.sums.rows()[k]));
      t.shard->gather(t.sums.rows(), n, w.f32_slot(static_cast<size_t>(n * t.spec.dim)));
    }
    std::vector<char> payload = w.take();
    for (int d = 0; d < P; ++d) transport->send(d, kTagUpdates, payload);
    for (int src = 0; src < P; ++src) {
      auto msg = transport->recv(src, kTagUpdates);
      Reader r(msg);
      const int64_t n = r.i64();
      for (int64_t k = 0; k < n; ++k) {
        const int table = static_cast<int>(r.i64());
        const int64_t count = r.i64();
        const int64_t dim = table_at(table).spec.dim;
        const std::vector<int64_t> ids = r.i64s(static_cast<size_t>(count));
        const float* rows = r.f32s(static_cast<size_t>(count * dim));
        RowUpdates& u = (*updates)[table];
        u.ids.insert(u.ids.end(), ids.begin(), ids.end());
        u.rows.insert(u.rows.end(), rows, rows + count * dim);
      }
    }
  }
  if (!round.self_error_reported) throw_remote(errors, rank(), "push");
}

}  // namespace hybridsync
