"""A dynamic PS table as every frontend sees it: raw int64 ids, rows created on first touch (see
dynamic_options.py and docs/dynamic-tables.md). Its contents have no fixed row count, so in place
of a fixed table's whole-table operations (read, write, scatter, replicas) it has per-shard
state (ids, rows, optimizer slots, counts, last touches) that checkpoints save and any world
size restores, by the whole table's state read and written one-sided (a state dict: read by
one rank through DynamicSnapshot / DynamicView, loaded by any), and by a streaming export."""
from __future__ import annotations

from .. import comm

import os
import weakref

import numpy as np

from . import dynamic_options as dyn
from .table import TableCore, TableView, shares_core

EXPORT_MAGIC = b"HSDYNEXP"
_live: "weakref.WeakSet" = weakref.WeakSet()  # for explain()


@shares_core
class DynamicTable:
    """A dynamic table: raw int64 ids, rows created on first touch. It has no fixed row count, so
    in place of a fixed table's whole arrays it has per-shard state, the whole table's state read
    and written one-sided, and a streaming export."""

    def __init__(self, name: str, dim: int, options: dict, shards: int = 0, rule: dict | None = None,
                 storage: dict | None = None):
        """Collective: registers the table on every rank (same options everywhere; options from
        dynamic_options.options, where each is checked; storage: see hybridsync.ps.storage)."""
        self.core = TableCore(name, -1, dim, shards, "cyclic", rule, dynamic=options, storage=storage)
        self.num_rows = -1  # no fixed row count (plans and checkpoints say so)
        self.options = dict(options)
        _live.add(self)

    def drop(self) -> None:
        _live.discard(self)
        self.core.drop()

    @property
    def layout(self) -> tuple[int, str]:
        return self.num_shards, "hash"

    def state(self) -> dict:
        """The server optimizer's state with no collective and no copy: {"optimizer", "step",
        "ids": the stored ids (sorted), "slots": {slot name: their values}}, as DynamicViews that
        read the shards on first use (a checkpoint's shard files carry the same per shard)."""
        snapshot = DynamicSnapshot(self, rows=False, slots=True)
        return {"optimizer": self.optimizer, "step": snapshot.step, "ids": snapshot.view("ids"),
                "slots": {name: snapshot.view(f"slot.{name}") for name in self.slot_names}}

    def load_state(self, state: dict, variable: str, everywhere: bool = False) -> None:
        """Restores what state() returned (views or arrays), one-sided: the step, and the slots of
        the ids this table stores (load the rows first: module.load_state_dict)."""
        if state["optimizer"] != self.optimizer:
            raise ValueError(f"variable '{variable}': checkpoint has server optimizer '{state['optimizer']}', "
                             f"this run uses '{self.optimizer}'")
        self.set_step(int(state["step"]), everywhere)
        ids, slots = state.get("ids"), state.get("slots") or {}
        if ids is None or not slots or (isinstance(ids, DynamicView) and ids.is_view_of(self)):
            return  # (an older state without slots, or this table's own)
        if sorted(slots) != sorted(self.slot_names):
            raise ValueError(f"variable '{variable}': the state has server optimizer slots {sorted(slots)}, this "
                             f"table {sorted(self.slot_names)}")
        plain = lambda v: v.read() if isinstance(v, TableView) else np.asarray(v)  # noqa: E731
        self.write_slots(plain(ids), [plain(slots[name]) for name in self.slot_names])

    # -- the whole table, one-sided: a state dict read by one rank, loaded by any -----------------
    def sizes(self) -> list:
        """One-sided: every shard's (step, stored rows, pending ids)."""
        return [tuple(int(x) for x in s) for s in self.engine.dynamic_sizes(self.handle)]

    def read_state(self, rows: bool = True, slots: bool = False) -> dict:
        """One-sided: the whole table, streamed from every shard to this rank alone while their
        owners go on: "ids" (sorted) with their "counts", "last_touch", "rows" (rows=True) and
        "slot.<name>" (slots=True); "pending_ids" (sorted), "pending_counts", "pending_last";
        "sizes" (every shard's (step, stored, pending) as read)."""
        parts = [self.engine.read_dynamic(self.handle, shard, rows, slots) for shard in range(self.layout[0])]
        names = self.slot_names if slots else []
        dim = self.dim
        out = {"sizes": [(p["step"], len(p["ids"]), len(p["pending_ids"])) for p in parts]}
        order = np.argsort(np.concatenate([p["ids"] for p in parts]), kind="stable")
        for key in ("ids", "counts", "last_touch"):
            out[key] = np.concatenate([p[key] for p in parts])[order]
        if rows:
            out["rows"] = np.concatenate([p["rows"] for p in parts]).reshape(-1, dim)[order]
        for k, name in enumerate(names):
            values = [p["slots"][k] if len(p["slots"]) > k else np.zeros((0, dim), np.float32) for p in parts]
            out[f"slot.{name}"] = np.concatenate(values).reshape(-1, dim)[order]
        waiting = np.argsort(np.concatenate([p["pending_ids"] for p in parts]), kind="stable")
        for key in ("pending_ids", "pending_counts", "pending_last"):
            out[key] = np.concatenate([p[key] for p in parts])[waiting]
        return out

    def write_state(self, arrays: dict, step: int) -> None:
        """One-sided: the table becomes exactly `arrays` (what read_state returned, saved at any
        world size): every shard emptied and set to `step`, then each entry written to the shard
        that owns it under this run's layout. The server optimizer's slots are those in `arrays`
        ("slot.<name>", all of them), else fresh: load_state() writes them afterwards."""
        state = {k: np.ascontiguousarray(arrays[k], dtype=np.int64)
                 for k in ("ids", "counts", "last_touch", "pending_ids", "pending_counts", "pending_last")}
        state["rows"] = np.ascontiguousarray(arrays["rows"], dtype=np.float32)
        names = self.slot_names
        if names and all(f"slot.{name}" in arrays for name in names):
            state["slots"] = [np.ascontiguousarray(arrays[f"slot.{name}"], np.float32) for name in names]
        self.engine.write_dynamic(self.handle, state, "replace", int(step))

    def read_all(self) -> tuple[np.ndarray, np.ndarray]:
        """One-sided: (ids, rows) of every row the table stores (read_state's, sorted by id)."""
        state = self.read_state(rows=True)
        return state["ids"], state["rows"]

    def write_all(self, ids, rows) -> None:
        """One-sided: stores `rows` for `ids` on their shards (creating them), as read_all gave them."""
        ids = np.ascontiguousarray(ids, np.int64)
        if len(ids):
            self.engine.write_rows(self.handle, ids, np.ascontiguousarray(rows, np.float32).reshape(len(ids), self.dim))

    def write_slots(self, ids, slots: list) -> None:
        """One-sided: the server optimizer's slots (in slot_names order) of those `ids` stored."""
        values = [np.ascontiguousarray(v, dtype=np.float32).reshape(-1, self.dim) for v in slots]
        self.engine.write_dynamic(self.handle, {"ids": np.ascontiguousarray(ids, dtype=np.int64), "slots": values},
                                  "slots")

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

    def restore_local_state(self, arrays: dict, step: int) -> None:
        """Local: this rank's shard becomes exactly what shard_state() returned (an elastic
        restore): emptied first, so ids admitted since are forgotten; the step before the
        entries, since expiry counts from it."""
        self.clear()
        self.set_step(step)
        self.restore(arrays)

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

    # -- export -----------------------------------------------------------------------------------
    def export(self, path) -> int:
        """Collective: writes every stored (id, row) pair to one file, each rank its own shard's
        at its own offset (no rank gathers the table). Format: 8-byte magic, int64 count, int64
        dim, then per pair an int64 id and dim float32 values. Returns the pairs written."""
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


