// One-sided access to any shard, and load_from_root built on it. A reader or writer streams
// rows in chunks no bigger than a network message (a reply never exceeds the transport's limit)
// with a few chunks in flight, and the shards' owners answer whatever they are doing: their
// serving thread, or their caller waiting in any PS call, serves the request.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>

#include "../transport/wait.h"
#include "client_impl.h"

namespace hybridsync {
namespace {

// Unanswered chunks a reader or writer keeps in flight.
constexpr size_t kWindow = 4;

// Rows of one chunk: a reply or write fits one network message and stays small -- reads 1 MiB,
// writes 256 KiB (a table being loaded from a whole copy must not sit in messages twice).
int64_t chunk_rows(const Transport& transport, int64_t dim, RequestKind kind) {
  const int64_t wanted = kind == RequestKind::kRead ? int64_t{1} << 20 : int64_t{256} << 10;
  const int64_t bytes = std::clamp<int64_t>(transport.max_message_bytes() - 4096, 4096, wanted);
  return std::max<int64_t>(1, bytes / (dim * static_cast<int64_t>(sizeof(float))));
}

// Gives the pages wholly inside the first `bytes` of a buffer back to the system, a growing
// prefix at a time (MADV_DONTNEED: they read as zeros, or as their file, if touched again).
class PageReleaser {
 public:
  PageReleaser(const void* base, int64_t size) : base_(reinterpret_cast<uintptr_t>(base)), size_(size) {
    page_ = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    done_ = (base_ + page_ - 1) & ~(page_ - 1);
  }
  void release_to(int64_t bytes) {
    const uintptr_t end = (base_ + static_cast<uintptr_t>(std::min(bytes, size_))) & ~(page_ - 1);
    if (base_ == 0 || end <= done_) return;
    madvise(reinterpret_cast<void*>(done_), end - done_, MADV_DONTNEED);  // advisory: a failure only costs memory
    done_ = end;
  }

