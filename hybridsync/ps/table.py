"""A table on the C++ parameter server as every frontend sees it, and the batched pull/push rounds
over several tables: with dynamic.py, the only Python code that talks to the engine.

Every kind of table holds a TableCore -- its handle in the engine and what any table does (name,
server rule, staleness, step, lookups) -- and adds its own: a fixed table (PSTable: num_rows x dim
rows under a row partition) its whole-table reads, writes and replicas; a dynamic table (dynamic.py)
its per-id state. Collective methods (every rank calls them, in the same order) say so; the rest
are local or one-sided.
"""
from __future__ import annotations

import weakref

from .. import comm, runtime

import numpy as np

from . import client
from .partition import Partition
from .rules import hyperparameters
from .storage import options as storage_options

# The rule a table has until a DistributedOptimizer sets the one matching its optimizer.
PLACEHOLDER_RULE = {"name": "sgd", "lr": 0.0}
INITIALIZERS = ("normal", "uniform")
CHUNK_ROWS = 65536  # rows per one-sided read when a table moves between layouts


class TableCore:
    """One table's handle in this process's engine, and what every kind of table does with it."""

    def __init__(self, name: str, num_rows: int, dim: int, shards: int, partition: str, rule: dict | None,
                 dynamic: dict | None = None, storage: dict | None = None):
        """Collective: registers the table on every rank (same arguments everywhere). storage:
        how the shards store its rows (storage.options; None: float32, all in memory)."""
        self.engine = client.engine()
        self.name, self.dim = name, int(dim)
        self.storage = storage_options(f"table '{name}'", storage)
        self.requested_shards = int(shards or 0)  # 0: every rank, whatever the world size (plans use it)
        rule_name, hparams = hyperparameters(rule or PLACEHOLDER_RULE)
        self.handle = self.engine.add_table(name, int(num_rows), self.dim, int(shards or 0), partition,
                                            rule_name, hparams, dynamic, self.storage)
        self.pulled_rows = 0  # unique rows pulled since the last push (byte accounting)
        self.gradient_statistics = False  # the shards compute round_stats()' squared norms
        if (self.storage or {}).get("path"):
            _tiered.add(self)

    def drop(self) -> None:
        """Collective (every rank at the same point): frees this rank's shard, rows and optimizer
        state; any later use of the table raises naming it."""
        _tiered.discard(self)
        self.engine.drop_table(self.handle)

    def tier_stats(self) -> dict:
        """Local: this rank's shard's storage: {"dtype", "path" (its tier file), "memory_rows",
        "disk_rows", "memory_share", "hits" / "loads" (rows an operation found in memory / read
        back from disk), "bytes_read", "bytes_written", "steps"}."""
        return self.engine.tier_stats(self.handle)

    @property
    def tiered(self) -> bool:
        """Whether the table has a disk tier (storage.path). A fixed table's rows never written
        are stored nowhere then, their values a function of (seed, id)."""
        return bool((self.storage or {}).get("path"))

    @property
    def num_shards(self) -> int:
        return self.engine.spec(self.handle)["num_shards"]

    def rename(self, name: str) -> None:
        """Local: the name errors use (the variable's path, known after the table was made)."""
        self.engine.rename_table(self.handle, name)
        self.name = name

    def set_staleness(self, k: int) -> None:
        """Local, on every rank alike before the table's first step: pulls may miss at most the
        other ranks' last k pushes (0: synchronous rounds). See docs/staleness.md."""
        self.engine.set_staleness(self.handle, int(k))

    def staleness(self) -> dict:
        """Local: the bound and what this rank's pulls missed so far ({"staleness", "clock",
        "pulls", "last_lag", "max_lag", "lag_sum", "held", "wait_s"})."""
        return self.engine.staleness(self.handle)

    def set_rule(self, rule: dict) -> None:
        """Local: the server optimizer of this rank's shard (its state restarts)."""
        self.engine.set_rule(self.handle, *hyperparameters(rule))

    @property
    def optimizer(self) -> str:
        return self.engine.spec(self.handle)["optimizer"]

    @property
    def slot_names(self) -> list:
        return list(self.engine.slot_names(self.handle))

    @property
    def step(self) -> int:
        """The server optimizer's step (every shard takes each round; one-sided where this rank
        holds no shard)."""
        return int(self.engine.table_step(self.handle))

    def set_step(self, step: int, everywhere: bool = True) -> None:
        """This rank's shard's step (everywhere: every rank sets its own, as checkpoint loads do),
        or one-sided every shard's (everywhere=False)."""
        if everywhere:
            self.engine.set_step(self.handle, int(step))
        else:
            self.engine.set_table_step(self.handle, int(step))

    def round_stats(self) -> dict:
        """Local: the gradient statistics of this table's newest push round (hybridsync.adaptive);
        its squared norms are 0 unless set_gradient_statistics(True)."""
        return self.engine.round_stats(self.handle)

    def set_gradient_statistics(self, on: bool) -> None:
        """Local, on every rank alike before the pushes that should count: whether the shards
        compute the squared norms of round_stats() (a pass over every pushed row; off by default,
        the adaptive batch size turns it on)."""
        self.engine.set_gradient_statistics(self.handle, bool(on))
        self.gradient_statistics = bool(on)

    def read_rows(self, ids, slot: int = -1) -> np.ndarray:
        """One-sided: rows (slot < 0) or slot values of `ids`, shaped ids.shape + (dim,)."""
        return self.engine.read_rows(self.handle, np.asarray(ids, dtype=np.int64), slot)

    def lookup(self, ids, error: str = ""):
        """Collective (local in a world of one): (unique ids pulled, rows) with rows[i] the row
        of ids[i], shaped ids.shape + (dim,). error: this rank's bad input, raised on every rank."""
        unique, rows = self.engine.lookup(self.handle, ids, error)
        self.pulled_rows += len(unique)
        return unique, rows


