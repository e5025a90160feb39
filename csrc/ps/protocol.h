// The PS wire protocol. Every request a worker sends a server starts with its kind and a
// sequence number: collective operations are numbered alike on every rank (the n-th collective
// call is number n everywhere), so a server that gets different kinds under one number knows the
// ranks called different operations and can say which; one-sided requests carry the number of
// the sender's last collective call instead (they are served after it). Every reply starts with
// the kind and number it answers and the errors the operation met, then its rows.
// Encoding: a flat byte buffer of int64 / double / float arrays. Reads are bounds-checked so a
// malformed message becomes an exception, never an out-of-bounds access. A count from the wire
// is checked against what is left of the message by division (n <= remaining / size), never by
// forming n * size first: a count near 2^61 would wrap that product to a few bytes.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "hybridsync/ps.h"

namespace hybridsync {

// Kinds of request a worker sends a server. Collective ones first.
enum class RequestKind : int64_t {
  kPull = 1,         // rows of ids (tables, local rows)
  kPush = 2,         // gradient rows, applied once every rank's are in
  kPushUpdates = 3,  // the same, answered with every changed row
  kBarrier = 4,      // answered once every earlier operation is applied (text: what it is for)
  kAddTable = 5,     // text: the table as this rank registers it
  kDropTable = 6,    // table
  kError = 7,        // this rank's input to a collective was bad: (intended kind, index error?, text)
  kJoin = 8,         // the sender ran out of data (hvd.join()): it takes no part in the others'
                     // operations until every rank has joined; answered then, with the newest number
  kRescaleAccumulators = 9,  // (factor, tables): every stored row's accumulating optimizer slots
                             // (Adagrad's sums) times the factor, on every shard, between the pushes
                             // before it and those after; every rank must send the same bits
  // One-sided.
  kRead = 20,        // (table, slot, rows) -> rows
  kWrite = 21,       // (table, slot, rows, values) -> acknowledgement
  kReadStep = 22,    // (table) -> the shard's server-optimizer step
  kWriteStep = 23,   // (table, step) -> acknowledgement
  kReadDynamic = 27,   // (table, part, rows?, slots?, begin, count) -> a dynamic shard's step and sizes, and
                       // entries [begin, begin + count) of its stored rows or pending ids (dynamic_access.cc)
  kWriteDynamic = 28,  // (table, clear?, step, entries) -> acknowledgement: a dynamic shard restores them
  // Bounded staleness (tables with staleness k > 0, bounded.cc): asynchronous, one-sided.
  kBoundedPush = 24,  // a push's body, applied on arrival; no reply. Counts a step of the sender
  kBoundedPull = 25,  // a pull's body with (clock, k) per table: held until the bound allows it
  kBoundedError = 26,  // a bounded push whose input was bad at its sender: (tables, index error?, text).
                       // No row changes; it counts the sender's step (nobody waits for a push that will
                       // not come) and each shard tells the other ranks with its next answer to them
  kAbort = 30,       // the sender's engine failed (text): this one must fail too; no reply
};

// What users called, for errors naming both sides of a mismatch.
inline const char* operation_name(RequestKind kind) {
  switch (kind) {
    case RequestKind::kPull: return "pull";
    case RequestKind::kPush: return "push";
    case RequestKind::kPushUpdates: return "push(return_updates=True)";
    case RequestKind::kBarrier: return "barrier";
    case RequestKind::kAddTable: return "add_table";
    case RequestKind::kDropTable: return "drop_table";
    case RequestKind::kError: return "a failed operation";
    case RequestKind::kJoin: return "join";
    case RequestKind::kRescaleAccumulators: return "rescale_accumulators";
    case RequestKind::kRead: return "read";
    case RequestKind::kReadStep: return "read_step";
    case RequestKind::kWriteStep: return "write_step";
    case RequestKind::kWrite: return "write";
    case RequestKind::kReadDynamic: return "read_dynamic";
    case RequestKind::kWriteDynamic: return "write_dynamic";
    case RequestKind::kBoundedPush: return "push (bounded staleness)";
    case RequestKind::kBoundedPull: return "pull (bounded staleness)";
    case RequestKind::kBoundedError: return "push (bounded staleness)";
    case RequestKind::kAbort: return "abort";
  }
  return "an unknown operation";
}

inline bool is_collective(RequestKind kind) { return static_cast<int64_t>(kind) < 20; }

// How a read or write names its rows: a range of a shard's local rows, or a list of them. A
// hand-over range is a range read by each of `readers` ranks once, before the table is dropped:
// once every reader has it, the shard gives the range's memory back (Client::read_table).
enum class RowsBy : int64_t { kRange = 0, kList = 1, kRangeHandOver = 2 };

class Writer {
 public:
  void i64(int64_t v) { raw(&v, sizeof v); }
  void i64s(const int64_t* p, size_t n) { raw(p, n * sizeof(int64_t)); }
  void f64(double v) { raw(&v, sizeof v); }
  void f32s(const float* p, size_t n) { raw(p, n * sizeof(float)); }
  // Padded to 8 bytes, so the int64 fields after it stay aligned.
  void text(const std::string& s) {
    i64(static_cast<int64_t>(s.size()));
    raw(s.data(), s.size());
    static const char zeros[8] = {0};
    raw(zeros, (8 - s.size() % 8) % 8);
  }
  // Reserves `bytes` bytes (padded with zeros to a multiple of 4, so float fields after them
  // stay aligned) and returns where to write them: rows as a table stores them (16-bit ones).
  char* bytes_slot(size_t bytes) {
    const size_t at = buf_.size();
    buf_.resize(at + padded(bytes), 0);
    return buf_.data() + at;
  }
  static size_t padded(size_t bytes) { return (bytes + 3) & ~size_t{3}; }
  // Reserves n floats and returns where to write them (valid until the next append).
  float* f32_slot(size_t n) {
    const size_t at = buf_.size();
    buf_.resize(at + n * sizeof(float));
    return reinterpret_cast<float*>(buf_.data() + at);
  }
  void reserve(size_t bytes) { buf_.reserve(bytes); }
  std::vector<char> take() { return std::move(buf_); }

