"""Which shard owns a row: the Python twin of csrc/ps/partitioner.cc (tested against it).

cyclic: id -> shard id % S, local id // S   (default; Zipf-hot small ids land on every shard)
block:  id -> shard id // ceil(N/S), local id % ceil(N/S)
"""
from __future__ import annotations

import numpy as np

KINDS = ("cyclic", "block")


class Partition:
    def __init__(self, num_rows: int, num_shards: int, kind: str = "cyclic"):
        if kind not in KINDS:
            raise ValueError(f"unknown partition {kind!r} (known: {', '.join(KINDS)})")
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {num_rows}")
        self.num_rows, self.num_shards, self.kind = num_rows, num_shards, kind
        self.block = max(1, -(-num_rows // num_shards))

    def shard_of(self, ids):
        ids = np.asarray(ids, dtype=np.int64)
        return ids % self.num_shards if self.kind == "cyclic" else ids // self.block

    def local_index(self, ids):
        ids = np.asarray(ids, dtype=np.int64)
        return ids // self.num_shards if self.kind == "cyclic" else ids % self.block

    def global_id(self, shard: int, local):
        local = np.asarray(local, dtype=np.int64)
        return local * self.num_shards + shard if self.kind == "cyclic" else shard * self.block + local

    def shard_rows(self, shard: int) -> int:
        if self.kind == "cyclic":
            return max(0, -(-(self.num_rows - shard) // self.num_shards))
        begin = shard * self.block
        return max(0, min(self.block, self.num_rows - begin))

    def rows_of(self, shard: int) -> np.ndarray:
        """Global ids held by `shard`, in its storage order."""
        return self.global_id(shard, np.arange(self.shard_rows(shard)))
