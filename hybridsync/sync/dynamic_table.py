"""A dynamic PS table as every frontend sees it: raw int64 ids, rows created on first touch (see
hybridsync.dynamic and docs/dynamic-tables.md). Its contents have no fixed row count, so the
whole-table operations of PSTable (read, write, scatter, replicas) are replaced by per-shard
state (ids, rows, optimizer slots, counts, last touches) that checkpoints save and any world
size restores, and by a streaming export."""
from __future__ import annotations

import os
import weakref

import numpy as np

from .. import dynamic as dyn
from .table import PSTable

EXPORT_MAGIC = b"HSDYNEXP"
_live: "weakref.WeakSet" = weakref.WeakSet()  # for explain()


class DynamicTable(PSTable):
    def __init__(self, name: str, dim: int, options: dict, shards: int = 0, rule: dict | None = None):
        """Collective: registers the table on every rank (same options everywhere)."""
        super().__init__(name, -1, dim, shards, "cyclic", rule, dynamic=options)
        self.options = dict(options)
        _live.add(self)

    def drop(self) -> None:
        _live.discard(self)
        super().drop()

    @property
    def layout(self) -> tuple[int, str]:
        return self.engine.spec(self.handle)["num_shards"], "hash"

    # -- what fixed tables do with whole arrays, refused by name ----------------------------
    def _whole(self, what):
        raise ValueError(f"dynamic table '{self.name}' has no fixed row count, so it has no {what}: read rows by id "
                         "(read_rows), save it with hybridsync.save_checkpoint, or export() it")

    def read(self, slot: int = -1):
        self._whole("whole-table read")

    def write(self, values, slot: int = -1):
        self._whole("whole-table write")

    def scatter(self, values, slot: int = -1):
        self._whole("whole-table load")

    def attach(self, replica):
        self._whole("replica")

    def initialize(self, initializer, seed):
        self._whole("initialisation pass (rows start at their seeded value when first touched)")

    def state(self) -> dict:
        """The server optimizer's identity and step; its slots travel in shard_state()."""
        return {"optimizer": self.optimizer, "step": self.step, "slots": {}}

    def load_state(self, state: dict, variable: str, everywhere: bool = False) -> None:
        if state["optimizer"] != self.optimizer:
            raise ValueError(f"variable '{variable}': checkpoint has server optimizer '{state['optimizer']}', "
                             f"this run uses '{self.optimizer}'")
        if everywhere:
            self.set_step(int(state["step"]))
        else:
            self.engine.set_table_step(self.handle, int(state["step"]))

    # -- per-shard state -----------------------------------------------------------------------
    def shard_state(self) -> dict:
        """Local: this rank's shard as flat arrays: ids, rows, slot.<name>, counts, last_touch,
        pending_ids / pending_counts / pending_last (ids seen but not admitted)."""
        s = self.engine.dynamic_state(self.handle)
        out = {k: v for k, v in s.items() if k != "slots"}
        for name, values in zip(self.slot_names, s["slots"]):
            out[f"slot.{name}"] = values
        return out

    local_state = shard_state  # what a checkpoint's shard file holds

    def restore(self, arrays: dict) -> None:
        """Local: inserts the entries of any shard's shard_state() that this rank's shard owns
        (so a checkpoint of any world size loads). Set the table's step first (expiry counts
        from it)."""
        state = {k: arrays[k] for k in ("ids", "rows", "counts", "last_touch", "pending_ids", "pending_counts",
                                        "pending_last")}
        state["slots"] = [arrays[f"slot.{name}"] for name in self.slot_names]
        self.engine.dynamic_restore(self.handle, state)

    def clear(self) -> None:
        """Local: empties this rank's shard (stored rows and pending ids), so that a checkpoint
        load leaves exactly what was saved, whatever training ran before it."""
        self.engine.dynamic_clear(self.handle)

    def stats(self) -> dict:
        """Local: this rank's shard's counters (stored, capacity share, admitted / evicted /
        expired in total and in the newest round, bytes of the map and of the rows)."""
        return self.engine.dynamic_stats(self.handle)

    # -- lookups ------------------------------------------------------------------------------
    def check_ids(self, ids):
        """(ids as int64, "") or (an empty array, the error every rank must raise)."""
        try:
            return dyn.check_ids(self.name, ids), ""
        except TypeError as exc:
            return np.zeros(0, np.int64), str(exc)

    def read_all(self) -> tuple[np.ndarray, np.ndarray]:
        """One-sided: (ids, rows) of every row the table stores, read from its shards by this
        rank alone while their owners go on training (ids listed shard by shard, then their rows
        read in chunks). This rank holds the whole table; the shards nothing extra."""
        ids = np.asarray(self.engine.dynamic_ids(self.handle), np.int64)
        return ids, (self.read_rows(ids) if len(ids) else np.zeros((0, self.dim), np.float32))

    def write_all(self, ids, rows) -> None:
        """One-sided: stores `rows` for `ids` on their shards (creating them), as read_all gave them."""
        ids = np.ascontiguousarray(ids, np.int64)
        if len(ids):
            self.engine.write_rows(self.handle, ids, np.ascontiguousarray(rows, np.float32).reshape(len(ids), self.dim))

    # -- export -----------------------------------------------------------------------------------
    def export(self, path) -> int:
        """Collective: writes every stored (id, row) pair to one file, each rank its own shard's
        at its own offset (no rank gathers the table). Format: 8-byte magic, int64 count, int64
        dim, then per pair an int64 id and dim float32 values. Returns the pairs written."""
        from .. import comm

        local = self.shard_state()
        ids, rows = local["ids"], local["rows"]
        counts = comm.objects().allgather_object(len(ids), name="hybridsync.dynamic.export")
        rank, total = self.engine.rank, int(sum(counts))
        record = 8 + 4 * self.dim
        header = len(EXPORT_MAGIC) + 16
        path = os.fspath(path)
        if rank == 0:
            with open(path, "wb") as fh:
                fh.write(EXPORT_MAGIC + np.array([total, self.dim], np.int64).tobytes())
                fh.truncate(header + total * record)
        comm.objects().allgather_object(0, name="hybridsync.dynamic.export.created")
        pairs = np.zeros(len(ids), dtype=[("id", "<i8"), ("row", "<f4", (self.dim,))])
        pairs["id"], pairs["row"] = ids, rows
        with open(path, "r+b") as fh:
            fh.seek(header + sum(counts[:rank]) * record)
            fh.write(pairs.tobytes())
        comm.objects().allgather_object(0, name="hybridsync.dynamic.export.written")
        return total