_tiered: "weakref.WeakSet" = weakref.WeakSet()  # live tables with a disk tier, for explain()


def live_tier_statistics() -> list:
    """(name, tier_stats()) of every live table with a disk tier whose shard is on this rank."""
    out = []
    for core in sorted(_tiered, key=lambda c: c.name):
        stats = core.tier_stats()
        if stats["path"]:
            out.append((core.name, stats))
    return out


class FromCore:
    """A table attribute that is its TableCore's (read and written through the table): the kinds
    of table share the core's behaviour by holding one, not by inheriting from each other."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, table, owner=None):
        return self if table is None else getattr(table.core, self.name)

    def __set__(self, table, value):
        setattr(table.core, self.name, value)


def shares_core(cls):
    """Class decorator: the TableCore's attributes and methods, on a kind of table."""
    for name in ("engine", "handle", "name", "dim", "storage", "requested_shards", "pulled_rows", "num_shards", "rename",
                 "set_staleness", "staleness", "set_rule", "optimizer", "slot_names", "step", "set_step",
                 "round_stats", "gradient_statistics", "set_gradient_statistics", "read_rows", "lookup", "tier_stats",
                 "tiered"):
        attribute = FromCore()
        attribute.__set_name__(cls, name)
        setattr(cls, name, attribute)
    return cls


