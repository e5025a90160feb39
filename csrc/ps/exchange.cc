// The Engine's collective data operations. Protocol, per operation, on every rank:
//   1. as a worker, send one request to every rank (possibly empty, or an error notice);
//   2. as a server, receive one request from every rank and answer it;
//   3. as a worker, collect the answers.
// Requests travel in operation order per (source, tag), so a server always applies a push
// before it serves the next pull from any rank. A push is applied lazily: at the start of the
// next operation, so the wire time overlaps the caller's compute.
#include <cstring>
#include <functional>

#include "../transport/transport.h"
#include "engine_internal.h"
#include "routing.h"
#include "wire.h"

namespace hybridsync {
namespace {

// One batch of a worker's operation, routed; for a push, `rows` are its unique ids' gradients.
struct Routed {
  int table;
  int64_t dim;
  Routing routing;
  const float* rows = nullptr;
  std::vector<float> summed;  // gradients of duplicate ids added up (only when there are some)
};

// One table's entry in a request a server received.
struct Entry {
  int table;
  int64_t count;
  const int64_t* local;
  const float* grads;  // push only
};

// Parses a pull/push request (after its kind) into entries; grads follow all row indices.
std::vector<Entry> read_entries(Reader& r, bool with_grads, const std::function<int64_t(int)>& dim_of) {
  const int64_t n = r.i64();
  std::vector<Entry> entries(static_cast<size_t>(n));
  for (auto& e : entries) {
    e.table = static_cast<int>(r.i64());
    e.count = r.i64();
  }
  for (auto& e : entries) e.local = r.i64_view(static_cast<size_t>(e.count));
  if (with_grads) {
    for (auto& e : entries) e.grads = r.f32s(static_cast<size_t>(e.count * dim_of(e.table)));
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

// Routes every batch of this worker's operation; bad input becomes `error` (announced to the
// peers instead of thrown, so no rank is left waiting). For a push, duplicate ids' gradients
// are added up, so each row crosses the wire once.
std::vector<Routed> route_batches(const Engine& engine, const std::vector<TableBatch>& batches, bool with_grads,
                                  std::string* error, bool* index_error) {
  std::vector<Routed> routed;
  if (!error->empty()) return routed;
  try {
    for (const TableBatch& b : batches) {
      const TableSpec& spec = engine.spec(b.table);
      const int64_t dim = spec.dim;
      Routed r{b.table, dim, route_ids(spec.name, engine.partitioner(b.table), b.ids, b.n, engine.size())};
      const auto& dd = r.routing.dedup;
      if (with_grads && static_cast<int64_t>(dd.unique.size()) == b.n) {
        r.rows = b.grads;  // no duplicates: unique u is input u
      } else if (with_grads) {
        r.summed.assign(dd.unique.size() * dim, 0.0f);
        for (int64_t i = 0; i < b.n; ++i) {
          float* dst = r.summed.data() + dd.inverse[i] * dim;
          const float* g = b.grads + i * dim;
          for (int64_t j = 0; j < dim; ++j) dst[j] += g[j];
        }
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

std::vector<PullResult> Engine::pull(const std::vector<TableBatch>& batches, const std::string& error) {
  return guarded(broken_, broken_reason_, [&] {
    check_usable();
    drain_pending();
    const int P = size();
    std::string local_error = error;
    bool index_error = false;
    std::vector<Routed> routed = route_batches(*this, batches, false, &local_error, &index_error);
    send_requests(*transport_, RequestKind::kPull, routed, local_error);
    // Serve every worker's request from this rank's shards.
    std::vector<std::string> errors(P);
    auto dim_of = [&](int table) { return table_at(table).spec.dim; };
    int64_t served_rows = 0;
    const int64_t serve_start = tracing_ ? now_ns() : 0;
    for (int src = 0; src < P; ++src) {
      auto msg = transport_->recv(src, kTagRequest);
      Reader r(msg);
      const auto kind = static_cast<RequestKind>(r.i64());
      Writer reply;
      if (kind == RequestKind::kError) {
        errors[src] = r.text();
      } else if (kind == RequestKind::kPull) {
        std::vector<Entry> entries = read_entries(r, false, dim_of);
        int64_t floats = 0;
        for (const Entry& e : entries) floats += e.count * dim_of(e.table);
        reply.reserve(static_cast<size_t>(floats) * sizeof(float));
        for (const Entry& e : entries) {
          Table& t = table_at(e.table);
          check_rows(t.shard.get(), t.spec.name, e.local, e.count, "pull");
          if (e.count) t.shard->gather(e.local, e.count, reply.f32_slot(e.count * t.spec.dim));
          served_rows += e.count;
        }
      } else {
        throw PSTransportError("hybridsync: ranks called different PS operations (pull vs push)");
      }
      transport_->send(src, kTagReply, reply.take());
    }
    trace("serve pulls", serve_start, served_rows);
    // Collect the rows this worker asked for, into each batch's unique order.
    std::vector<PullResult> results(routed.size());
    for (size_t b = 0; b < routed.size(); ++b) {
      results[b].rows.resize(routed[b].routing.dedup.unique.size() * routed[b].dim);
    }
    for (int d = 0; d < P; ++d) {
      auto msg = transport_->recv(d, kTagReply);
      if (!local_error.empty() || !errors[d].empty()) continue;
      Reader r(msg);
      for (size_t b = 0; b < routed.size(); ++b) {
        const Routing& rt = routed[b].routing;
        const int64_t dim = routed[b].dim;
        const float* rows = r.f32s(static_cast<size_t>(rt.count(d) * dim));
        for (int64_t k = rt.offset[d]; k < rt.offset[d + 1]; ++k, rows += dim) {
          std::memcpy(results[b].rows.data() + rt.order[k] * dim, rows, dim * sizeof(float));
        }
      }
    }
    if (!local_error.empty()) {
      if (index_error) throw PSIndexError(local_error);
      throw PSError(local_error);
    }
    throw_remote(errors, rank(), "pull");
    for (size_t b = 0; b < routed.size(); ++b) {
      results[b].unique = std::move(routed[b].routing.dedup.unique);
      results[b].inverse = std::move(routed[b].routing.dedup.inverse);
    }
    return results;
  });
}

void Engine::lookup_local(int table, const int64_t* ids, int64_t n, float* out) {
  return guarded(broken_, broken_reason_, [&] {
    check_usable();
    drain_pending();
    Table& t = table_at(table);
    if (size() != 1 || !t.shard || t.shard->rows() != t.spec.num_rows) {
      throw PSError("lookup_local needs every row of table '" + t.spec.name + "' on this rank");
    }
    const int64_t dim = t.spec.dim;
    for (int64_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] >= t.spec.num_rows) {
        throw PSIndexError("table '" + t.spec.name + "': id " + std::to_string(ids[i]) + " is out of range [0, " +
                           std::to_string(t.spec.num_rows) + ")");
      }
      std::memcpy(out + i * dim, t.shard->row(t.part.local_index(ids[i])), dim * sizeof(float));
    }
  });
}

std::vector<RowUpdates> Engine::push(const std::vector<TableBatch>& batches, float scale,
                                     bool return_updates, const std::string& error) {
  return guarded(broken_, broken_reason_, [&] {
    check_usable();
    drain_pending();
    const int P = size();
    std::string local_error = error;
    bool index_error = false;
    std::vector<Routed> routed = route_batches(*this, batches, true, &local_error, &index_error);
    send_requests(*transport_, RequestKind::kPush, routed, local_error);
    Round round;
    round.scale = scale;
    round.self_error_reported = !local_error.empty();
    if (local_error.empty()) {
      for (const TableBatch& b : batches) {
        if (b.lr >= 0) round.lr[b.table] = b.lr;
      }
    }
    std::vector<RowUpdates> out;
    if (!return_updates) {
      pending_.push_back(round);  // applied at the start of the next operation
    } else {
      std::map<int, RowUpdates> updates;
      apply_round(round, &updates);
      if (local_error.empty()) {
        for (const TableBatch& b : batches) out.push_back(std::move(updates[b.table]));
      }
    }
    if (!local_error.empty()) {
      if (index_error) throw PSIndexError(local_error);
      throw PSError(local_error);
    }
    return out;
  });
}

void Engine::flush() {
  return guarded(broken_, broken_reason_, [&] {
    check_usable();
    drain_pending();
  });
}

void Engine::drain_pending() {
  while (!pending_.empty()) {
    Round round = pending_.front();
    pending_.erase(pending_.begin());
    apply_round(round, nullptr);
  }
}

void Engine::apply_round(const Round& round, std::map<int, RowUpdates>* updates) {
  const int P = size();
  const int64_t start = tracing_ ? now_ns() : 0;
  int64_t applied_rows = 0;
  auto dim_of = [&](int table) { return table_at(table).spec.dim; };
  std::vector<std::vector<char>> msgs(P);
  std::map<int, std::vector<Entry>> by_table;  // ordered: deterministic apply order
  std::vector<std::string> errors(P);
  for (int src = 0; src < P; ++src) {  // sources in rank order: a deterministic sum order
    msgs[src] = transport_->recv(src, kTagRequest);
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
      check_rows(t.shard.get(), t.spec.name, e.local, e.count, "push");
      by_table[e.table].push_back(e);
    }
  }
  bool failed = false;
  for (int src = 0; src < P; ++src) failed = failed || !errors[src].empty();
  // All-or-nothing: a round with any bad input changes no row on any shard.
  std::map<int, int64_t> changed;  // table -> rows in sum_rows
  for (auto& [table, entries] : by_table) {
    Table& t = *tables_[table];
    if (!t.shard || failed) continue;
    const int64_t dim = t.spec.dim;
    int64_t total = 0;
    for (const Entry& e : entries) total += e.count;
    t.sum_rows.clear();
    t.sum_grads.resize(static_cast<size_t>(total * dim));
    t.sum_index.reset(static_cast<size_t>(total));
    for (const Entry& e : entries) {  // each worker sent unique rows; add up across workers
      for (int64_t k = 0; k < e.count; ++k) {
        auto [slot, fresh] = t.sum_index.insert(e.local[k]);
        float* dst = t.sum_grads.data() + slot * dim;
        const float* g = e.grads + k * dim;
        if (fresh) {
          t.sum_rows.push_back(e.local[k]);
          std::memcpy(dst, g, dim * sizeof(float));
        } else {
          for (int64_t j = 0; j < dim; ++j) dst[j] += g[j];
        }
      }
    }
    const int64_t n = static_cast<int64_t>(t.sum_rows.size());
    if (round.scale != 1.0f) {
      for (int64_t i = 0; i < n * dim; ++i) t.sum_grads[i] *= round.scale;
    }
    auto lr = round.lr.find(table);
    if (lr != round.lr.end()) t.shard->rule().set_hyperparameter("lr", lr->second);
    t.shard->rule().begin_step();
    t.shard->apply(t.sum_rows.data(), n, t.sum_grads.data());
    changed[table] = n;
    applied_rows += n;
  }
  trace("server apply", start, applied_rows);
  if (updates) {
    // Every shard tells every rank which rows changed, so all replicas stay identical.
    Writer w;
    w.i64(static_cast<int64_t>(changed.size()));
    for (const auto& [table, n] : changed) {
      Table& t = *tables_[table];
      w.i64(table);
      w.i64(n);
      for (int64_t k = 0; k < n; ++k) w.i64(t.part.global_id(rank(), t.sum_rows[k]));
      t.shard->gather(t.sum_rows.data(), n, w.f32_slot(static_cast<size_t>(n * t.spec.dim)));
    }
    std::vector<char> payload = w.take();
    for (int d = 0; d < P; ++d) transport_->send(d, kTagUpdates, payload);
    for (int src = 0; src < P; ++src) {
      auto msg = transport_->recv(src, kTagUpdates);
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