STATE_KEYS = ("ids", "rows", "counts", "last_touch", "pending_ids", "pending_counts", "pending_last", "step")


class DynamicSnapshot:
    """A dynamic table's state for a state dict, read lazily: the shards' sizes now (so the
    state dict's arrays have their shapes), the arrays streamed from the shards -- by this rank
    alone, once -- the first time any of them is needed. If the table changed in between
    (trained on), reading raises instead of giving arrays of other shapes."""

    def __init__(self, table: DynamicTable, rows: bool = True, slots: bool = False):
        self.table, self.rows, self.slots = table, rows, slots
        self.sizes = table.sizes()
        self._arrays = None

    @property
    def step(self) -> int:
        return self.sizes[0][0] if self.sizes else self.table.step

    def shape(self, key: str) -> tuple:
        stored, pending = sum(s[1] for s in self.sizes), sum(s[2] for s in self.sizes)
        if key == "step":
            return ()
        if key == "rows" or key.startswith("slot."):
            return (stored, self.table.dim)
        return (pending,) if key.startswith("pending_") else (stored,)

    def view(self, key: str) -> "DynamicView":
        return DynamicView(self, key)

    def read(self) -> dict:
        if self._arrays is None:
            arrays = self.table.read_state(self.rows, self.slots)
            if arrays["sizes"] != self.sizes:
                raise RuntimeError(f"dynamic table '{self.table.name}' changed after its state dict was taken "
                                   f"(shards' (step, stored, pending) {self.sizes} then, {arrays['sizes']} now): "
                                   "take the state dict again, and read it before training on")
            arrays["step"] = np.array(self.step, np.int64)
            self._arrays = arrays
        return self._arrays


class DynamicView(TableView):
    """One array of a DynamicSnapshot ("ids", "rows", "slot.<name>", "counts", ...) as a value
    in a state dict: its shape and dtype now, its values read on first use."""

    def __init__(self, snapshot: DynamicSnapshot, key: str):
        super().__init__(snapshot.table)
        self.snapshot, self.key = snapshot, key

    @property
    def shape(self) -> tuple:
        return self.snapshot.shape(self.key)

    @property
    def dtype(self) -> str:
        return "float32" if self.key == "rows" or self.key.startswith("slot.") else "int64"

    def read(self) -> np.ndarray:
        return self.snapshot.read()[self.key]

    def is_view_of(self, table, slot: int = -1) -> bool:
        return self.table is table

    def __repr__(self):
        return f"dynamic table '{self.table.name}' {self.key}"


def live_statistics() -> list:
    """(name, this rank's shard's counters: DynamicTable.stats) of every live dynamic table, by
    name; explain() shows them."""
    out = []
    for table in sorted(_live, key=lambda t: t.name):
        try:
            out.append((table.name, table.stats()))
        except (ValueError, RuntimeError):  # the engine is gone or unusable
            continue
    return out


def read_export(path) -> tuple[np.ndarray, np.ndarray]:
    """(ids, rows) of a file DynamicTable.export wrote."""
    with open(path, "rb") as fh:
        head = fh.read(len(EXPORT_MAGIC) + 16)
        if not head.startswith(EXPORT_MAGIC):
            raise ValueError(f"{path}: not a hybridsync dynamic table export")
        total, dim = np.frombuffer(head[len(EXPORT_MAGIC):], np.int64)
        pairs = np.frombuffer(fh.read(), dtype=[("id", "<i8"), ("row", "<f4", (int(dim),))], count=int(total))
    return pairs["id"].copy(), pairs["row"].copy()