@shares_core
class PSTable:
    """A fixed table: num_rows x dim float32 rows split over `shards` ranks (0: every rank) by a
    row partition."""

    def __init__(self, name: str, num_rows: int, dim: int, shards: int = 0, partition: str = "cyclic",
                 rule: dict | None = None, storage: dict | None = None):
        """Collective: registers the table on every rank (same arguments everywhere); storage:
        see hybridsync.ps.storage."""
        self.core = TableCore(name, num_rows, dim, shards, partition, rule, storage=storage)
        self.num_rows = int(num_rows)
        self._replica = None  # the array the shard's rows alias (kept alive here)

    def drop(self) -> None:
        """Collective (every rank at the same point): see TableCore.drop."""
        self.core.drop()
        self._replica = None

    # -- contents -----------------------------------------------------------------------------
    def initialize(self, initializer, seed: int) -> None:
        """Local: fills this rank's shard from ('normal', mean, std) or ('uniform', low, high)
        with a counter-based generator per (row, column): rows do not depend on the sharding.
        `seed` must be the same on every rank (see shared_seed)."""
        kind, a, b = initializer if len(initializer) == 3 else (None, 0, 0)
        if kind not in INITIALIZERS:
            raise ValueError(f"initializer must be ('normal', mean, std) or ('uniform', low, high), "
                             f"got {initializer!r}")
        init = self.engine.init_normal if kind == "normal" else self.engine.init_uniform
        init(self.handle, int(seed), float(a), float(b))

    def load_from_root(self, values, root: int = 0, consume: bool = False) -> None:
        """Collective: rank `root`'s whole table (num_rows x dim) becomes every shard's rows.
        consume: the root gives `values` up (a writable array nothing else will read): its
        memory goes back to the system as the rows reach their shards, so the root never holds
        the whole table and its own shard at once (it reads as zeros afterwards)."""
        self.engine.load_from_root(self.handle, values, root, consume)

    def scatter(self, values, slot: int = -1) -> None:
        """Local: this rank's shard takes its rows (slot < 0) or optimizer slot from a whole
        table that every rank holds."""
        self.engine.load_local(self.handle, slot, np.ascontiguousarray(values, dtype=np.float32))

    def read(self, slot: int = -1) -> np.ndarray:
        """One-sided: the whole table (slot < 0) or optimizer slot, streamed from the shards in
        chunks to this rank alone (the shards' owners answer while they compute)."""
        return self.engine.read_table(self.handle, slot)

    def hand_over(self) -> tuple[np.ndarray, dict, int]:
        """Collective (every rank at the same point), then the table is dropped: (the whole table,
        {slot name: the whole slot}, step) on every rank. Each shard gives a chunk's memory back
        once every rank has read it, so no rank holds its shard and the whole table at once (a
        table leaving the parameter server for a replica costs the replica, not replica + shard)."""
        step = self.step
        slots = {name: self.engine.read_table(self.handle, k, True) for k, name in enumerate(self.slot_names)}
        rows = self.engine.read_table(self.handle, -1, True)
        self.drop()
        return rows, slots, step

    def write(self, values, slot: int = -1) -> None:
        """One-sided: the whole table (slot < 0) or slot, from this rank to every shard, in chunks."""
        self.engine.write_table(self.handle, np.ascontiguousarray(values, dtype=np.float32), slot)

    def write_rows(self, ids, rows, slot: int = -1) -> None:
        """Local: writes the rows (slot < 0) or optimizer slot values among `ids` that this
        rank's shard holds."""
        self.engine.write_local(self.handle, np.asarray(ids, dtype=np.int64), np.ascontiguousarray(rows, np.float32),
                                slot)

    def take_from(self, other: "PSTable", rows: bool = True) -> None:
        """Collective (every rank at the same point, before `other` is dropped): this rank's shard
        takes its rows (unless rows=False: they are there already) and server-optimizer slots,
        by name, from `other` -- the same table on another layout -- and its step. Read one-sided
        in chunks of CHUNK_ROWS: a rank holds its new shard and one chunk, never the table."""
        shards, kind = self.layout
        rank = self.engine.rank
        if rank < shards:
            ids = Partition(self.num_rows, shards, kind).rows_of(rank)
            theirs = other.slot_names
            slots = [(k, theirs.index(name)) for k, name in enumerate(self.slot_names)]
            for start in range(0, len(ids), CHUNK_ROWS):
                part = ids[start:start + CHUNK_ROWS]
                if rows:
                    self.write_rows(part, other.read_rows(part))
                for mine, slot in slots:
                    self.write_rows(part, other.read_rows(part, slot), slot=mine)
        self.set_step(other.step)

    def restored_as(self, storage: dict | None) -> "PSTable":
        """Collective: a new table like this one (name, shape, layout, server rule) whose shards
        store rows as `storage` says, holding this table's rows, optimizer state and step (rounded
        into the new row type where it is narrower). This table stays until the caller drops it."""
        shards, kind = self.layout
        spec = self.engine.spec(self.handle)
        new = PSTable(self.name, self.num_rows, self.dim, self.requested_shards or 0, kind,
                      {"name": spec["optimizer"], **spec["hparams"]}, storage=storage)
        new.take_from(self)
        return new

    # -- a disk tier: the rows written, and what the others hold --------------------------------
    def written_ids(self) -> np.ndarray:
        """Local (a disk tier): the sorted global ids of this rank's rows that hold other than
        their initial value, in memory or on disk (a row is in one place)."""
        ids = np.concatenate([self.engine.written_rows(self.handle, True), self.engine.written_rows(self.handle, False)])
        ids.sort()
        return ids

    def row_init(self) -> dict:
        """Local (a disk tier): what its rows never written hold: {"kind": "zeros" | "normal" |
        "uniform", "seed", "a", "b"} (normal: mean, std; uniform: low, high)."""
        return dict(self.engine.row_init(self.handle))

    def reset_rows(self, init: dict) -> None:
        """Local: every row of this rank's shard back to its initial value under `init` (as
        row_init() gives it), with fresh optimizer slots."""
        self.engine.reset_rows(self.handle, str(init["kind"]), int(init["seed"]), float(init["a"]), float(init["b"]))

    def local_rows(self, ids, slot: int = -1) -> np.ndarray:
        """Local: rows (slot < 0) or slot values of `ids`, all in this rank's shard, wherever they
        are (memory or disk; the cache does not change)."""
        return self.engine.local_rows(self.handle, np.asarray(ids, dtype=np.int64), slot)

    def local_state(self) -> dict:
        """Local: this rank's shard as arrays: "ids" (its global row ids, in storage order),
        "rows", and "slot.<name>" per server optimizer slot."""
        shards, kind = self.layout
        rank = self.engine.rank
        out = {"ids": Partition(self.num_rows, shards, kind).rows_of(rank), "rows": self.engine.local_values(self.handle, -1)}
        for k, name in enumerate(self.slot_names):
            out[f"slot.{name}"] = self.engine.local_values(self.handle, k)
        return out

    def restore_local_state(self, arrays: dict, step: int) -> None:
        """Local: this rank's shard goes back to what local_state() returned under the same
        layout (an elastic restore), and its step."""
        self.write_rows(arrays["ids"], arrays["rows"])
        for k, slot in enumerate(self.slot_names):
            self.write_rows(arrays["ids"], arrays[f"slot.{slot}"], slot=k)
        self.set_step(step)

    def attach(self, replica) -> None:
        """Local: the shard's rows alias `replica` (the whole table, identical on every rank)
        from now on; None gives the shard back a copy of its own."""
        self.engine.attach_replica(self.handle, replica)
        self._replica = replica

    @property
    def attached(self):
        return self._replica

    @property
    def layout(self) -> tuple[int, str]:
        """(shards holding the table, partition kind)."""
        spec = self.engine.spec(self.handle)
        return spec["num_shards"], spec["partition"]

    def state(self) -> dict:
        """The server optimizer's state, with no collective and no copy: {"optimizer", "step",
        "slots": {slot name: TableView}}; the views read their rows on first use."""
        slots = {name: TableView(self, k) for k, name in enumerate(self.slot_names)}
        return {"optimizer": self.optimizer, "step": self.step, "slots": slots}

    def load_state(self, state: dict, variable: str, everywhere: bool = False) -> None:
        """Restores what state() returned (slots as arrays or views). One-sided: this rank writes
        every shard; everywhere=True: every rank calls it with the same values at the same point,
        so each writes only its own shard."""
        if state["optimizer"] != self.optimizer:
            raise ValueError(f"variable '{variable}': checkpoint has server optimizer '{state['optimizer']}', "
                             f"this run uses '{self.optimizer}'")
        for k, name in enumerate(self.slot_names):
            value = state["slots"][name]
            if isinstance(value, TableView) and value.is_view_of(self, k):
                continue  # its own rows: nothing to write
            if isinstance(value, TableView):
                value = value.read()
            if everywhere:
                self.scatter(value, k)
            else:
                self.write(value, k)
        self.set_step(int(state["step"]), everywhere)