 private:
  uintptr_t base_, page_, done_;
  int64_t size_;
};

// Reads `count` rows of a read reply into dst(l) (float32 values): slots and float32 rows as
// they are, 16-bit rows decoded (a table storing 16-bit rows sends them so).
template <class Dst>
void read_reply_rows(Reader& r, int64_t count, int64_t dim, RowType type, Dst dst) {
  if (type == RowType::kFloat32) {
    const float* rows = r.f32s(count, dim);
    for (int64_t l = 0; l < count; ++l) std::memcpy(dst(l), rows + l * dim, dim * sizeof(float));
    return;
  }
  const auto* rows = reinterpret_cast<const uint16_t*>(r.row_bytes(count, dim * 2));
  for (int64_t l = 0; l < count; ++l) decode_row(type, rows + l * dim, dst(l), dim);
}

// The head of a read or write request: table, slot and how its rows are named.
Writer access_request(RequestKind kind, int64_t id, int table, int slot, RowsBy by, int64_t n) {
  Writer w = request_writer(kind, id);
  w.i64(table);
  w.i64(slot);
  w.i64(static_cast<int64_t>(by));
  w.i64(n);
  return w;
}

}  // namespace

// Sends the chunks, at most kWindow unanswered, driving this rank's server meanwhile; replies
// come in order per destination. Throws the first error any of them met.
void exchange_chunks(detail::ClientState& c, std::vector<Chunk>& chunks, RequestKind kind, const char* op) {
  std::vector<std::deque<std::pair<int64_t, size_t>>> waiting(static_cast<size_t>(c.size()));
  size_t next = 0, outstanding = 0;
  std::vector<ErrorNote> errors;
  c.drive_until(
      [&] {
        while (next < chunks.size() && outstanding < kWindow) {
          const int64_t id = ++c.one_sided_ids;
          c.send_request(chunks[next].dest, chunks[next].make(id));
          waiting[chunks[next].dest].emplace_back(id, next);
          ++next;
          ++outstanding;
        }
        Message m;
        while (outstanding > 0 && c.transport->try_recv(kAnySource, kTagReply, &m)) {
          Reader r(m.data);
          ReplyHead head = read_reply_head(r);
          auto& expected = waiting[m.source];
          if (expected.empty() || head.kind != kind || head.seq != expected.front().first) {
            c.fail(std::string("hybridsync: rank ") + std::to_string(m.source) + " answered " +
                   operation_name(head.kind) + " #" + std::to_string(head.seq) + " while this rank waited for its " +
                   op + " (a protocol error)");
          }
          const size_t index = expected.front().second;
          expected.pop_front();
          --outstanding;
          for (ErrorNote& e : head.errors) errors.push_back(std::move(e));
          if (errors.empty() && chunks[index].on_reply) chunks[index].on_reply(r);
        }
        return next == chunks.size() && outstanding == 0;
      },
      std::string(op) + " (the shards' owners answer)");
  detail::ClientState::throw_errors(errors, c.rank(), op);
}

// Chunks over a whole table, shard after shard in turns (so all shards work at once and, when
// loading, the rows handed over form a growing prefix of each shard's local order).
// hand_over: a read by every rank, each once, before the table is dropped (see RowsBy).
static std::vector<Chunk> table_chunks(detail::ClientState& c, const Table& t, int table, int slot, RequestKind kind,
                                       const float* values, float* out, PageReleaser* release,
                                       bool hand_over = false) {
  const int64_t dim = t.spec.dim;
  const int64_t step = chunk_rows(*c.transport, dim, kind);
  std::vector<Chunk> chunks;
  const int shards = t.spec.num_shards;
  const int64_t readers = c.size();
  for (int64_t begin = 0;; begin += step) {
    bool any = false;
    for (int s = 0; s < shards; ++s) {
      const int64_t rows = t.part.shard_rows(s);
      if (begin >= rows) continue;
      any = true;
      const int64_t count = std::min(step, rows - begin);
      const Partitioner part = t.part;
      Chunk chunk{s, nullptr, nullptr};
      chunk.make = [=](int64_t id) {
        Writer w = access_request(kind, id, table, slot, hand_over ? RowsBy::kRangeHandOver : RowsBy::kRange, count);
        w.i64(begin);
        if (hand_over) w.i64(readers);
        if (kind == RequestKind::kWrite) {
          float* dst = w.f32_slot(static_cast<size_t>(count * dim));
          for (int64_t l = 0; l < count; ++l) {
            std::memcpy(dst + l * dim, values + part.global_id(s, begin + l) * dim, dim * sizeof(float));
          }
          if (release) {  // every row below the lowest id not yet handed over is in a message now
            int64_t prefix = part.num_rows();
            for (int q = 0; q < part.num_shards(); ++q) {  // this turn's chunks went to shards 0..s
              const int64_t next = q <= s ? std::min(begin + step, part.shard_rows(q)) : begin;
              if (next < part.shard_rows(q)) prefix = std::min(prefix, part.global_id(q, next));
            }
            release->release_to(prefix * dim * static_cast<int64_t>(sizeof(float)));
          }
        }
        return w.take();
      };
      if (kind == RequestKind::kRead) {
        const RowType type = slot < 0 ? row_type_of(t.spec) : RowType::kFloat32;
        chunk.on_reply = [=](Reader& r) {
          read_reply_rows(r, count, dim, type, [&](int64_t l) { return out + part.global_id(s, begin + l) * dim; });
        };
      }
      chunks.push_back(std::move(chunk));
    }
    if (!any) break;
  }
  return chunks;
}

// Chunks over a list of ids, grouped by shard: positions[k] is where chunk rows come from / go.
static std::vector<Chunk> row_chunks(detail::ClientState& c, const Table& t, int table, int slot, RequestKind kind,
                                     const int64_t* ids, int64_t n, const float* values, float* out) {
  check_ids(t.spec.name, ids, n, t.spec.num_rows);
  const int64_t dim = t.spec.dim;
  const int64_t step = chunk_rows(*c.transport, dim, kind);
  std::vector<std::vector<int64_t>> positions(static_cast<size_t>(t.spec.num_shards));
  for (int64_t i = 0; i < n; ++i) positions[t.part.shard_of(ids[i])].push_back(i);
  std::vector<Chunk> chunks;
  for (int s = 0; s < t.spec.num_shards; ++s) {
    const auto& mine = positions[s];
    for (size_t begin = 0; begin < mine.size(); begin += static_cast<size_t>(step)) {
      const size_t end = std::min(mine.size(), begin + static_cast<size_t>(step));
      std::vector<int64_t> at(mine.begin() + static_cast<std::ptrdiff_t>(begin),
                              mine.begin() + static_cast<std::ptrdiff_t>(end));
      std::vector<int64_t> local(at.size());
      for (size_t k = 0; k < at.size(); ++k) local[k] = t.part.local_index(ids[at[k]]);
      Chunk chunk{s, nullptr, nullptr};
      chunk.make = [=](int64_t id) {
        Writer w = access_request(kind, id, table, slot, RowsBy::kList, static_cast<int64_t>(local.size()));
        w.i64s(local.data(), local.size());
        if (kind == RequestKind::kWrite) {
          float* dst = w.f32_slot(at.size() * static_cast<size_t>(dim));
          for (size_t k = 0; k < at.size(); ++k) std::memcpy(dst + k * dim, values + at[k] * dim, dim * sizeof(float));
        }
        return w.take();
      };
      if (kind == RequestKind::kRead) {
        const RowType type = slot < 0 ? row_type_of(t.spec) : RowType::kFloat32;
        chunk.on_reply = [=](Reader& r) {
          read_reply_rows(r, static_cast<int64_t>(at.size()), dim, type, [&](int64_t k) { return out + at[k] * dim; });
        };
      }
      chunks.push_back(std::move(chunk));
    }
  }
  return chunks;
}

void Client::read_table(int table, int slot, float* out, bool hand_over) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  const Table& t = c.table_at(table);
  check_fixed(t, "read_table");
  std::vector<Chunk> chunks = table_chunks(c, t, table, slot, RequestKind::kRead, nullptr, out, nullptr, hand_over);
  exchange_chunks(c, chunks, RequestKind::kRead, "read");
}

