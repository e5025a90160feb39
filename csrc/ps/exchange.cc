// The Client's per-step collectives, worker side: pull and push. Each sends one request to
// every rank (possibly empty, or the notice of this rank's bad input, so no rank waits for
// data that will not come) and, where the caller needs an answer, collects one reply from each
// while driving this rank's own server (server.cc). A plain push returns at once: the shards
// apply it as soon as every rank's part is in, before any later operation's request.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "client_impl.h"

namespace hybridsync {
namespace {

// The request a worker sends rank `dest`: head, batches, row positions, then (push) gradient rows.
std::vector<char> write_request(RequestKind kind, int64_t seq, const std::vector<Routed>& batches, int dest,
                                float scale, const std::vector<double>& lrs) {
  const bool push = kind != RequestKind::kPull && kind != RequestKind::kBoundedPull;
  const bool bounded_pull = kind == RequestKind::kBoundedPull;
  size_t bytes = 5 * sizeof(int64_t);
  for (const Routed& b : batches) {
    const int64_t count = b.routing.count(dest);
    bytes += (5 + count) * sizeof(int64_t) + (push ? count * b.dim * sizeof(float) : 0);
  }
  Writer w = request_writer(kind, seq);
  w.reserve(bytes);
  w.i64(static_cast<int64_t>(batches.size()));
  if (push) w.f64(scale);
  for (size_t i = 0; i < batches.size(); ++i) {
    w.i64(batches[i].table);
    w.i64(batches[i].routing.count(dest));
    if (push) w.f64(lrs[i]);
    if (bounded_pull) {
      w.i64(batches[i].clock);
      w.i64(batches[i].bound);
    }
  }
  for (const Routed& b : batches) {
    w.i64s(b.routing.local.data() + b.routing.offset[dest], static_cast<size_t>(b.routing.count(dest)));
  }
  if (push) {
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
// and is current (pushes were applied at once); no wire, so nothing to deduplicate.
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
std::vector<Routed> route_batches(const detail::ClientState& c, const std::vector<TableBatch>& batches, bool with_grads,
                                  std::string* error, bool* index_error) {
  std::vector<Routed> routed;
  if (!error->empty()) return routed;
  try {
    for (const TableBatch& b : batches) {
      const Table& t = c.table_at(b.table);
      const int64_t dim = t.spec.dim;
      if (!with_grads && b.out && c.size() == 1 && t.shard && !t.tiered && t.shard->rows() == t.spec.num_rows) {
        copy_in_order(t, b);
        Routed done{b.table, dim, Routing{}, nullptr, {}, nullptr};  // asks the server for nothing
        done.routing.offset.assign(2, 0);
        routed.push_back(std::move(done));
        continue;
      }
      if (!with_grads) {
        Routed r{b.table, dim, route_ids(t.spec.name, t.part, b.ids, b.n, c.size()), nullptr, {}, b.out};
        r.type = row_type_of(t.spec);
        routed.push_back(std::move(r));
        continue;
      }
      // A push: ids deduplicated and their gradients summed in one pass (the input's own rows
      // when no id repeats; the summed buffer's pointer survives the move into Routed). No
      // inverse: nothing maps a push's rows back to its inputs.
      Dedup dd;
      GradientBuffer summed;
      const float* rows =
          deduplicate_and_sum(t.spec.name, b.ids, b.n, t.part.num_rows(), b.grads, dim, &dd.unique, &summed);
      Routed r{b.table, dim, route_unique(std::move(dd), t.part, c.size()), rows, std::move(summed), b.out};
      r.type = row_type_of(t.spec);
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

// Sends every rank its part of the operation, or the notice of this rank's bad input.
void send_requests(detail::ClientState& c, RequestKind kind, int64_t seq, const std::vector<Routed>& routed,
                   const std::string& error, bool index_error, float scale, const std::vector<double>& lrs) {
  for (int d = 0; d < c.size(); ++d) {
    c.send_request(d, error.empty() ? write_request(kind, seq, routed, d, scale, lrs)
                                    : error_request(kind, seq, error, index_error));
  }
}

// Reads the statistics a reply carries for the tables a server holds.
void read_pull_stats(detail::ClientState& c, int source, Reader& r) {
  const int64_t n = r.i64();
  for (int64_t k = 0; k < n; ++k) {
    const int table = static_cast<int>(r.i64());
    RoundStats part;
    part.round = r.i64();
    part.ranks = static_cast<int>(r.i64());
    part.local_sq = r.f64();
    part.combined_sq = r.f64();
    part.rows = r.i64();
    part.pushed = r.i64();
    if (part.round >= 0) c.stats.add(table, c.table_at(table).spec.num_shards, source, part);
  }
}

// Throws bad input of an operation that has no round to announce it in (bounded tables).
void throw_local(const std::string& error, bool index_error) {
  if (index_error) throw PSIndexError(error);
  if (!error.empty()) throw PSError(error);
}

// One pull: a collective round (kPull), or one-sided requests (kBoundedPull) that each shard
// answers once the table's staleness bound allows (bounded.cc).
std::vector<PullResult> pull_round(detail::ClientState& c, RequestKind kind, const std::vector<TableBatch>& batches,
                                   std::string error) {
  const bool bounded = kind == RequestKind::kBoundedPull;
  bool index_error = false;
  std::vector<Routed> routed = route_batches(c, batches, false, &error, &index_error);
  if (bounded) {
    throw_local(error, index_error);
    for (Routed& r : routed) {
      const BoundedState& b = c.tables[static_cast<size_t>(r.table)]->bounded;
      r.clock = b.seen.clock;
      r.bound = b.staleness;
    }
  }
  const auto started = std::chrono::steady_clock::now();
  std::vector<PullResult> done(routed.size());
  const int64_t seq = bounded ? ++c.one_sided_ids : c.next_seq();
  send_requests(c, kind, seq, routed, error, index_error, 1.0f, {});
  // Rows arrive into each batch's unique order, or for a batch with `out`, straight at the
  // first input position of each unique id (copied to the others below), so they are copied once.
  std::vector<std::vector<int64_t>> first(routed.size());  // out: unique u's first input position
  for (size_t b = 0; b < routed.size(); ++b) {
    const Dedup& dd = routed[b].routing.dedup;
    if (!routed[b].out) {
      done[b].rows.resize(dd.unique.size() * routed[b].dim);
      continue;
    }
    first[b].resize(dd.unique.size());
    int64_t seen = 0;  // uniques are in first-seen order: u first appears where inverse == u
    for (size_t i = 0; i < dd.inverse.size(); ++i) {
      if (dd.inverse[i] == seen) first[b][seen++] = static_cast<int64_t>(i);
    }
  }
  std::vector<int64_t> lag(routed.size(), -1);
  bool held = false;
  c.collect_replies(kind, seq, bounded ? "pull (bounded staleness)" : "pull", [&](int d, Reader& r) {
    if (bounded) {
      c.read_bounded_reply(r, routed, &lag, &held);
    } else {
      read_pull_stats(c, d, r);
    }
    for (size_t b = 0; b < routed.size(); ++b) {
      const Routing& rt = routed[b].routing;
      const int64_t dim = routed[b].dim;
      if (rt.count(d) == 0) continue;
      float* out = routed[b].out;
      auto dst_of = [&](int64_t k) {
        return out ? out + first[b][rt.order[k]] * dim : done[b].rows.data() + rt.order[k] * dim;
      };
      if (routed[b].type == RowType::kFloat32) {
        const float* rows = r.f32s(rt.count(d), dim);
        for (int64_t k = rt.offset[d]; k < rt.offset[d + 1]; ++k, rows += dim) {
          std::memcpy(dst_of(k), rows, dim * sizeof(float));
        }
        continue;
      }
      // 16-bit rows (the table stores them so), decoded as they arrive (fields are 4-byte aligned).
      const auto* rows = reinterpret_cast<const uint16_t*>(r.row_bytes(rt.count(d), dim * 2));
      for (int64_t k = rt.offset[d]; k < rt.offset[d + 1]; ++k, rows += dim) decode_row(routed[b].type, rows, dst_of(k), dim);
    }
  });
  for (size_t b = 0; b < routed.size(); ++b) {
    Dedup& dd = routed[b].routing.dedup;
    if (float* out = routed[b].out) {  // duplicates: from the first position that got the row
      const int64_t dim = routed[b].dim;
      for (size_t i = 0; i < dd.inverse.size(); ++i) {
        const int64_t from = first[b][dd.inverse[i]];
        if (from != static_cast<int64_t>(i)) std::memcpy(out + i * dim, out + from * dim, dim * sizeof(float));
      }
    }
    done[b].unique = std::move(dd.unique);
    done[b].inverse = std::move(dd.inverse);
  }
  if (bounded) {  // what the rows missed: counters per table
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    for (size_t b = 0; b < routed.size(); ++b) {
      StalenessStats& seen = c.tables[static_cast<size_t>(routed[b].table)]->bounded.seen;
      const int64_t l = std::max<int64_t>(0, lag[b]);
      ++seen.pulls;
      seen.last_lag = l;
      seen.max_lag = std::max(seen.max_lag, l);
      seen.lag_sum += l;
      seen.held += held ? 1 : 0;
      seen.wait_s += waited;
    }
  }
  return done;
}

// Splits batches into those of synchronous tables and those of bounded ones (with positions).
struct Split {
  std::vector<TableBatch> sync, bounded;
  std::vector<size_t> sync_at, bounded_at;
};

Split split_bounded(const detail::ClientState& c, const std::vector<TableBatch>& batches) {
  Split s;
  for (size_t i = 0; i < batches.size(); ++i) {
    const bool bounded = c.is_bounded(batches[i].table);
    (bounded ? s.bounded : s.sync).push_back(batches[i]);
    (bounded ? s.bounded_at : s.sync_at).push_back(i);
  }
  return s;
}

}  // namespace

std::vector<PullResult> Client::pull(const std::vector<TableBatch>& batches, const std::string& given_error) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  Split split = split_bounded(c, batches);
  if (split.bounded.empty()) return pull_round(c, RequestKind::kPull, batches, given_error);
  // Synchronous tables' round first (it carries this rank's bad input to every rank), then the
  // bounded ones' requests; no collective at all when every table is bounded.
  std::vector<PullResult> done(batches.size());
  if (!split.sync.empty()) {
    std::vector<PullResult> got = pull_round(c, RequestKind::kPull, split.sync, given_error);
    for (size_t k = 0; k < got.size(); ++k) done[split.sync_at[k]] = std::move(got[k]);
  }
  std::vector<PullResult> got = pull_round(c, RequestKind::kBoundedPull, split.bounded, given_error);
  for (size_t k = 0; k < got.size(); ++k) done[split.bounded_at[k]] = std::move(got[k]);
  return done;
}

void detail::ClientState::push_bounded(const std::vector<TableBatch>& batches, float scale, bool alone,
                                       std::string* error, bool* index_error) {
  std::vector<Routed> routed = route_batches(*this, batches, true, error, index_error);
  if (!error->empty() && !alone) return;  // the synchronous round tells every rank; no shard counts a step
  const int64_t id = ++one_sided_ids;
  if (error->empty()) {
    std::vector<double> lrs;
    for (const TableBatch& b : batches) lrs.push_back(b.lr);
    // Every rank gets it, rows or not: each shard counts the step (the clock of the bound).
    for (int d = 0; d < size(); ++d) {
      send_request(d, write_request(RequestKind::kBoundedPush, id, routed, d, scale, lrs));
    }
  } else {
    // No round to carry the error: every shard gets a notice instead of rows (all or nothing: no
    // row changes anywhere), counts the step as if it had come -- so no peer waits at the bound
    // for it -- and tells the other ranks, who raise it at their next operation on the PS.
    Writer w = request_writer(RequestKind::kBoundedError, id);
    w.i64(static_cast<int64_t>(batches.size()));
    for (const TableBatch& b : batches) w.i64(b.table);
    w.i64(*index_error ? 1 : 0);
    w.text(*error);
    const std::vector<char> notice = w.take();
    for (int d = 0; d < size(); ++d) send_request(d, notice);
  }
  for (const TableBatch& b : batches) ++tables[static_cast<size_t>(b.table)]->bounded.seen.clock;
  throw_local(*error, *index_error);
}

bool detail::ClientState::first_telling(const ErrorNote& e) { return e.id < 0 || told.insert({e.rank, e.id}).second; }

std::vector<RowUpdates> Client::push(const std::vector<TableBatch>& batches, float scale, bool return_updates,
                                     const std::string& given_error) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  if (c.size() == 1 && !return_updates) {
    // A world of one has no wire to save and no peer to wait for: no deduplication, message or
    // deferral (the shard's aggregation sums duplicate ids itself).
    if (!given_error.empty()) throw PSError(given_error);
    c.apply_local(batches, scale);
    return {};
  }
  Split split = split_bounded(c, batches);
  std::string error = given_error;
  bool index_error = false;
  if (!split.bounded.empty()) {
    if (return_updates) {
      throw PSError("push(return_updates=True): table '" + c.table_at(split.bounded[0].table).spec.name +
                    "' has bounded staleness, and replicas updated from its pushes would not agree");
    }
    // Bad input: told to every rank with the round below if there is one, else by the shards.
    c.push_bounded(split.bounded, scale, split.sync.empty(), &error, &index_error);
    if (split.sync.empty()) return {};  // no round: the shards apply it as it comes
  }
  const std::vector<TableBatch>& sync = split.bounded.empty() ? batches : split.sync;
  for (const TableBatch& b : batches) {  // (a bad handle is route_batches' error)
    const bool known = b.table >= 0 && b.table < static_cast<int>(c.tables.size()) && !c.tables[b.table]->dropped;
    if (error.empty() && return_updates && known && c.tables[b.table]->spec.dynamic.on) {
      error = "table '" + c.tables[b.table]->spec.name + "' is dynamic: it cannot be replicated (return_updates)";
    }
  }
  std::vector<Routed> routed = route_batches(c, sync, true, &error, &index_error);
  std::vector<double> lrs;
  for (const TableBatch& b : sync) lrs.push_back(b.lr);
  const RequestKind kind = return_updates ? RequestKind::kPushUpdates : RequestKind::kPush;
  const int64_t seq = c.next_seq();
  send_requests(c, kind, seq, routed, error, index_error, scale, lrs);
  if (!return_updates) {
    if (index_error) throw PSIndexError(error);
    if (!error.empty()) throw PSError(error);
    return {};
  }
  std::map<int, RowUpdates> updates;
  c.collect_replies(kind, seq, "push", [&](int source, Reader& r) {
    const int64_t n = r.i64();
    for (int64_t k = 0; k < n; ++k) {
      const int table = static_cast<int>(r.i64());
      const int64_t count = r.i64();
      RoundStats part;
      part.round = r.i64();
      part.ranks = static_cast<int>(r.i64());
      part.local_sq = r.f64();
      part.combined_sq = r.f64();
      part.rows = r.i64();
      part.pushed = r.i64();
      const Table& t = c.table_at(table);
      c.stats.add(table, t.spec.num_shards, source, part);
      const std::vector<int64_t> ids = r.i64s(r.count(count, sizeof(int64_t)));
      const float* rows = r.f32s(count, t.spec.dim);
      RowUpdates& u = updates[table];
      u.ids.insert(u.ids.end(), ids.begin(), ids.end());
      u.rows.insert(u.rows.end(), rows, rows + count * t.spec.dim);
    }
  });
  std::vector<RowUpdates> out;
  for (const TableBatch& b : sync) out.push_back(std::move(updates[b.table]));
  return out;
}

void detail::ClientState::apply_local(const std::vector<TableBatch>& batches, float scale) {
  // Every id is checked before any row changes (all-or-nothing, as for a round over the wire).
  std::vector<std::vector<int64_t>> local(batches.size());
  std::map<int, std::vector<GradientRows>> by_table;  // ordered: the apply order of a round
  std::map<int, double> lr;
  for (size_t b = 0; b < batches.size(); ++b) {
    const TableBatch& batch = batches[b];
    const Table& t = table_at(batch.table);
    check_ids(t.spec.name, batch.ids, batch.n, t.spec.num_rows);
    local[b].resize(static_cast<size_t>(batch.n));
    for (int64_t i = 0; i < batch.n; ++i) local[b][i] = t.part.local_index(batch.ids[i]);
    by_table[batch.table].push_back(GradientRows{local[b].data(), batch.n, batch.grads});  // empty ones too: a step
    if (batch.lr >= 0) lr[batch.table] = batch.lr;
  }
  const int64_t round = next_seq();
  const int64_t start = tracer.start();
  int64_t applied_rows = 0;
  for (auto& [table, sources] : by_table) {
    Table& t = *tables[table];
    auto it = lr.find(table);
    apply_to_table(t, sources, scale, it == lr.end() ? -1.0 : it->second, round, 1);
    stats.done[table] = t.last_round;
    applied_rows += t.sums.size();
  }
  tracer.record("server apply", start, applied_rows);
}

}  // namespace hybridsync