class TableView:
    """A PS table (slot < 0) or one of its server-optimizer slots, as a value in a state dict:
    its shape and dtype, and its rows read from the shards -- by this rank alone, in chunks --
    only when read() is called. Frameworks wrap it (hybridsync.torch.table_tensor); a dynamic
    table's arrays are its subclass DynamicView."""

    dtype = "float32"

    def __init__(self, table: PSTable, slot: int = -1):
        self.table, self.slot = table, int(slot)

    @property
    def shape(self) -> tuple:
        return (self.table.num_rows, self.table.dim)

    def read(self) -> np.ndarray:
        return self.table.read(self.slot)

    def is_view_of(self, table: PSTable, slot: int = -1) -> bool:
        return self.table is table and self.slot == slot

    def __repr__(self):
        what = "rows" if self.slot < 0 else f"slot {self.table.slot_names[self.slot]!r}"
        return f"table '{self.table.name}' {what}"


def pull(tables: list, ids: list, in_order=(), error: str = "") -> list:
    """Collective: one round for several tables; per table (unique ids, inverse, unique rows),
    or where in_order[i] is true (unique ids, None, rows) with rows[i] the row of ids[i], shaped
    ids.shape + (dim,), written there once (in a world of one, unique is empty)."""
    results = tables[0].engine.pull([t.handle for t in tables], ids, list(in_order), error) if tables else []
    for t, (unique, _, _) in zip(tables, results):
        t.pulled_rows += len(unique)
    return results


def push(tables: list, ids: list, grads: list, scale: float, lrs: list, return_updates: bool):
    """Collective, even with no tables (every rank runs the same operations): sends each table's
    (ids, gradient rows) to their shards, which sum them over ranks, multiply by `scale` and apply
    their rule once per row at learning rate lrs[i]. With return_updates, waits and returns per
    table (changed ids, their rows); otherwise the shards apply it before the next operation."""
    return client.engine().push([t.handle for t in tables], ids, grads, float(scale), return_updates,
                            [float(lr) for lr in lrs])


def rescale_accumulators(tables: list, factor: float) -> None:
    """Collective (every rank the same tables and the same factor, to the bit): multiplies what
    each table's server optimizer accumulated over every step (Adagrad's sums of squared
    gradients; rules without such state are left alone) by `factor`, for every row its shards
    store, wherever (memory, disk tier, a dynamic table's rows) -- after every push before it and
    before any after it, on every shard. The adaptive batch size calls it at a batch change."""
    if tables:
        client.engine().rescale_accumulators([t.handle for t in tables], float(factor))


def shared_seed(draw: int) -> int:
    """Collective: rank 0's `draw` on every rank (seeds that make all ranks agree)."""
    return int(comm.objects().broadcast_object(int(draw), 0, name="hybridsync.seed")) if runtime.world().size > 1 else int(draw)