 private:
  void raw(const void* p, size_t bytes) {
    const size_t at = buf_.size();
    buf_.resize(at + bytes);
    if (bytes) std::memcpy(buf_.data() + at, p, bytes);
  }
  std::vector<char> buf_;
};

class Reader {
 public:
  explicit Reader(const std::vector<char>& buf) : buf_(buf) {}
  int64_t i64() {
    int64_t v;
    std::memcpy(&v, take(sizeof v), sizeof v);
    return v;
  }
  double f64() {
    double v;
    std::memcpy(&v, take(sizeof v), sizeof v);
    return v;
  }
  // Copies n int64 values out (they may sit at any 4-byte boundary); checked before allocating.
  std::vector<int64_t> i64s(size_t n) {
    const char* p = take_array(n, sizeof(int64_t));
    std::vector<int64_t> out(n);
    if (n) std::memcpy(out.data(), p, n * sizeof(int64_t));
    return out;
  }
  // Reads n int64 values in place; requests put every int64 field first, so they are aligned.
  const int64_t* i64_view(size_t n) {
    const char* p = take_array(n, sizeof(int64_t));
    if (reinterpret_cast<uintptr_t>(p) % alignof(int64_t) != 0) fail();
    return reinterpret_cast<const int64_t*>(p);
  }
  // Float arrays are read in place: every field is a multiple of 4 bytes and buffers come
  // from the heap, so they are always 4-byte aligned.
  const float* f32s(size_t n) { return reinterpret_cast<const float*>(take_array(n, sizeof(float))); }
  // rows x dim floats, where either may come from the wire: checked without forming rows * dim.
  const float* f32s(int64_t rows, int64_t dim) {
    if (rows < 0 || dim < 0) fail();
    if (rows == 0 || dim == 0) return f32s(size_t{0});
    if (static_cast<uint64_t>(rows) > remaining() / sizeof(float) / static_cast<uint64_t>(dim)) fail();
    return f32s(static_cast<size_t>(rows) * static_cast<size_t>(dim));
  }
  // rows of `row_bytes` bytes each (as bytes_slot wrote them, padded), where either count may
  // come from the wire: checked without forming their product first.
  const char* row_bytes(int64_t rows, int64_t row_bytes) {
    if (rows < 0 || row_bytes < 0) fail();
    if (rows == 0 || row_bytes == 0) return take(0);
    if (static_cast<uint64_t>(rows) > remaining() / static_cast<uint64_t>(row_bytes)) fail();
    const auto bytes = static_cast<size_t>(rows) * static_cast<size_t>(row_bytes);
    const char* p = take(bytes);
    take(Writer::padded(bytes) - bytes);
    return p;
  }
  // A count read from the wire, as a size: negative is malformed, and so is more elements of
  // `bytes_each` (> 0: each takes at least that much of the message) than the rest could hold.
  size_t count(int64_t n, size_t bytes_each) {
    if (n < 0) fail();
    if (bytes_each && static_cast<uint64_t>(n) > remaining() / bytes_each) fail();
    return static_cast<size_t>(n);
  }
  std::string text() {
    const size_t n = count(i64(), 1);
    const char* p = take(n);
    take((8 - n % 8) % 8);
    return std::string(p, n);
  }
  bool done() const { return pos_ == buf_.size(); }
  size_t remaining() const { return buf_.size() - pos_; }
  [[noreturn]] static void fail() { throw PSTransportError("hybridsync: malformed PS message"); }

