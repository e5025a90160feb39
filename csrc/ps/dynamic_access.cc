// One-sided access to a dynamic table's shards, for a module's state_dict read by one rank and
// loaded by any: every shard's sizes, a shard streamed to a reader in chunks, and a whole state
// written to the shards that own its ids. Like access.cc's, the shards' owners answer whatever
// they are doing; requests from one rank are served in order, so a read sees its earlier pushes.
//
// Wire format (after the request head):
//   kReadDynamic  (table, part, rows?, slots?, begin, count) -> step, stored, pending, n, then n
//                 ids, counts and last touches, and for stored rows: rows (rows?), the number of
//                 slots and each slot's values (slots?).
//   kWriteDynamic (table, how, step, n, rows?, slots k, pending p, n ids, counts, last touches,
//                 p pending ids, counts, last touches, n rows (rows?), k x n slot values)
//                 -> acknowledgement (how: DynamicWrite).
#include <algorithm>
#include <cstring>

#include "client_impl.h"

namespace hybridsync {
namespace {

enum Part : int64_t { kStored = 0, kPending = 1 };
constexpr int kReadAttempts = 3;           // a shard that changes between chunks is read again
constexpr int64_t kReadChunkBytes = 1 << 20;  // as access.cc: replies of 1 MiB, writes of 256 KiB
constexpr int64_t kWriteChunkBytes = 256 << 10;
constexpr int64_t kMaxEntries = int64_t{1} << 40;  // more in one message is a malformed one

// Entries per chunk, `entry_bytes` each, within `wanted` bytes and one network message.
int64_t entries_per_chunk(const Transport& transport, int64_t entry_bytes, int64_t wanted) {
  const int64_t bytes = std::clamp<int64_t>(transport.max_message_bytes() - 4096, 4096, wanted);
  return std::max<int64_t>(1, bytes / entry_bytes);
}

const Table& dynamic_table(detail::ClientState& c, int table, const char* op) {
  const Table& t = c.table_at(table);
  if (!t.spec.dynamic.on) throw PSError(std::string(op) + ": table '" + t.spec.name + "' is not dynamic");
  return t;
}

std::vector<char> read_request(int64_t id, int table, Part part, bool rows, bool slots, int64_t begin,
                               int64_t count) {
  Writer w = request_writer(RequestKind::kReadDynamic, id);
  for (const int64_t v : {static_cast<int64_t>(table), static_cast<int64_t>(part), int64_t{rows}, int64_t{slots},
                          begin, count}) {
    w.i64(v);
  }
  return w.take();
}

std::array<int64_t, 3> read_sizes(Reader& r) {
  std::array<int64_t, 3> sizes{};
  for (int64_t& v : sizes) v = r.i64();
  return sizes;
}

void append(std::vector<int64_t>& to, const std::vector<int64_t>& from) { to.insert(to.end(), from.begin(), from.end()); }

void append(std::vector<float>& to, const float* from, size_t n) { to.insert(to.end(), from, from + n); }

// A count read from a message: in [0, kMaxEntries], else the message is malformed.
int64_t entries(Reader& r) {
  const int64_t n = r.i64();
  if (n < 0 || n > kMaxEntries) throw PSTransportError("hybridsync: malformed PS message (a dynamic entry count)");
  return n;
}

}  // namespace

std::vector<std::array<int64_t, 3>> Client::dynamic_sizes(int table) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  const Table& t = dynamic_table(c, table, "dynamic_sizes");
  std::vector<std::array<int64_t, 3>> out(static_cast<size_t>(t.spec.num_shards));
  std::vector<Chunk> ask;
  for (int s = 0; s < t.spec.num_shards; ++s) {
    ask.push_back(Chunk{s, [=](int64_t id) { return read_request(id, table, kStored, false, false, 0, 0); },
                        [&out, s](Reader& r) { out[static_cast<size_t>(s)] = read_sizes(r); }});
  }
  exchange_chunks(c, ask, RequestKind::kReadDynamic, "read_dynamic");
  return out;
}

