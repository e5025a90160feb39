"""`sync: auto` (the default for sparse variables): measure, predict, switch once.

For the first K steps (`auto_steps` in the config, else HYBRIDSYNC_AUTO_STEPS, default 20)
each auto variable runs on the parameter server -- the route it was planned on, which applies
the wrapped optimizer's update exactly whatever the density -- while this module records the
rows each rank touched per step. After step K, on every rank at once (it runs inside the
step's synchronize, a collective point):

1. the per-step row ids and compute times are gathered on rank 0, which computes each
   variable's density (rows per rank, rows over all ranks) and feeds it, with the link probe's
   numbers (hybridsync/comm/probe.py, measured when the optimizer was wrapped), to the cost
   model (cost_model.py): ps on 1..N shards vs allgather vs allreduce-as-dense, among the
   routes whose frontend update equals the server rule (auto never changes the arithmetic);
2. rank 0 broadcasts the decisions; every rank applies them in plan order:
   - ps, same shards: nothing moves;
   - ps, other shard count: a new table on that many shards; each rank reads its new shard's
     rows and server-optimizer slots from the old shards in chunks (no rank holds the table);
   - allgather / allreduce-as-dense: the rows (sharded placement: gathered; replicated: the
     local replica, identical everywhere) become a local variable again (the frontend swaps
     the PS module back), the server slots become the wrapped optimizer's state for it
     (Adagrad "sum", SparseAdam "exp_avg"/"exp_avg_sq", and the step), and the variable moves
     to the new route's synchronizer.
3. the plan records, per variable, what was measured, each candidate's predicted time, the
   choice and its margin (explain() prints them; the JSON plan keeps them and loads back as
   a fixed config), and wherever the plan was printed while it measured, the decision is
   printed as a table (plan.announce_auto_decision). Then this object detaches itself: later
   steps do no auto work at all.

The frontend supplies what is framework-specific (AutoFrontend).
"""
from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from .. import ps, timeline
from ..adaptive.exchange import gather_rows
from ..plan import announce_auto_decision
from ..types import Placement, Route
from . import cost_model
from .base import Variable

_ROUTES = {cost_model.PS: Route.PS, cost_model.ALLGATHER: Route.ALLGATHER, cost_model.DENSE: Route.SPARSE_AS_DENSE}


class AutoFrontend(Protocol):
    """What a frontend does for `sync: auto`."""

    def candidates(self, var: Variable) -> tuple:
        """Routes (cost_model names) whose update of var equals the server rule's."""

    def to_replica(self, var: Variable, rows: np.ndarray | None) -> None:
        """var leaves the parameter server: it becomes a local variable holding `rows` (the whole
        table; None when var already keeps an identical replica), and var.access an access to it."""

    def set_optimizer_state(self, var: Variable, slots: dict, step: int) -> None:
        """The wrapped optimizer's state for var: the server's slots (num_rows x dim arrays by
        slot name) and step."""

    def set_table(self, var: Variable, table) -> None:
        """var's PS module (sharded placement) reads from `table` from now on."""


def candidates_for(spec, optimizer_source: str) -> tuple:
    """Routes that apply the same update as the server rule of a wrapped optimizer described by
    `spec` (server_rules.OptimizerSpec): a dense update equals it for SGD and Adagrad (a row with a
    zero gradient does not move); an applied row-sparse gradient equals it when the frontend's
    sparse update matches the rule (spec.sparse_exact). A server optimizer fixed in the config
    differs from the wrapped one: only ps."""
    if optimizer_source == "config":
        return (cost_model.PS,)
    out = [cost_model.PS]
    if spec.applies_sparse and spec.sparse_exact:
        out.append(cost_model.ALLGATHER)
    if spec.family in ("sgd", "adagrad"):
        out.append(cost_model.DENSE)
    return tuple(out)


def collective_s(backend, repeats: int = 10) -> float:
    """Collective: what one small all-gather of the dense backend takes here (the allgather
    route's fixed cost per variable is two of them), median, the slowest rank's view."""
    buf = np.zeros(1, np.int64)
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        backend.allgather(buf, name="hybridsync.auto.latency")
        if i >= 3:  # the first ones also wait for the ranks to line up
            times.append(time.perf_counter() - start)
    return float(max(backend.allgather_object(float(np.median(times)), name="hybridsync.auto.latency_max")))