 private:
  const char* take(size_t bytes) {
    if (bytes > remaining()) fail();
    const char* p = buf_.data() + pos_;
    pos_ += bytes;
    return p;
  }
  const char* take_array(size_t n, size_t elem_size) {
    if (n > remaining() / elem_size) fail();
    return take(n * elem_size);
  }
  const std::vector<char>& buf_;
  size_t pos_ = 0;
};

// One error an operation met: the rank whose input caused it and what was wrong.
struct ErrorNote {
  int64_t rank = -1;
  bool index_error = false;  // an id out of range (IndexError) rather than a bad value
  std::string message;
  std::string op;  // set when reported with a later operation's reply: the one that failed
  // A failed bounded push's number at its sender: every shard tells of it, a rank raises it once.
  int64_t id = -1;
};

// What every reply starts with: the request it answers and the errors the operation met (the
// requester's own input among them, or a peer's in a collective operation).
struct ReplyHead {
  RequestKind kind = RequestKind::kError;
  int64_t seq = -1;
  std::vector<ErrorNote> errors;
};

inline void write_reply_head(Writer& w, RequestKind kind, int64_t seq, const std::vector<ErrorNote>& errors) {
  w.i64(static_cast<int64_t>(kind));
  w.i64(seq);
  w.i64(static_cast<int64_t>(errors.size()));
  for (const ErrorNote& e : errors) {
    w.i64(e.rank);
    w.i64(e.index_error ? 1 : 0);
    w.text(e.message);
    w.text(e.op);
    w.i64(e.id);
  }
}

inline ReplyHead read_reply_head(Reader& r) {
  ReplyHead head;
  head.kind = static_cast<RequestKind>(r.i64());
  head.seq = r.i64();
  const int64_t n = r.i64();
  for (int64_t i = 0; i < n; ++i) {
    ErrorNote e;
    e.rank = r.i64();
    e.index_error = r.i64() != 0;
    e.message = r.text();
    e.op = r.text();
    e.id = r.i64();
    head.errors.push_back(std::move(e));
  }
  return head;
}

}  // namespace hybridsync
