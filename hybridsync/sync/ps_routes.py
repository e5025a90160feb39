"""Route.PS: gradient rows go to the C++ parameter server, which sums them over ranks and
applies the server optimizer once per row on the shard that owns it.

ShardedPS    rows live only on the shards (the frontend's PS-backed embedding module or layer
             made the table); the push is applied before the next pull, so it only sends.
ReplicatedPS every rank keeps its replica (Horovod-style, no model needed); each shard aliases
             its rows inside the local replica when it can, and the push returns every row any
             shard changed, written into every replica, so all replicas stay identical.
"""
from __future__ import annotations

import numpy as np

from .. import ps, timeline
from ..types import Placement, Route
from . import accounting, staleness
from .base import Synchronizer, Variable
from .registry import register
from ..ps.table import PSTable, push, rescale_accumulators


def _table_rows(values, dim: int) -> np.ndarray:
    """Gradient rows as the engine takes them: float32, (n, dim)."""
    return np.ascontiguousarray(values, dtype=np.float32).reshape(-1, dim)


def _no_rows(dim: int):
    return np.zeros(0, np.int64), np.zeros((0, dim), np.float32)


class _PSRoute(Synchronizer):
    applies_updates = True  # the shards apply the server rule as they take the push

    def discard(self) -> None:
        for var in self.variables:
            var.access.rows()  # (the staged rows; a replica's gradient goes with zero_grad())
    def _lr(self, var: Variable) -> float:
        """The learning rate this step: the wrapped optimizer's (LR schedules reach the server),
        unless the config fixed the server optimizer; scaled by the table's own factor where it
        has one (rows hit once per batch at any batch: their steps are not lengthened)."""
        factor = self.ctx.lr_factor
        own = self.ctx.table_lr_factors.get(var.name)
        if own is not None and (var.plan.optimizer or {}).get("name") == "sgd":
            own = None  # (SGD's row gradient shrinks with the batch: the batch's factor only restores it)
        if var.plan.optimizer_source == "config":  # scaled like the wrapped optimizer's would be
            return float(var.plan.optimizer["lr"]) * (factor if own is None else own)
        lr = float(var.access.lr())  # (the wrapped optimizer's, already times the batch's factor)
        return lr if own is None or own == factor or not factor > 0 else lr / factor * own

    def _collect_statistics(self, var: Variable) -> None:
        """The table's shards compute the squared norms of its rounds only when the step's
        statistics are recorded (adaptive batch size on): they cost a pass over every pushed row.
        Every rank's optimizer has the same adaptive setting, so every shard alike. Set where a
        route readies its tables and checked before every push (sync: auto makes new tables as
        it moves and reshards variables)."""
        want = self.ctx.stats is not None
        if var.table is not None and var.table.gradient_statistics != want:
            var.table.set_gradient_statistics(want)

    def _record_rounds(self, current: bool) -> None:
        """Gradient statistics: each table's newest push round, as its shards computed it."""
        stats = self.ctx.stats
        if stats is None:
            return
        for var in self.variables:
            if var.table is not None:
                stats.ps_round(var.name, var.table.round_stats(), current)

    def rescale_accumulators(self, factor: float) -> None:
        """Every table's Adagrad sums on every shard (rules without them are left alone there), in
        one PS collective ordered after this step's pulls and before its push."""
        rescale_accumulators([var.table for var in self.variables if var.table is not None], factor)

    def state_dict(self) -> dict:
        """The server optimizer state of every table, as views that read their rows from the
        shards only when asked (no collective: any rank may call it alone)."""
        return {var.name: var.table.state() for var in self.variables if var.table is not None}

    def load_state_dict(self, state: dict) -> set:
        """Loads the server state of the tables that exist; returns their variables' names."""
        placed = set()
        for var in self.variables:
            if var.name in state and var.table is not None:
                var.table.load_state(state[var.name], var.name)
                placed.add(var.name)
        return placed