DynamicState Client::read_dynamic(int table, int shard, bool with_rows, bool with_slots, int64_t* step) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  const Table& t = dynamic_table(c, table, "read_dynamic");
  if (shard < 0 || shard >= t.spec.num_shards) {
    throw PSError("read_dynamic: table '" + t.spec.name + "' has no shard " + std::to_string(shard));
  }
  const int64_t dim = t.spec.dim;
  // (at most 2 slots: Adam's; a chunk of another rule stays within the message limit anyway)
  const int64_t row_bytes = 24 + 4 * dim * ((with_rows ? 1 : 0) + (with_slots ? 2 : 0));
  const int64_t per_row = entries_per_chunk(*c.transport, row_bytes, kReadChunkBytes);
  const int64_t per_pending = entries_per_chunk(*c.transport, 24, kReadChunkBytes);
  for (int attempt = 0; attempt < kReadAttempts; ++attempt) {
    std::array<int64_t, 3> sizes{};
    std::vector<Chunk> ask{Chunk{shard, [=](int64_t id) { return read_request(id, table, kStored, false, false, 0, 0); },
                                 [&sizes](Reader& r) { sizes = read_sizes(r); }}};
    exchange_chunks(c, ask, RequestKind::kReadDynamic, "read_dynamic");
    DynamicState s;
    s.dim = dim;
    bool changed = false;
    std::vector<Chunk> chunks;
    for (const Part part : {kStored, kPending}) {
      const int64_t total = part == kStored ? sizes[1] : sizes[2];
      const int64_t step_entries = part == kStored ? per_row : per_pending;
      for (int64_t begin = 0; begin < total; begin += step_entries) {
        const int64_t count = std::min(step_entries, total - begin);
        Chunk chunk{shard, [=](int64_t id) { return read_request(id, table, part, with_rows, with_slots, begin, count); },
                    nullptr};
        chunk.on_reply = [&, part, count](Reader& r) {
          const int64_t n = (read_sizes(r) != sizes) ? -1 : entries(r);
          if (n != count) {  // a round changed the shard since its sizes were read
            changed = true;
            return;
          }
          auto& ids = part == kStored ? s.ids : s.pending_ids;
          auto& counts = part == kStored ? s.counts : s.pending_counts;
          auto& last = part == kStored ? s.last_touch : s.pending_last;
          append(ids, r.i64s(static_cast<size_t>(n)));
          append(counts, r.i64s(static_cast<size_t>(n)));
          append(last, r.i64s(static_cast<size_t>(n)));
          if (part == kPending) return;
          const auto floats = static_cast<size_t>(n * dim);
          if (with_rows) append(s.rows, r.f32s(floats), floats);
          const int64_t k = entries(r);
          if (s.slots.empty()) s.slots.resize(static_cast<size_t>(k));
          if (static_cast<int64_t>(s.slots.size()) != k) throw PSTransportError("hybridsync: malformed PS message");
          for (auto& slot : s.slots) append(slot, r.f32s(floats), floats);
        };
        chunks.push_back(std::move(chunk));
      }
    }
    exchange_chunks(c, chunks, RequestKind::kReadDynamic, "read_dynamic");
    if (changed) continue;
    if (with_slots && s.slots.empty() && t.shard) s.slots.resize(static_cast<size_t>(t.shard->num_slots()));
    if (step) *step = sizes[0];
    return s;
  }
  throw PSError("read_dynamic: table '" + t.spec.name + "': shard " + std::to_string(shard) + " changed while it was " +
                "read, " + std::to_string(kReadAttempts) + " times (read it between steps)");
}

