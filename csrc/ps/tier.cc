// A shard's disk tier (see tier.h).
#include "tier.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "hybridsync/ps.h"

namespace hybridsync {
namespace {

// A compaction waits for holes of at least this many bytes, and moves rows this many bytes at a time.
constexpr int64_t kCompactAfterBytes = int64_t{4} << 20;
constexpr int64_t kCompactChunkBytes = int64_t{4} << 20;
// Rows read through the mapping before its pages are let go (read_slots): a slot touches one or
// two pages, so the mapping holds at most ~256-512 MiB of a tier file resident.
constexpr int64_t kMappedRowsBound = 65536;

// A file-name-safe form of a table name (its path in the model: dots, slashes, brackets).
std::string safe_name(const std::string& table) {
  std::string out;
  for (const char ch : table) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                    ch == '-' || ch == '.';
    out += ok ? ch : '_';
  }
  return out.empty() ? "table" : out.substr(0, 100);
}

// mkdir -p; "" on success, else what failed.
std::string make_dirs(const std::string& dir) {
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at < dir.size() && dir[at] != '/') continue;
    const std::string part = dir.substr(0, at);
    if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) return part + ": " + std::strerror(errno);
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return dir + ": not a directory";
  return "";
}

std::string megabytes(int64_t bytes) {
  return std::to_string(bytes / 1048576) + "." + std::to_string(bytes % 1048576 * 10 / 1048576) + " MiB";
}

}  // namespace

DiskTier::DiskTier(const std::string& table, const std::string& dir, int shard, int64_t slot_bytes, Tracer* tracer)
    : table_(table), slot_bytes_(slot_bytes), tracer_(tracer) {
  if (dir.empty()) throw PSError("table '" + table + "': a disk tier needs a path (a directory)");
  const std::string made = make_dirs(dir);
  if (!made.empty()) throw PSError("table '" + table + "': cannot make its disk tier's directory " + made);
  // A file of its own: tables of one name live at once (a table moving to another layout or
  // storage is made before the old one is dropped), and a file is never taken over -- an
  // existing one (another live table's, or one a crashed run left) gets the next number.
  static std::atomic<int64_t> next_file{0};
  const std::string stem = dir + (dir.back() == '/' ? "" : "/") + safe_name(table) + ".shard" +
                           std::to_string(shard) + "." + std::to_string(getpid()) + "-";
  do {
    path_ = stem + std::to_string(next_file++) + ".tier";
    fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOATIME, 0600);
  } while (fd_ < 0 && errno == EEXIST);
  if (fd_ < 0) fail("cannot be created", errno);
}

DiskTier::~DiskTier() {
  if (map_) munmap(map_, static_cast<size_t>(map_bytes_));
  if (fd_ >= 0) {
    close(fd_);
    unlink(path_.c_str());
  }
}

void DiskTier::fail(const std::string& what, int error) const {
  throw PSError("table '" + table_ + "': its disk tier file " + path_ + " " + what +
                (error ? std::string(": ") + std::strerror(error) : std::string()));
}

void DiskTier::bug(const std::string& what) const {
  // (std::logic_error, not PSError: a push round takes a PSError for a full disk and goes on)
  throw std::logic_error("table '" + table_ + "': disk tier " + path_ + ": " + what + " (a bug)");
}

void DiskTier::check() const {
  struct stat st;
  if (fstat(fd_, &st) != 0) fail("cannot be read", errno);
  if (st.st_nlink == 0 || access(path_.c_str(), F_OK) != 0) fail("is missing (deleted while the table used it)", 0);
  if (st.st_size < end_ * slot_bytes_) {
    fail("is truncated: " + std::to_string(st.st_size) + " bytes, it holds " + std::to_string(end_ * slot_bytes_), 0);
  }
}

void DiskTier::read_slots_by_pread(const int64_t* entries, int64_t n, char* buf) const {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slot_[static_cast<size_t>(entries[i])];
    char* dst = buf + i * slot_bytes_;
    int64_t done = 0;
    while (done < slot_bytes_) {
      const ssize_t got = pread(fd_, dst + done, static_cast<size_t>(slot_bytes_ - done), slot * slot_bytes_ + done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) fail("cannot be read", got < 0 ? errno : EIO);  // (the size was checked: not a short file)
      done += got;
    }
  }
}

