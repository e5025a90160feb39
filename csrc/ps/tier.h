// A shard's disk tier: a file of fixed-size slots on the rank's local disk, each holding one row
// as stored (float32 or 16-bit) followed by its optimizer slots (float32), and the map from the
// rows' keys (a fixed table's local row, a dynamic table's id) to their slots. Only rows that
// left memory are here, so a file holds what training wrote and nothing else: rows never
// written (a fixed table's seeded initial values) cost no disk.
//
// The file is written like a log: rows going to disk are appended in one write, and a row read
// back leaves a hole. A dynamic table's row read back may keep its entry (release(): key and
// index stay, the slot is a hole) and take a new slot in it when it goes to disk again
// (store()); an entry is either released or holds a row. When the holes outnumber the rows held
// (and a few MiB at least), the next write first compacts the file in place, in large
// sequential reads and writes, and gives the space back; a write that finds the disk full
// compacts first too, if there are holes.
// Small writes into scattered slots are what a disk tier must avoid: each costs a system call
// and, in a page cache of large folios, a walk over the whole folio (measured: 36 us per 128-byte
// write into a file written in large pieces, against 0.02 us per row appended). Reads copy
// from a read-only shared mapping of the file: no system call per row (a pread each was 1-1.5
// us, most of a step's tier cost); the pages read count in the process's RSS (page cache the
// kernel reclaims under pressure) -- up to the file's size in training, while a bulk read (a
// checkpoint streaming the file) lets its pages go. Where the file cannot be mapped, reads fall
// back to one pread per row.
//
// Every operation either completes or changes nothing: a write that fails (a full disk) frees
// what it allocated and throws PSError naming the file; a file deleted or truncated under the
// table is a PSError naming it too. A compaction that fails leaves every row readable where the
// index says it is (rows it moved are indexed at their new slots).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "id_map.h"
#include "trace.h"

namespace hybridsync {

// What an operation does when the rows it must move to disk to make room cannot be written (a
// full disk). A pull's prefetch, a write, a restore fail (kMust): nothing has changed yet, and
// every rank hears of it. A push round goes on with those rows left in memory, over the share,
// until a later operation spills them (kIfRoom): a push is not answered, so a failure on one
// shard could not stop the others from applying their part -- a push never needs the disk.
enum class SpillMode { kMust, kIfRoom };

class DiskTier {
 public:
  // Creates the file `<dir>/<table>.shard<shard>.<pid>-<n>.tier` (dir is created if missing; n
  // makes it a new file, never one that exists);
  // slot_bytes per slot. `tracer` (may be null) records the reads and writes for timelines.
  DiskTier(const std::string& table, const std::string& dir, int shard, int64_t slot_bytes, Tracer* tracer);
  ~DiskTier();  // closes and removes the file
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  const std::string& path() const { return path_; }
  int64_t slot_bytes() const { return slot_bytes_; }
  void rename(std::string table) { table_ = std::move(table); }

  // Entries 0 .. entries()-1; each has a key, and a slot unless it is released (see release()).
  int64_t entries() const { return keys_.size(); }
  // Rows the file holds: entries not released.
  int64_t size() const { return keys_.size() - released_; }
  int64_t find(int64_t key) const { return keys_.find(key); }
  void find_many(const int64_t* keys, int64_t n, int64_t* out) const { keys_.find_many(keys, n, out); }
  int64_t key(int64_t entry) const { return keys_.id(entry); }
  const std::vector<int64_t>& keys() const { return keys_.ids(); }

