"""A dynamic table's shard file, streamed: a checkpoint or an elastic commit writes this rank's
shard -- its stored "ids" with their "rows", "slot.<name>", "counts" and "last_touch", and the
ids seen but not admitted ("pending_ids", "pending_counts", "pending_last") -- CHUNK_ROWS
entries at a time, and a load reads any shard file back the same way. A rank holds one chunk,
never its shard: a table whose rows live mostly in a disk tier saves and loads within its memory
share. The file is the safetensors file a whole shard_state() would make (same keys, dtypes and
shapes), so checkpoints written either way load alike.

An elastic commit of a table with a disk tier (Commit) keeps its file on the rank's local disk,
next to the tier's own.
"""
from __future__ import annotations

import itertools
import os
import weakref
from pathlib import Path

import numpy as np
from safetensors import safe_open

from . import written_rows
from ..array_files import StreamedWriter

_STORED = ("ids", "counts", "last_touch")  # per stored row, besides its row and slots
_PENDING = ("pending_ids", "pending_counts", "pending_last")


def save(table, path: Path) -> dict:
    """Local: writes this rank's shard of the DynamicTable `table` to the safetensors file `path`,
    written_rows.CHUNK_ROWS entries at a time. Returns {"sha256", "rows"} (rows: stored rows)."""
    chunk = written_rows.CHUNK_ROWS
    sizes = table.stats()
    stored, pending, dim = int(sizes["stored"]), int(sizes["pending"]), table.dim
    values = ["rows"] + [f"slot.{name}" for name in table.slot_names]
    layout = ([(key, np.int64, (stored,)) for key in _STORED] + [(key, np.float32, (stored, dim)) for key in values] +
              [(key, np.int64, (pending,)) for key in _PENDING])
    writer = StreamedWriter(path, layout)

    def part(is_pending, start, count, rows):
        got = table.engine.dynamic_range(table.handle, is_pending, start, min(chunk, count - start), rows)
        got.update({f"slot.{name}": s for name, s in zip(table.slot_names, got.pop("slots"))})
        return got

    try:
        for key in _STORED:  # (the shard's metadata, in memory: no row is read for these)
            for start in range(0, stored, chunk):
                writer.write(key, part(False, start, stored, False)[key])
        for key in values:  # (a pass over the rows per array: a chunk of them at a time)
            for start in range(0, stored, chunk):
                writer.write(key, part(False, start, stored, True)[key])
        for key in _PENDING:
            for start in range(0, pending, chunk):
                writer.write(key, part(True, start, pending, False)[key])
        sha256 = writer.close()
    except BaseException:
        writer.abandon()
        raise
    return {"sha256": sha256, "rows": stored}


def write_back(table, path: Path, slots: list) -> None:
    """Local: inserts the entries of a shard file (of any shard, any world size; its slots named
    `slots`) that this rank's shard owns, written_rows.CHUNK_ROWS entries at a time. Set the
    table's step first: expiry counts from it."""
    chunk = written_rows.CHUNK_ROWS
    keys = _STORED + ("rows",) + tuple(f"slot.{name}" for name in slots)
    with safe_open(str(path), framework="numpy") as f:
        stored, pending = f.get_slice("ids").get_shape()[0], f.get_slice("pending_ids").get_shape()[0]

        def piece(key, start, n):  # (safetensors slices must be non-empty and inside the array)
            if start < n:
                return f.get_slice(key)[start:min(start + chunk, n)]
            return f.get_tensor(key) if n == 0 else f.get_slice(key)[:1][:0]

        for start in range(0, max(stored, pending, 1), chunk):
            arrays = {key: piece(key, start, stored) for key in keys}
            arrays.update({key: piece(key, start, pending) for key in _PENDING})
            table.restore(arrays)


class Commit:
    """An elastic commit of this rank's shard of a dynamic table with a disk tier: its shard file
    beside the tier's own (the rank's local disk, not its memory). The file goes when the commit
    does (the next commit, or the process's end)."""

    _made = itertools.count()

    def __init__(self, table):
        directory = Path(table.storage["path"])
        self.path = directory / f".{written_rows.file_name(table.name)}.commit-{os.getpid()}-{next(Commit._made)}.safetensors"
        weakref.finalize(self, self.path.unlink, missing_ok=True)  # (an unfinished file too)
        save(table, self.path)
        self.slots = table.slot_names

    def restore(self, table, step: int) -> None:
        """Local: the shard becomes exactly what it held at the commit (ids admitted since are
        forgotten), and its step -- set before the entries, since expiry counts from it."""
        table.clear()
        table.set_step(step)
        write_back(table, self.path, self.slots)