const char* DiskTier::mapping(int64_t bytes) const {
  if (!use_mapping_) return nullptr;
  if (bytes <= map_bytes_) return map_;
  if (map_) munmap(map_, static_cast<size_t>(map_bytes_));
  map_ = nullptr;
  map_bytes_ = 0;
  // Room to grow (a mapping may reach past the file's end; only slots inside it are read).
  const int64_t want = std::max<int64_t>(2 * bytes, int64_t{64} << 20);
  void* at = mmap(nullptr, static_cast<size_t>(want), PROT_READ, MAP_SHARED, fd_, 0);
  if (at == MAP_FAILED) return nullptr;
  map_ = static_cast<char*>(at);
  map_bytes_ = want;
  return map_;
}

void DiskTier::read_slots(const int64_t* entries, int64_t n, char* buf) const {
  if (n == 0) return;
  int64_t last = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slot_[static_cast<size_t>(entries[i])];
    if (slot < 0) bug("entry " + std::to_string(entries[i]) + " was read after its row left the file");
    last = std::max(last, slot);
  }
  // A file cut short under the table is an error before any byte of it is read.
  struct stat st;
  if (fstat(fd_, &st) != 0) fail("cannot be read", errno);
  if (st.st_size < (last + 1) * slot_bytes_) {
    fail("is truncated: " + std::to_string(st.st_size) + " bytes, slot " + std::to_string(last) + " ends at " +
             std::to_string((last + 1) * slot_bytes_),
         0);
  }
  const char* map = mapping(end_ * slot_bytes_);
  if (!map) {
    read_slots_by_pread(entries, n, buf);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(buf + i * slot_bytes_, map + slot_[static_cast<size_t>(entries[i])] * slot_bytes_,
                static_cast<size_t>(slot_bytes_));
  }
  // Pages read through the mapping count in the process's resident memory until let go (the
  // page cache keeps them; the next reads map theirs again, a minor fault each). Training's reads
  // would map the whole file in time, and a bulk read (a checkpoint or a relayout streaming the
  // file, a compaction) at once: the mapping's pages are let go every kMappedRowsBound rows read.
  mapped_rows_ += n;
  if (mapped_rows_ >= kMappedRowsBound) {
    madvise(map_, static_cast<size_t>(map_bytes_), MADV_DONTNEED);
    mapped_rows_ = 0;
  }
}

void DiskTier::read(const int64_t* entries, int64_t n, char* buf) const {
  if (n == 0) return;
  const int64_t start = tracer_ ? tracer_->start() : 0;
  read_slots(entries, n, buf);
  bytes_read_ += n * slot_bytes_;
  if (tracer_) tracer_->record("tier read", start, n);
}

namespace {

// pwrite of all `bytes`; 0, or the errno of the failure (ENOSPC for a write that took nothing).
// *done: the bytes written.
int write_all(int fd, const char* src, int64_t bytes, int64_t offset, int64_t* done) {
  *done = 0;
  while (*done < bytes) {
    const ssize_t put = pwrite(fd, src + *done, static_cast<size_t>(bytes - *done), offset + *done);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return put < 0 ? errno : ENOSPC;
    *done += put;
  }
  return 0;
}

}  // namespace

int DiskTier::append(const char* payloads, int64_t n) {
  int64_t done = 0;
  const int error = write_all(fd_, payloads, n * slot_bytes_, end_ * slot_bytes_, &done);
  if (error && done > 0 && ftruncate(fd_, end_ * slot_bytes_) != 0) {  // (best effort: a longer file only wastes space)
  }
  return error;
}