def explain_lines() -> list:
    """Lines for explain(): per live dynamic table, this rank's shards' rows stored against their
    share of capacity, rows admitted / evicted / expired in the newest step and in total, and
    bytes per stored row (rows, optimizer slots, and the id map with its per-row counters)."""
    from ..plan import format_table

    rows = []
    for table in sorted(_live, key=lambda t: t.name):
        try:
            s = table.stats()
        except (ValueError, RuntimeError):  # the engine is gone or unusable
            continue
        per_row = lambda b: f"{b / s['stored']:.0f} B" if s["stored"] else "-"  # noqa: E731
        rows.append([table.name, f"{s['stored']}/{s['capacity'] or 'unbounded'}",
                     f"{s['last_admitted']}/{s['last_evicted']}/{s['last_expired']}",
                     f"{s['admitted']}/{s['evicted']}/{s['expired']}", str(s["pending"]),
                     per_row(s["row_bytes"] + s["map_bytes"]), per_row(s["map_bytes"])])
    if not rows:
        return []
    head = ["dynamic table", "stored/capacity", "adm/evict/exp last step", "adm/evict/exp total", "pending",
            "bytes/row", "of which map"]
    return ["", "dynamic tables (this rank's shards):"] + format_table(head, rows)


def read_export(path) -> tuple[np.ndarray, np.ndarray]:
    """(ids, rows) of a file DynamicTable.export wrote."""
    with open(path, "rb") as fh:
        head = fh.read(len(EXPORT_MAGIC) + 16)
        if not head.startswith(EXPORT_MAGIC):
            raise ValueError(f"{path}: not a hybridsync dynamic table export")
        total, dim = np.frombuffer(head[len(EXPORT_MAGIC):], np.int64)
        pairs = np.frombuffer(fh.read(), dtype=[("id", "<i8"), ("row", "<f4", (int(dim),))], count=int(total))
    return pairs["id"].copy(), pairs["row"].copy()