  // Reads the slots of entries[i] (not released) into buf + i * slot_bytes.
  void read(const int64_t* entries, int64_t n, char* buf) const;
  // Adds keys[i] (absent) with the slot contents payloads + i * slot_bytes: new entries
  // entries() .. entries()+n-1, in order. All or nothing.
  void add(const int64_t* keys, int64_t n, const char* payloads) { store(keys, nullptr, n, payloads); }
  // As add(), where entries[i] >= 0 names a released entry of keys[i], which holds a row again
  // (its index unchanged); the others (-1) are new entries, appended in order. All or nothing.
  void store(const int64_t* keys, const int64_t* entries, int64_t n, const char* payloads);
  // Entries whose rows were read back and now live elsewhere (a dynamic table's memory): each
  // keeps its key and index, its slot becomes a hole. A row read back often goes to disk again,
  // and store() then gives its entry a slot without touching the index; removing the entry and
  // adding it again costs several cache misses each in an index of the table's size.
  void release(const int64_t* entries, int64_t n);
  bool released(int64_t entry) const { return slot_[static_cast<size_t>(entry)] < 0; }
  // Whether the file holds key's row (an entry not released).
  bool holds(int64_t key) const {
    const int64_t e = keys_.find(key);
    return e >= 0 && !released(e);
  }
  int64_t released_count() const { return released_; }
  // Removes entries, released or not (slots become holes); returns the moves (from, to) of
  // entries that filled the gaps, in order (see IdMap::erase_many).
  std::vector<std::pair<int64_t, int64_t>> remove(std::vector<int64_t> entries);
  // Removes every entry and gives the file's space back.
  void clear();
  // An empty tier with another slot size (a new optimizer: its slots differ).
  void reset(int64_t slot_bytes);
  // Every record keeps its first `row_bytes` (the row) and gets `tail` after them (a new
  // optimizer's fresh slots); entries keep their keys and positions. None may be released.
  void relayout(int64_t row_bytes, const std::vector<char>& tail);

  // Every record, edited in place: edit(records, n) gets n whole records at a time (slot_bytes
  // each) and changes them where they lie. The file is compacted first, then read and written
  // back in large sequential pieces (never a small write per row). A write that fails throws
  // PSError naming the file; rows before the failing piece are edited, the rest are not.
  void edit_records(const std::function<void(char* records, int64_t n)>& edit);

  // Throws PSError if the file was deleted or is shorter than what it holds.
  void check() const;
  // Bytes read and written so far (compactions included); bytes of the in-memory index.
  int64_t bytes_read() const { return bytes_read_; }
  int64_t bytes_written() const { return bytes_written_; }
  int64_t index_bytes() const;
  // Slots the file spans (rows held + holes), compactions so far; the slot of an entry.
  int64_t span() const { return end_; }
  int64_t compactions() const { return compactions_; }
  int64_t slot(int64_t entry) const { return slot_[static_cast<size_t>(entry)]; }
  // Moves every row to the front of the file, in slot order, and gives the rest back.
  void compact();
  // Reads through pread instead of a mapping (the fallback where mapping fails; tests).
  void set_use_mapping(bool on) { use_mapping_ = on; }

 private:
  [[noreturn]] void fail(const std::string& what, int error) const;
  [[noreturn]] void bug(const std::string& what) const;  // an inconsistency of the caller's
  // Appends n records at the end; 0 or the errno of a failed write (the end is restored).
  int append(const char* payloads, int64_t n);
  // Reads the slots of entries[i] into buf + i * slot_bytes, without tracing or counting.
  void read_slots(const int64_t* entries, int64_t n, char* buf) const;
  void read_slots_by_pread(const int64_t* entries, int64_t n, char* buf) const;
  // The file mapped for reading, `bytes` at least (null if it cannot be mapped).
  const char* mapping(int64_t bytes) const;
  bool use_mapping_ = true;
  mutable char* map_ = nullptr;  // (mutable: mapped on the first read that needs it)
  mutable int64_t map_bytes_ = 0;
  mutable int64_t mapped_rows_ = 0;  // rows read through the mapping since its pages were let go
  std::string table_, path_;
  int fd_ = -1;
  int64_t slot_bytes_;
  Tracer* tracer_;
  IdMap keys_;                 // key -> entry
  std::vector<int64_t> slot_;  // entry -> its slot in the file (-1: released)
  int64_t released_ = 0;
  int64_t end_ = 0;            // slots the file spans; slots not held by an entry are holes
  int64_t compactions_ = 0;
  mutable int64_t bytes_read_ = 0;
  int64_t bytes_written_ = 0;
};

}  // namespace hybridsync