void Client::read_rows(int table, int slot, const int64_t* ids, int64_t n, float* out) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  const Table& t = c.table_at(table);
  std::vector<Chunk> chunks = row_chunks(c, t, table, slot, RequestKind::kRead, ids, n, nullptr, out);
  exchange_chunks(c, chunks, RequestKind::kRead, "read");
}

void Client::write_table(int table, int slot, const float* values) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  const Table& t = c.table_at(table);
  check_fixed(t, "write_table");
  std::vector<Chunk> chunks = table_chunks(c, t, table, slot, RequestKind::kWrite, values, nullptr, nullptr);
  exchange_chunks(c, chunks, RequestKind::kWrite, "write");
}

void Client::write_rows(int table, int slot, const int64_t* ids, int64_t n, const float* rows) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  const Table& t = c.table_at(table);
  std::vector<Chunk> chunks = row_chunks(c, t, table, slot, RequestKind::kWrite, ids, n, rows, nullptr);
  exchange_chunks(c, chunks, RequestKind::kWrite, "write");
}

int64_t Client::table_step(int table) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  const Table& t = c.table_at(table);
  if (t.shard) {
    c.settle();
    return t.shard->rule().step();
  }
  int64_t step = -1;  // shard 0 lives on rank 0, and every shard steps with every round
  std::vector<Chunk> ask{Chunk{0, [&](int64_t id) {
                                 Writer w = request_writer(RequestKind::kReadStep, id);
                                 w.i64(table);
                                 return w.take();
                               },
                               [&](Reader& r) { step = r.i64(); }}};
  exchange_chunks(c, ask, RequestKind::kReadStep, "read_step");
  return step;
}

void Client::set_table_step(int table, int64_t step) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  const Table& t = c.table_at(table);
  std::vector<Chunk> tell;
  for (int s = 0; s < t.spec.num_shards; ++s) {
    tell.push_back(Chunk{s, [=](int64_t id) {
                           Writer w = request_writer(RequestKind::kWriteStep, id);
                           w.i64(table);
                           w.i64(step);
                           return w.take();
                         },
                         nullptr});
  }
  exchange_chunks(c, tell, RequestKind::kWriteStep, "write_step");
}

void Client::load_from_root(int table, const float* values, int root, const std::string& given_error, bool consume) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  detail::ClientState& c = *impl_;
  c.check_usable();
  const Table& t = c.table_at(table);
  check_fixed(t, "load_from_root");
  if (root < 0 || root >= c.size()) {  // every rank sees the same root: all throw, none waits
    throw PSError("table '" + t.spec.name + "': load_from_root needs a root rank in [0, " + std::to_string(c.size()) +
                  "), got " + std::to_string(root));
  }
  std::string error = c.rank() == root ? given_error : "";
  if (c.rank() == root && error.empty()) {
    // The rows go out a chunk per shard at a time; with `consume`, the pages of rows already
    // copied into messages go back to the system, so the root's own shard (whose pages become
    // resident only as they are written) grows as the table shrinks.
    PageReleaser released(values, t.spec.num_rows * t.spec.dim * static_cast<int64_t>(sizeof(float)));
    std::vector<Chunk> chunks =
        table_chunks(c, t, table, -1, RequestKind::kWrite, values, nullptr, consume ? &released : nullptr);
    try {
      exchange_chunks(c, chunks, RequestKind::kWrite, "load_from_root");
    } catch (const PSTransportError&) {
      throw;
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Everyone waits for the root's rows to be in (the root's writes reach each shard before its
  // barrier request) and learns its verdict.
  const int64_t seq = c.next_seq();
  for (int d = 0; d < c.size(); ++d) {
    if (!error.empty()) {
      c.send_request(d, error_request(RequestKind::kBarrier, seq, error, false));
      continue;
    }
    Writer w = request_writer(RequestKind::kBarrier, seq);
    w.text("load_from_root");
    c.send_request(d, w.take());
  }
  c.collect_replies(RequestKind::kBarrier, seq, "load_from_root", [](int, Reader&) {});
}

}  // namespace hybridsync