void DiskTier::store(const int64_t* keys, const int64_t* entries, int64_t n, const char* payloads) {
  if (n == 0) return;
  for (int64_t i = 0; entries && i < n; ++i) {
    const int64_t e = entries[i];
    if (e >= 0 && (e >= this->entries() || !released(e) || keys_.id(e) != keys[i])) {
      bug("key " + std::to_string(keys[i]) + " was stored to entry " + std::to_string(e) + ", not its released one");
    }
  }
  // Holes outnumbering the rows (and a few MiB): compact first, so the file stays within about
  // twice what it holds and each compaction moves no more rows than the holes it removes.
  const int64_t holes = end_ - size();
  if (holes > std::max(size() + n, kCompactAfterBytes / slot_bytes_)) compact();
  const int64_t start = tracer_ ? tracer_->start() : 0;
  int error = append(payloads, n);
  if (error && end_ > size()) {  // a full disk, with room inside the file: make it and try again
    compact();
    error = append(payloads, n);
  }
  if (error) fail("could not take " + megabytes(n * slot_bytes_) + " (" + std::to_string(n) + " rows)", error);
  if (!entries) {
    keys_.insert_many(keys, n);
    for (int64_t i = 0; i < n; ++i) slot_.push_back(end_++);
  } else {
    std::vector<int64_t> fresh, fresh_slots;  // new entries' keys, in order, and their slots
    for (int64_t i = 0; i < n; ++i) {
      if (entries[i] >= 0) continue;
      fresh.push_back(keys[i]);
      fresh_slots.push_back(end_ + i);
    }
    // (first: if the index cannot grow, nothing else has changed)
    keys_.insert_many(fresh.data(), static_cast<int64_t>(fresh.size()));
    slot_.insert(slot_.end(), fresh_slots.begin(), fresh_slots.end());
    for (int64_t i = 0; i < n; ++i) {
      if (entries[i] < 0) continue;
      slot_[static_cast<size_t>(entries[i])] = end_ + i;
      --released_;
    }
    end_ += n;
  }
  bytes_written_ += n * slot_bytes_;
  if (tracer_) tracer_->record("tier write", start, n);
}

void DiskTier::compact() {
  const int64_t held = size();
  if (held == 0 && released_ == 0) {
    clear();
    return;
  }
  if (held == 0) {  // (released entries only: they keep their keys, the file its space back)
    end_ = 0;
    if (ftruncate(fd_, 0) != 0) {  // (best effort: a longer file only wastes space)
    }
    return;
  }
  if (end_ == held) return;  // no holes
  const int64_t start = tracer_ ? tracer_->start() : 0;
  std::vector<int64_t> order;  // entries holding a row, by slot
  order.reserve(static_cast<size_t>(held));
  for (int64_t e = 0; e < entries(); ++e) {
    if (slot_[static_cast<size_t>(e)] >= 0) order.push_back(e);
  }
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return slot_[a] < slot_[b]; });
  // Entry order[k] goes to slot k (<= where it is). Chunk by chunk: a chunk is read whole before
  // it is written, and its writes land below every later entry's slot, so a failure anywhere
  // leaves each row either moved (and indexed there) or untouched where it was.
  int64_t k = 0;
  while (k < held && slot_[static_cast<size_t>(order[static_cast<size_t>(k)])] == k) ++k;  // already in place
  const int64_t chunk = std::max<int64_t>(1, kCompactChunkBytes / slot_bytes_), moved = held - k;
  std::vector<char> staging(static_cast<size_t>(std::min(chunk, moved) * slot_bytes_));
  while (k < held) {
    const int64_t count = std::min(chunk, held - k);
    read_slots(order.data() + k, count, staging.data());
    int64_t done = 0;
    const int error = write_all(fd_, staging.data(), count * slot_bytes_, k * slot_bytes_, &done);
    for (int64_t j = 0; j < done / slot_bytes_; ++j) slot_[static_cast<size_t>(order[static_cast<size_t>(k + j)])] = k + j;
    if (error) fail("cannot be compacted", error);
    k += count;
  }
  end_ = held;
  if (ftruncate(fd_, end_ * slot_bytes_) != 0) {  // (best effort: a longer file only wastes space)
  }
  bytes_read_ += moved * slot_bytes_;
  bytes_written_ += moved * slot_bytes_;
  ++compactions_;
  if (tracer_) tracer_->record("tier compact", start, moved);
}

void DiskTier::release(const int64_t* entries, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (entries[i] < 0 || entries[i] >= this->entries()) {
      bug("has no entry " + std::to_string(entries[i]) + " to release");
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    int64_t& slot = slot_[static_cast<size_t>(entries[i])];
    if (slot < 0) bug("entry " + std::to_string(entries[i]) + " was released twice");
    slot = -1;
    ++released_;
  }
}