class _Recording:
    """var.access while measuring: passes everything through, and keeps the unique ids of the
    rows the route takes each step."""

    __slots__ = ("inner", "ids")

    def __init__(self, inner):
        self.inner, self.ids = inner, None

    def rows(self):
        got = self.inner.rows()
        if got is not None:
            self.ids = np.unique(np.asarray(got[0], dtype=np.int64))
        return got

    def __getattr__(self, name):
        return getattr(self.inner, name)


class AutoStrategy:
    """Measures a SyncSet's auto variables for `steps` steps, then switches them once."""

    def __init__(self, sync_set, variables: list, frontend: AutoFrontend, steps: int, links=None):
        """Collective (the link probe, unless `links` is given)."""
        from ..comm import probe

        self.sync_set, self.frontend, self.steps = sync_set, frontend, int(steps)
        self.variables = [var for var in variables if var.plan.auto]
        self.links = links if links is not None else probe.links()
        if self.variables and not self.links.collective_s:
            self.links.collective_s = collective_s(sync_set.ctx.backend)
        self._measure_afresh()
        for var in self.variables:
            var.access = _Recording(var.access)
            var.plan.auto.update(links={k: v for k, v in self.links.to_json().items()})

    def _measure_afresh(self) -> None:
        self.step = 0
        self.ids = {var: [] for var in self.variables}
        self.compute_s: list = []
        self._sync_end = None
        self._joins = ps.joins()

    # -- every step while measuring ---------------------------------------------------------------
    def before_sync(self) -> None:
        if self._sync_end is not None:
            self.compute_s.append(time.perf_counter() - self._sync_end)

    def after_sync(self) -> bool:
        """Records the step; after the last one, decides and switches. True when done. After an
        hvd.join() the ranks have taken different numbers of steps: measuring starts again (on
        every rank at the same step, the first after the join)."""
        if ps.joins() != self._joins:
            self._measure_afresh()
        for var in self.variables:
            rec = var.access
            self.ids[var].append(rec.ids if rec.ids is not None else np.zeros(0, np.int64))
            rec.ids = None
        self.step += 1
        if self.step < self.steps or not self._everyone_steps():
            self._sync_end = time.perf_counter()
            return False
        with timeline.span(f"sync: auto ({len(self.variables)} variables)", "ps"):
            self._switch()
        return True

    def _everyone_steps(self) -> bool:
        """Collective over the ranks still stepping: whether none has called hvd.join() (it takes
        part in this sum with zeros). The switch gathers every rank's measurements, so a rank
        that ran out of data first must train again -- after the join, measuring starts afresh."""
        ctx = self.sync_set.ctx
        if ctx.world_size == 1:
            return True
        return len(gather_rows(ctx.allreduce_sum, ctx.backend.rank, ctx.world_size, [], "hybridsync.auto.ready")) \
            == ctx.world_size

    # -- the switch ---------------------------------------------------------------------------------
    def _switch(self) -> None:
        backend = self.sync_set.ctx.backend
        compute = float(np.median(self.compute_s)) if self.compute_s else 0.0
        mine = {"ids": [self.ids[var] for var in self.variables], "compute_s": compute}
        everyone = backend.allgather_object(mine, name="hybridsync.auto.stats")
        decisions = None
        if backend.rank == 0:
            decisions = [self._decide(i, var, everyone) for i, var in enumerate(self.variables)]
        decisions = backend.broadcast_object(decisions, 0, name="hybridsync.auto.decisions")
        for var, decision in zip(self.variables, decisions):
            var.access = var.access.inner
            self._apply(var, decision)
        self.ids.clear()
        announce_auto_decision([var.plan for var in self.variables], self.steps)

    def _decide(self, i: int, var: Variable, everyone: list) -> dict:
        per_rank = [[len(ids) for ids in stats["ids"][i]] for stats in everyone]
        steps = len(per_rank[0])
        union = [len(np.unique(np.concatenate([stats["ids"][i][s] for stats in everyone]))) for s in range(steps)]
        compute = max(stats["compute_s"] for stats in everyone)
        stats = cost_model.TableStats(
            name=var.name, num_rows=int(var.plan.shape[0]), dim=var.dim, world_size=self.sync_set.ctx.world_size,
            placement=var.plan.placement.value, rows_per_rank=float(np.mean(per_rank)),
            union_rows=float(np.mean(union)), compute_s=compute, steps=steps,
            candidates=self.frontend.candidates(var))
        decision = cost_model.decide(stats, self.links, var.plan.shards)
        measured = {"steps": steps, "rows_per_rank": round(stats.rows_per_rank, 3),
                    "union_rows": round(stats.union_rows, 3), "density": round(stats.density, 6),
                    "bytes_per_step": round(stats.bytes_per_step, 1), "compute_ms": round(compute * 1e3, 4)}
        return {**decision.to_json(), "measured": measured, "candidates": list(stats.candidates)}

    def _apply(self, var: Variable, decision: dict) -> None:
        Switch(self.sync_set, self.frontend).apply(var, decision, self.steps)


