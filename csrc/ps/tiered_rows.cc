// A fixed table's shard with a disk tier (see tiered_rows.h).
#include "tiered_rows.h"

#include <algorithm>
#include <cstring>

namespace hybridsync {
TieredRows::TieredRows(int64_t shard_rows, int64_t memory, int64_t id_stride, int64_t id_offset,
                       std::unique_ptr<DiskTier> disk)
    : rows_(shard_rows), memory_(std::max<int64_t>(1, memory)), id_stride_(id_stride), id_offset_(id_offset),
      disk_(std::move(disk)) {
  resident_.reserve(memory_);
}

void TieredRows::reset(const RowInit& init) {
  resident_.clear();
  tick_.clear();
  dirty_.clear();
  disk_->clear();
  init_ = init;
}

void TieredRows::initialize(Shard& arena, int64_t l, int64_t p) const {
  std::vector<float> row(static_cast<size_t>(arena.dim()));
  init_.fill(static_cast<uint64_t>(id_of(l)), arena.dim(), row.data());
  arena.set_row(p, row.data());
  arena.reset_slots(p);
}

void TieredRows::spill(Shard& arena, int64_t incoming, SpillMode mode) {
  const int64_t held = resident_.size();
  if (held + incoming <= memory_) return;
  std::vector<int64_t> eligible;  // rows this operation does not touch
  for (int64_t p = 0; p < held; ++p) {
    if (tick_[static_cast<size_t>(p)] != now_) eligible.push_back(p);
  }
  // An eighth of the share at least, so a full memory does not spill a few rows every time.
  const int64_t k = std::min<int64_t>(std::max(held + incoming - memory_, memory_ / 8), eligible.size());
  if (k <= 0) return;
  auto older = [&](int64_t x, int64_t y) {  // least recently used first, then the lower row
    if (tick_[static_cast<size_t>(x)] != tick_[static_cast<size_t>(y)]) {
      return tick_[static_cast<size_t>(x)] < tick_[static_cast<size_t>(y)];
    }
    return resident_.id(x) < resident_.id(y);
  };
  std::nth_element(eligible.begin(), eligible.begin() + (k - 1), eligible.end(), older);
  eligible.resize(static_cast<size_t>(k));
  // Rows holding their initial value are forgotten; the others are written first (all or
  // nothing), so a full disk leaves every row where it was.
  std::vector<int64_t> keys;
  std::vector<char> records;
  const int64_t size = arena.record_size();
  for (const int64_t p : eligible) {
    if (!dirty_[static_cast<size_t>(p)]) continue;
    keys.push_back(resident_.id(p));
    records.resize(records.size() + static_cast<size_t>(size));
    arena.get_record(p, records.data() + records.size() - size);
  }
  try {
    disk_->add(keys.data(), static_cast<int64_t>(keys.size()), records.data());
  } catch (const PSError&) {
    if (mode == SpillMode::kMust) throw;
    return;  // (add changed nothing: the rows stay in memory)
  }
  for (const auto& [from, to] : resident_.erase_many(std::move(eligible))) {
    arena.copy_row(from, to);
    tick_[static_cast<size_t>(to)] = tick_[static_cast<size_t>(from)];
    dirty_[static_cast<size_t>(to)] = dirty_[static_cast<size_t>(from)];
  }
  tick_.resize(static_cast<size_t>(resident_.size()));
  dirty_.resize(static_cast<size_t>(resident_.size()));
}

void TieredRows::locate(Shard& arena, const int64_t* local, int64_t n, std::vector<int64_t>* pos, SpillMode mode) {
  ++now_;
  pos->resize(static_cast<size_t>(n));
  resident_.find_many(local, n, pos->data());
  int64_t incoming = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = (*pos)[static_cast<size_t>(i)];
    if (p >= 0) {
      tick_[static_cast<size_t>(p)] = now_;
    } else {
      ++incoming;
    }
  }
  hits_ += n - incoming;
  // Memory over its share (an earlier operation touched more rows than it holds: a write of the
  // whole shard) spills here even when every row this operation needs is already in memory.
  if (incoming == 0 && resident_.size() <= memory_) return;
  const int64_t before = resident_.size();
  spill(arena, incoming, mode);
  if (resident_.size() != before) resident_.find_many(local, n, pos->data());  // spilling moved rows
  if (incoming == 0) return;
  // The distinct rows missing, and those of them on disk: read before anything changes.
  std::vector<int64_t> missing;
  {
    IdMap seen;
    for (int64_t i = 0; i < n; ++i) {
      if ((*pos)[static_cast<size_t>(i)] < 0 && seen.find(local[i]) < 0) {
        seen.insert(local[i]);
        missing.push_back(local[i]);
      }
    }
  }
  const auto m = static_cast<int64_t>(missing.size());
  std::vector<int64_t> entry(static_cast<size_t>(m)), found;
  disk_->find_many(missing.data(), m, entry.data());
  for (const int64_t e : entry) {
    if (e >= 0) found.push_back(e);
  }
  const int64_t size = arena.record_size();
  std::vector<char> records(found.size() * static_cast<size_t>(size));
  disk_->read(found.data(), static_cast<int64_t>(found.size()), records.data());
  loads_ += static_cast<int64_t>(found.size());
  // Then into memory (the arena grows if this operation needs more than the share).
  const int64_t needed = resident_.size() + m;
  if (needed > arena.rows()) arena.grow(std::max(needed, arena.rows() * 2), resident_.size());
  size_t next_record = 0;
  for (int64_t k = 0; k < m; ++k) {
    const int64_t p = resident_.insert(missing[static_cast<size_t>(k)]);
    tick_.push_back(now_);
    if (entry[static_cast<size_t>(k)] >= 0) {
      arena.set_record(p, records.data() + (next_record++) * size);
      dirty_.push_back(1);  // its only copy now: it leaves the disk below
    } else {
      initialize(arena, missing[static_cast<size_t>(k)], p);
      dirty_.push_back(0);
    }
  }
  disk_->remove(std::move(found));
  resident_.find_many(local, n, pos->data());
}