@register(Route.PS, Placement.SHARDED)
class ShardedPS(_PSRoute):
    waits = False  # the push is applied at the next PS operation

    def prepare(self) -> None:
        """Collective: names the tables the PS modules made and sets their rules, on every rank's
        shard; then a barrier, so that no rank reads or writes another's shard (a load_state_dict
        right after wrapping) before its rule is in place -- setting a rule restarts the slots."""
        for var in self.variables:
            var.table.rename(var.name)
            var.table.set_rule(var.plan.optimizer)
            var.table.set_staleness(var.plan.staleness)  # (a world of one has nothing to wait for: no effect)
            self._collect_statistics(var)
        if self.variables:
            ps.engine().barrier("hybridsync.tables_ready")

    def synchronize(self) -> None:
        self._record_rounds(current=False)  # the previous push's, back with this step's pull
        tables, ids, grads, lrs = [], [], [], []
        for var in self.variables:
            self._collect_statistics(var)
            got = var.access.rows()
            if got is None and var.plan.staleness:
                got = _no_rows(var.dim)  # a bounded table's push is a step of this rank's clock: every step
            if got is None:
                continue
            tables.append(var.table)
            ids.append(got[0])
            grads.append(_table_rows(got[1], var.dim))
            lrs.append(self._lr(var))
            accounting.ps_sharded(var.plan, var.table.pulled_rows, var.dim)
            var.table.pulled_rows = 0
        # Collective even when nothing was staged, so every rank runs the same operations.
        with timeline.span(f"push ({len(tables)} tables)", "ps"):
            push(tables, ids, grads, self.ctx.row_scale(), lrs, return_updates=False)
        staleness.observe([var for var in self.variables if var.plan.staleness])

    def in_flight(self) -> bool:
        return any(var.access.kind() is not None for var in self.variables)


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape


@register(Route.PS, Placement.REPLICATED)
class ReplicatedPS(_PSRoute):
    def __init__(self, ctx):
        super().__init__(ctx)
        self._joins = ps.joins()  # joins seen: after one, every replica is refreshed from the shards

    def prepare(self) -> None:
        self._register()

    def _register(self) -> None:
        """Collective: creates the tables of variables that have none yet. Every replica, and so
        every shard, starts from rank 0's values."""
        for var in self.variables:
            if var.table is not None:
                continue
            view = var.access.replica()
            values = view if view is not None else var.access.replica_copy()
            self.ctx.backend.broadcast_(values, 0, name=f"hybridsync.replica.{var.name}")
            if view is None:
                var.access.set_replica(values)
            rows = var.plan.shape[0]
            var.table = PSTable(var.name, rows, var.dim, var.plan.shards, var.plan.partition, var.plan.optimizer)
            self._collect_statistics(var)
            self._attach(var, view)

    def _attach(self, var: Variable, view) -> None:
        """The shard's rows alias the replica when it is plain CPU float32 memory; otherwise the
        shard owns a copy of its rows."""
        if view is not None:
            var.table.attach(view)
        else:
            var.table.attach(None)
            var.table.scatter(var.access.replica_copy())

    def _follow_replicas(self) -> None:
        """Re-attaches where a replica's memory moved (p.data = ..., model.to(...))."""
        for var in self.variables:
            view, attached = var.access.replica(), var.table.attached
            if view is None:
                if attached is not None:  # no longer aliasable: the shard takes a copy
                    self._attach(var, None)
            elif attached is None or not _same_memory(view, attached):
                self._attach(var, view)

    def synchronize(self) -> None:
        self._register()
        if self._joins != ps.joins():  # a rank that joined missed the others' rows meanwhile
            self._joins = ps.joins()
            for var in self.variables:
                var.access.set_replica(var.table.read())
        self._follow_replicas()
        ids, grads, lrs = [], [], []
        for var in self.variables:
            self._collect_statistics(var)
            got = var.access.rows()
            i, v = got if got is not None else _no_rows(var.dim)
            ids.append(i)
            grads.append(_table_rows(v, var.dim))
            lrs.append(self._lr(var))
        tables = [var.table for var in self.variables]
        with timeline.span(f"push + replica update ({len(tables)} tables)", "ps"):
            updates = push(tables, ids, grads, self.ctx.row_scale(), lrs, return_updates=True)
        tl = timeline.get()
        if tl is not None:
            tl.engine_events()
        self._record_rounds(current=True)
        for var, i, (changed, rows) in zip(self.variables, ids, updates):
            var.access.write_rows(changed, rows)
            accounting.ps_replicated(var.plan, len(i), len(changed), var.dim)
            var.access.applied()

    def state_dict(self) -> dict:
        self._follow_replicas()
        return super().state_dict()

    def load_state_dict(self, state: dict) -> set:
        self._register()
        for var in self.variables:
            if var.table.attached is None:  # the shard owns a copy: refresh it from the replica
                self._attach(var, None)
        self._follow_replicas()
        return super().load_state_dict(state)