std::vector<std::pair<int64_t, int64_t>> DiskTier::remove(std::vector<int64_t> entries) {
  std::sort(entries.begin(), entries.end());  // (an entry named twice is removed once)
  entries.erase(std::unique(entries.begin(), entries.end()), entries.end());
  for (const int64_t e : entries) {
    if (e < 0 || e >= this->entries()) {
      bug("has no entry " + std::to_string(e) + " to remove");
    }
  }
  for (const int64_t e : entries) released_ -= slot_[static_cast<size_t>(e)] < 0 ? 1 : 0;
  auto moves = keys_.erase_many(std::move(entries));
  for (const auto& [from, to] : moves) slot_[static_cast<size_t>(to)] = slot_[static_cast<size_t>(from)];
  slot_.resize(static_cast<size_t>(keys_.size()));
  if (keys_.size() == 0) clear();  // (an empty tier gives its space back)
  return moves;
}

void DiskTier::clear() {
  keys_.clear();
  slot_.clear();
  released_ = 0;
  end_ = 0;
  if (ftruncate(fd_, 0) != 0) fail("cannot be emptied", errno);
}

void DiskTier::reset(int64_t slot_bytes) {
  clear();
  slot_bytes_ = slot_bytes;
}

void DiskTier::relayout(int64_t row_bytes, const std::vector<char>& tail) {
  if (released_ > 0) bug("was relaid with released entries");
  const int64_t held = size(), old_size = slot_bytes_, size = row_bytes + static_cast<int64_t>(tail.size());
  if (held == 0) {
    reset(size);
    return;
  }
  constexpr int64_t kChunk = 65536;
  std::vector<int64_t> keys = keys_.ids();
  std::vector<char> rows(static_cast<size_t>(held * row_bytes)), records;
  for (int64_t begin = 0; begin < held; begin += kChunk) {
    const int64_t count = std::min(kChunk, held - begin);
    std::vector<int64_t> entries(static_cast<size_t>(count));
    std::iota(entries.begin(), entries.end(), begin);
    records.resize(static_cast<size_t>(count * old_size));
    read(entries.data(), count, records.data());
    for (int64_t k = 0; k < count; ++k) {
      std::memcpy(rows.data() + (begin + k) * row_bytes, records.data() + k * old_size, static_cast<size_t>(row_bytes));
    }
  }
  reset(size);
  for (int64_t begin = 0; begin < held; begin += kChunk) {
    const int64_t count = std::min(kChunk, held - begin);
    records.resize(static_cast<size_t>(count * size));
    for (int64_t k = 0; k < count; ++k) {
      char* record = records.data() + k * size;
      std::memcpy(record, rows.data() + (begin + k) * row_bytes, static_cast<size_t>(row_bytes));
      std::memcpy(record + row_bytes, tail.data(), tail.size());
    }
    add(keys.data() + begin, count, records.data());
  }
}

void DiskTier::edit_records(const std::function<void(char* records, int64_t n)>& edit) {
  const int64_t held = size();
  if (held == 0) return;
  check();
  compact();  // entries then fill slots [0, held): one sequential pass covers them all
  const int64_t start = tracer_ ? tracer_->start() : 0;
  const int64_t chunk = std::max<int64_t>(1, kCompactChunkBytes / slot_bytes_);
  std::vector<char> staging(static_cast<size_t>(std::min(chunk, held) * slot_bytes_));
  for (int64_t begin = 0; begin < held; begin += chunk) {
    const int64_t count = std::min(chunk, held - begin), bytes = count * slot_bytes_;
    int64_t done = 0;
    while (done < bytes) {
      const ssize_t got = pread(fd_, staging.data() + done, static_cast<size_t>(bytes - done), begin * slot_bytes_ + done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) fail("cannot be read", got < 0 ? errno : EIO);
      done += got;
    }
    edit(staging.data(), count);
    const int error = write_all(fd_, staging.data(), bytes, begin * slot_bytes_, &done);
    if (error) fail("cannot be rewritten", error);
  }
  bytes_read_ += held * slot_bytes_;
  bytes_written_ += held * slot_bytes_;
  if (tracer_) tracer_->record("tier rewrite", start, held);
}

int64_t DiskTier::index_bytes() const {
  return keys_.bytes() + static_cast<int64_t>(slot_.capacity() * sizeof(int64_t));
}

}  // namespace hybridsync