void TieredRows::prefetch(Shard& arena, const int64_t* local, int64_t n) {
  std::vector<int64_t> pos;
  locate(arena, local, n, &pos);
}

void TieredRows::gather(const Shard& arena, const int64_t* local, int64_t n, float* out, int slot) const {
  const int64_t dim = arena.dim(), size = arena.record_size();
  std::vector<int64_t> pos(static_cast<size_t>(n)), entry(static_cast<size_t>(n), -1), on_disk;
  resident_.find_many(local, n, pos.data());
  for (int64_t i = 0; i < n; ++i) {
    if (pos[static_cast<size_t>(i)] < 0) entry[static_cast<size_t>(i)] = disk_->find(local[i]);
    if (entry[static_cast<size_t>(i)] >= 0) on_disk.push_back(entry[static_cast<size_t>(i)]);
  }
  std::vector<char> records(on_disk.size() * static_cast<size_t>(size));
  disk_->read(on_disk.data(), static_cast<int64_t>(on_disk.size()), records.data());
  size_t next_record = 0;
  std::vector<char> raw(static_cast<size_t>(arena.row_size()));
  for (int64_t i = 0; i < n; ++i) {
    float* dst = out + i * dim;
    const int64_t p = pos[static_cast<size_t>(i)];
    if (p >= 0) {
      arena.gather(&p, 1, dst, slot);
    } else if (entry[static_cast<size_t>(i)] >= 0) {
      const char* record = records.data() + (next_record++) * size;
      if (slot >= 0) {
        std::memcpy(dst, record + arena.row_size() + slot * dim * static_cast<int64_t>(sizeof(float)), sizeof(float) * dim);
      } else if (arena.row_type() == RowType::kFloat32) {
        std::memcpy(dst, record, sizeof(float) * dim);
      } else {
        decode_row(arena.row_type(), reinterpret_cast<const uint16_t*>(record), dst, dim);
      }
    } else if (slot >= 0) {
      std::fill(dst, dst + dim, arena.rule().slot_init(slot));
    } else {
      init_.fill(static_cast<uint64_t>(id_of(local[i])), dim, dst);
      if (arena.row_type() != RowType::kFloat32) {  // as it would be stored
        encode_row(arena.row_type(), dst, reinterpret_cast<uint16_t*>(raw.data()), dim);
        decode_row(arena.row_type(), reinterpret_cast<const uint16_t*>(raw.data()), dst, dim);
      }
    }
  }
}

void TieredRows::gather_raw(const Shard& arena, const int64_t* local, int64_t n, char* out) const {
  if (arena.row_type() == RowType::kFloat32) {
    gather(arena, local, n, reinterpret_cast<float*>(out), -1);
    return;
  }
  // 16-bit rows: decoded and encoded again, exactly (every 16-bit value is a float32 value).
  const int64_t dim = arena.dim();
  std::vector<float> rows(static_cast<size_t>(n * dim));
  gather(arena, local, n, rows.data(), -1);
  encode_row(arena.row_type(), rows.data(), reinterpret_cast<uint16_t*>(out), n * dim);
}

void TieredRows::scatter(Shard& arena, const int64_t* local, int64_t n, const float* values, int slot) {
  std::vector<int64_t> pos;
  locate(arena, local, n, &pos);
  arena.scatter(pos.data(), n, values, slot);
  for (const int64_t p : pos) dirty_[static_cast<size_t>(p)] = 1;
}

void TieredRows::apply(Shard& arena, const int64_t* local, int64_t n, const float* grads) {
  std::vector<int64_t> pos;
  locate(arena, local, n, &pos, SpillMode::kIfRoom);  // (reading may fail: before the rule's step advances)
  arena.rule().begin_step();
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = id_of(local[i]);
  arena.apply(pos.data(), n, grads, ids.data());
  for (const int64_t p : pos) dirty_[static_cast<size_t>(p)] = 1;
  ++steps_;
}

void TieredRows::new_rule(Shard& arena) { disk_->relayout(arena.row_size(), arena.fresh_slots()); }

void TieredRows::rescale_accumulators(Shard& arena, float factor) {
  arena.rescale_accumulators(arena.rows(), factor);  // (positions not in use are set afresh when used)
  disk_->edit_records([&](char* records, int64_t n) { arena.rescale_record_accumulators(records, n, factor); });
}

std::vector<int64_t> TieredRows::written_in_memory() const {
  std::vector<int64_t> out;
  for (int64_t p = 0; p < resident_.size(); ++p) {
    if (dirty_[static_cast<size_t>(p)]) out.push_back(resident_.id(p));
  }
  return out;
}

int64_t TieredRows::index_bytes() const {
  return resident_.bytes() + static_cast<int64_t>(tick_.capacity() * 4 + dirty_.capacity()) + disk_->index_bytes();
}

}  // namespace hybridsync