void Client::write_dynamic(int table, const DynamicState& state, DynamicWrite how, int64_t step) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  const Table& t = dynamic_table(c, table, "write_dynamic");
  const int64_t dim = t.spec.dim;
  const bool slots_only = how == DynamicWrite::kSlots, clear = how == DynamicWrite::kReplace;
  const size_t n = state.ids.size(), p = slots_only ? 0 : state.pending_ids.size(), floats = n * static_cast<size_t>(dim);
  bool ok = state.dim == dim && (slots_only || (state.counts.size() == n && state.last_touch.size() == n &&
                                                state.rows.size() == floats && state.pending_counts.size() == p &&
                                                state.pending_last.size() == p));
  for (const auto& slot : state.slots) ok = ok && slot.size() == floats;
  if (!ok) throw PSError("table '" + t.spec.name + "': inconsistent dynamic table state (array lengths or dim differ)");
  const int shards = t.spec.num_shards;
  std::vector<std::vector<int64_t>> rows_of(static_cast<size_t>(shards)), pending_of(static_cast<size_t>(shards));
  for (size_t i = 0; i < n; ++i) rows_of[static_cast<size_t>(t.part.shard_of(state.ids[i]))].push_back(static_cast<int64_t>(i));
  for (size_t i = 0; i < p; ++i) {
    pending_of[static_cast<size_t>(t.part.shard_of(state.pending_ids[i]))].push_back(static_cast<int64_t>(i));
  }
  const bool with_rows = !slots_only;
  const auto k = static_cast<int64_t>(state.slots.size());
  const int64_t per_chunk = entries_per_chunk(*c.transport, 24 + 4 * dim * ((with_rows ? 1 : 0) + k), kWriteChunkBytes);
  std::vector<Chunk> chunks;
  for (int s = 0; s < shards; ++s) {
    const auto& rows = rows_of[static_cast<size_t>(s)];
    const auto& pending = pending_of[static_cast<size_t>(s)];
    const auto stored = static_cast<int64_t>(rows.size()), total = stored + static_cast<int64_t>(pending.size());
    // Stored rows first, then pending ids; with kReplace the first chunk (an empty one, if the
    // shard gets nothing) empties the shard and sets its step.
    for (int64_t begin = 0; begin < total || (begin == 0 && clear); begin += per_chunk) {
      const int64_t end = std::min(total, begin + per_chunk);
      std::vector<int64_t> mine(rows.begin() + std::min(begin, stored), rows.begin() + std::min(end, stored));
      std::vector<int64_t> waiting(pending.begin() + std::max<int64_t>(begin - stored, 0),
                                   pending.begin() + std::max<int64_t>(end - stored, 0));
      const int64_t mode = begin == 0 ? static_cast<int64_t>(how) : static_cast<int64_t>(slots_only ? how : DynamicWrite::kUpsert);
      chunks.push_back(Chunk{s, [&state, table, dim, k, mode, with_rows, step, mine = std::move(mine),
                                 waiting = std::move(waiting)](int64_t id) {
                               Writer w = request_writer(RequestKind::kWriteDynamic, id);
                               for (const int64_t v : {static_cast<int64_t>(table), mode, step,
                                                       static_cast<int64_t>(mine.size()), int64_t{with_rows}, k,
                                                       static_cast<int64_t>(waiting.size())}) {
                                 w.i64(v);
                               }
                               for (const auto* field : {&state.ids, &state.counts, &state.last_touch}) {
                                 for (const int64_t i : mine) w.i64(field->empty() ? 0 : (*field)[static_cast<size_t>(i)]);
                               }
                               for (const auto* field : {&state.pending_ids, &state.pending_counts, &state.pending_last}) {
                                 for (const int64_t i : waiting) w.i64((*field)[static_cast<size_t>(i)]);
                               }
                               float* dst = w.f32_slot(mine.size() * static_cast<size_t>(dim * ((with_rows ? 1 : 0) + k)));
                               for (int64_t slot = with_rows ? -1 : 0; slot < k; ++slot) {
                                 const float* src = slot < 0 ? state.rows.data() : state.slots[static_cast<size_t>(slot)].data();
                                 for (const int64_t i : mine) {
                                   std::memcpy(dst, src + i * dim, dim * sizeof(float));
                                   dst += dim;
                                 }
                               }
                               return w.take();
                             },
                             nullptr});
      if (begin >= total) break;  // (the one empty chunk of a shard that gets nothing)
    }
  }
  exchange_chunks(c, chunks, RequestKind::kWriteDynamic, "write_dynamic");
}