class Switch:
    """Moves a variable to the route (and PS shard count) of a decision, carrying its rows and
    optimizer state over exactly: what `sync: auto` does once it decided, and what resuming from
    a checkpoint of an auto run does with that run's decisions."""

    def __init__(self, sync_set, frontend: AutoFrontend):
        self.sync_set, self.frontend = sync_set, frontend

    def apply(self, var: Variable, decision: dict, step: int) -> None:
        """Collective. decision: cost_model.Decision.to_json() (with `measured`, ...)."""
        plan = var.plan
        route = _ROUTES[decision["choice"]]
        if route is Route.PS:
            if decision["shards"] != plan.shards:
                self._reshard(var, decision["shards"])
        else:
            self._leave_ps(var, route)
        plan.auto.update(decision, status="decided", switched_at_step=step)
        head = plan.reason.split("; auto:")[0]
        placement = (f" {plan.placement.value}, {plan.shards} shard{'s' if plan.shards != 1 else ''}"
                     if route is Route.PS else "")
        plan.reason = (f"{head}; auto: {route.value}{placement} from step {step} "
                       f"(margin {decision['margin']:+.0%}; explain() shows the prediction)")

    def _leave_ps(self, var: Variable, route: Route) -> None:
        """Collective: var's rows and server state go to the frontend's own variable and optimizer."""
        table, plan = var.table, var.plan
        state = table.state()
        slots = {name: view.read() for name, view in state["slots"].items()}
        rows = table.read() if plan.placement is Placement.SHARDED else None
        if table.attached is not None:  # the shard aliased the replica: it keeps a copy of its own
            table.attach(None)
        self.frontend.to_replica(var, rows)
        self.frontend.set_optimizer_state(var, slots, state["step"])
        table.drop()  # its rows and server state now live in the frontend's variable and optimizer
        var.table = None
        plan.route, plan.placement, plan.shards = route, Placement.NONE, 0
        plan.optimizer, plan.optimizer_source, plan.compression = None, "-", "none"
        plan.bytes_per_step = None
        self.sync_set.move(var)

    def _reshard(self, var: Variable, shards: int) -> None:
        """Collective: a new table on `shards` shards takes var's rows and server state, each
        rank its new shard's, read from the old shards in chunks (no rank holds the table)."""
        from ..ps.table import PSTable

        old, plan = var.table, var.plan
        sharded = plan.placement is Placement.SHARDED
        view = None if sharded else var.access.replica()  # replicated: the shard may alias the replica
        new = PSTable(var.name, plan.shape[0], var.dim, shards, plan.partition, plan.optimizer)
        if old.attached is not None:
            old.attach(None)
        if view is not None:
            new.attach(view)
        elif not sharded:
            new.attach(None)
        new.take_from(old, rows=view is None)  # an aliased replica holds the rows already
        if sharded:
            self.frontend.set_table(var, new)
        old.drop()
        var.table = new
        plan.shards = shards


def adopt(sync_set, frontend: AutoFrontend, saved: dict) -> bool:
    """Collective (every rank passes the same `saved`): the auto variables not yet decided take
    the decisions of the run a checkpoint came from ({variable name: its plan's `auto` dict})
    instead of measuring, so the tables are where that run's were when it saved. Between steps,
    and only when every such variable has a saved decision; True when it applied them."""
    variables = sorted((var for var in sync_set.route_of if var.plan.auto and var.plan.auto.get("status") != "decided"),
                       key=lambda v: v.index)
    decisions = [saved.get(var.name) for var in variables]
    if not variables or not all(d and d.get("status") == "decided" and d.get("choice") in _ROUTES for d in decisions):
        return False
    switch, world = Switch(sync_set, frontend), sync_set.ctx.world_size
    for var, decision in zip(variables, decisions):
        shards = min(int(decision.get("shards") or 0), world) or var.plan.shards
        decision = {**decision, "shards": shards, "why": f"from the checkpoint's plan: {decision.get('why', '')}"}
        if isinstance(var.access, _Recording):  # this run was measuring: stop
            var.access = var.access.inner
        switch.apply(var, decision, int(decision.get("switched_at_step") or 0))
    return True
