"""A fixed table with a disk tier, saved as what training wrote: the shard file of a checkpoint
or an elastic commit holds only the rows that differ from their initial value (their global ids,
rows and server-optimizer slots); every other row is a function of (seed, id) that the table's
row_init() names, and the loader resets the shard to it before writing the saved rows back.

An elastic commit of such a table (Commit) keeps the same file on the rank's local disk, next to
its tier file. Both ways stream in CHUNK_ROWS rows: a rank holds the ids of its written rows and
one chunk, never its shard -- a table larger than memory saves and loads within its memory
share. The file is a safetensors file with the same arrays as a full shard file ("ids", "rows",
"slot.<name>"), only fewer rows.
"""
from __future__ import annotations

import itertools
import os
import weakref
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..array_files import StreamedWriter

CHUNK_ROWS = 65536


def save(table, path: Path) -> dict:
    """Local: writes this rank's written rows of `table` (a PSTable with a disk tier) to the
    safetensors file `path`, CHUNK_ROWS rows at a time. Returns {"sha256", "rows"}."""
    ids = table.written_ids()
    n, dim = len(ids), table.dim
    arrays = ["rows"] + [f"slot.{name}" for name in table.slot_names]
    writer = StreamedWriter(path, [("ids", np.int64, (n,))] + [(key, np.float32, (n, dim)) for key in arrays])
    try:
        for start in range(0, n, CHUNK_ROWS):
            writer.write("ids", ids[start:start + CHUNK_ROWS])
        for k, key in enumerate(arrays):  # (k - 1: the rows, then each slot)
            for start in range(0, n, CHUNK_ROWS):
                writer.write(key, table.local_rows(ids[start:start + CHUNK_ROWS], k - 1))
        sha256 = writer.close()
    except BaseException:
        writer.abandon()
        raise
    return {"sha256": sha256, "rows": int(n)}


def write_back(table, path: Path, rows: int, slots: list, keep=None) -> None:
    """Local: writes the rows of a shard file (`rows` of them; its slots named `slots`, in the
    table's order) into this rank's shard, CHUNK_ROWS rows at a time; keep(ids) -> mask picks the
    ids this rank owns (None: all of them)."""
    arrays = ["rows"] + [f"slot.{name}" for name in slots]
    with safe_open(str(path), framework="numpy") as f:
        for start in range(0, rows, CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, rows)
            ids = f.get_slice("ids")[start:stop]
            mask = keep(ids) if keep is not None else np.ones(len(ids), bool)
            if not mask.any():
                continue
            for k, key in enumerate(arrays):
                table.write_rows(ids[mask], f.get_slice(key)[start:stop][mask], slot=k - 1)


class Commit:
    """An elastic commit of this rank's shard of a fixed table with a disk tier: its written rows
    in a file beside the tier's own (the rank's local disk, not its memory), and what the other
    rows hold. The file goes when the commit does (the next commit, or the process's end)."""

    _made = itertools.count()

    def __init__(self, table):
        directory = Path(table.storage["path"])
        self.path = directory / f".{file_name(table.name)}.commit-{os.getpid()}-{next(Commit._made)}.safetensors"
        weakref.finalize(self, _remove, self.path)  # (an unfinished file too)
        self.rows = save(table, self.path)["rows"]
        self.init, self.slots = table.row_init(), table.slot_names

    def restore(self, table, step: int) -> None:
        """Local: the shard goes back to what it held at the commit, and its step."""
        table.reset_rows(self.init)
        write_back(table, self.path, self.rows, self.slots)
        table.set_step(step)


def file_name(name: str) -> str:
    """`name` as part of a file name (a table's name may hold any character)."""
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name)[:100] or "table"


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