void detail::ClientState::serve_dynamic(int source, const Request& request, Reader& r) {
  const int table = static_cast<int>(r.i64());
  std::vector<ErrorNote> errors;
  Table* t = nullptr;
  try {
    t = &table_at(table);
    if (!t->spec.dynamic.on) throw PSError("table '" + t->spec.name + "' is not dynamic");
    if (!t->dynamic) {
      throw PSTransportError(std::string(operation_name(request.kind)) + " for table '" + t->spec.name +
                             "' reached a rank without its shard");
    }
  } catch (const PSTransportError&) {
    throw;
  } catch (const PSError& e) {
    errors.push_back(ErrorNote{source, false, e.what(), ""});
  }
  const int64_t start = tracer.start();
  Writer w;
  if (request.kind == RequestKind::kReadDynamic) {
    const auto part = static_cast<Part>(r.i64());
    const bool rows = r.i64() != 0, slots = r.i64() != 0;
    const int64_t begin = r.i64(), count = r.i64();
    write_reply_head(w, request.kind, request.seq, errors);
    if (errors.empty()) {
      DynamicStore& store = *t->dynamic;
      store.drop_released();  // (the range walks the disk's entries)
      const int64_t total = part == kPending ? store.pending() : store.stored();
      const int64_t from = std::clamp<int64_t>(begin, 0, total), n = std::clamp<int64_t>(count, 0, total - from);
      const DynamicState s = store.range(*t->shard, part == kPending, from, n, rows, slots);
      for (const int64_t v : {t->shard->rule().step(), store.stored(), store.pending(), n}) w.i64(v);
      const auto& ids = part == kPending ? s.pending_ids : s.ids;
      w.i64s(ids.data(), ids.size());
      const auto& counts = part == kPending ? s.pending_counts : s.counts;
      w.i64s(counts.data(), counts.size());
      const auto& last = part == kPending ? s.pending_last : s.last_touch;
      w.i64s(last.data(), last.size());
      if (part == kStored) {
        w.f32s(s.rows.data(), s.rows.size());
        w.i64(static_cast<int64_t>(s.slots.size()));
        for (const auto& slot : s.slots) w.f32s(slot.data(), slot.size());
      }
      tracer.record("serve dynamic reads", start, n);
    }
  } else {
    const auto how = static_cast<DynamicWrite>(r.i64());
    const int64_t step = r.i64(), n = entries(r);
    const bool with_rows = r.i64() != 0;
    const int64_t k = entries(r), p = entries(r);
    DynamicState s;
    s.dim = t ? t->spec.dim : 0;
    for (auto* field : {&s.ids, &s.counts, &s.last_touch}) *field = r.i64s(static_cast<size_t>(n));
    for (auto* field : {&s.pending_ids, &s.pending_counts, &s.pending_last}) *field = r.i64s(static_cast<size_t>(p));
    const auto floats = static_cast<size_t>(n * s.dim);
    if (with_rows) append(s.rows, r.f32s(floats), floats);
    s.slots.resize(static_cast<size_t>(k));
    for (auto& slot : s.slots) append(slot, r.f32s(floats), floats);
    if (errors.empty()) {
      try {
        if (how == DynamicWrite::kSlots) {
          t->dynamic->write_slots(t->shard, s.ids, s.slots);
        } else {
          if (how == DynamicWrite::kReplace) t->dynamic->clear();
          if (step >= 0) t->shard->rule().set_step(step);  // (before the entries: expiry counts from it)
          t->dynamic->restore(t->shard, s, [](int64_t) { return true; });
        }
      } catch (const PSError& e) {
        errors.push_back(ErrorNote{source, false, e.what(), ""});
      }
    }
    write_reply_head(w, request.kind, request.seq, errors);
    tracer.record("serve dynamic writes", start, n + p);
  }
  reply(source, w);
}

}  // namespace hybridsync
