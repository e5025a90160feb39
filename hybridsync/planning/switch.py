"""Moving a variable to another route, exactly: what `sync: auto` does once it decided (and for a
trial), and what resuming from a checkpoint of an auto run does with that run's decisions. The
rows and the optimizer state go with the variable, so a switch never changes the arithmetic."""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..process_memory import give_back_free_heap
from ..ps.table import PSTable
from ..sync.base import Variable
from ..types import Placement, Route
from . import estimate

ROUTES = {estimate.PS: Route.PS, estimate.ALLGATHER: Route.ALLGATHER, estimate.DENSE: Route.SPARSE_AS_DENSE}


class AutoFrontend(Protocol):
    """What a frontend does for `sync: auto`."""

    returns_to_ps: bool  # whether a table can come back to the parameter server (a trial that lost)
    # whether the frontend calls SyncSet.step_taken() after the step's update: a move is then made
    # there (a replica's gradient, reduced but not yet applied, must not be left behind by a move
    # onto the parameter server); otherwise at the step's synchronize
    moves_after_step: bool

    def candidates(self, var: Variable) -> tuple:
        """Routes (estimate's names) whose update of var equals the server rule's."""

    def to_replica(self, var: Variable, rows: np.ndarray | None) -> None:
        """var leaves the parameter server: it becomes a local variable holding `rows` (the whole
        table; None when var already keeps an identical replica), and var.access an access to it."""

    def set_optimizer_state(self, var: Variable, slots: dict, step: int) -> None:
        """The wrapped optimizer's state for var: the server's slots (num_rows x dim arrays by
        slot name) and step."""

    def replica_state(self, var: Variable, slot_names: list) -> tuple:
        """(rows, {slot name: values}, step): var's local table and the wrapped optimizer's state
        for it, the same on every rank (the way back to the parameter server)."""

    def to_table(self, var: Variable, table) -> None:
        """var goes back to the parameter server: its PS module (sharded) reads from `table`, and
        the local rows are freed (a replicated table keeps them: the shards alias them)."""

    def set_table(self, var: Variable, table) -> None:
        """var's PS module (sharded placement) reads from `table` from now on."""


class Switch:
    """Moves a variable to another route (or PS shard count), carrying its rows and optimizer
    state over exactly, both ways: off the parameter server into the frontend's own variable
    and optimizer, and back."""

    def __init__(self, sync_set, frontend: AutoFrontend):
        self.sync_set, self.frontend = sync_set, frontend

    def apply(self, var: Variable, decision: dict, step: int) -> None:
        """Collective: var to the route of `decision` (estimate.Decision.to_json(), with
        `measured`, ...), recorded in its plan."""
        self.move(var, decision["choice"], decision["shards"])
        self.record(var, decision, step)

    def move(self, var: Variable, choice: str, shards: int) -> None:
        """Collective: var to route `choice` (on `shards` PS shards)."""
        route, plan = ROUTES[choice], var.plan
        if route is Route.PS and plan.route is Route.PS:
            if shards and shards != plan.shards:
                self._reshard(var, shards)
        elif route is Route.PS:
            self._enter_ps(var, shards)
        elif plan.route is Route.PS:
            self._leave_ps(var, route)
        elif plan.route is not route:  # between two routes that keep a local replica
            plan.route = route
            self.sync_set.move(var)

    @staticmethod
    def record(var: Variable, decision: dict, step: int) -> None:
        plan = var.plan
        plan.auto.update(decision, status="decided", switched_at_step=step)
        predicted = (decision.get("memory_bytes") or {}).get(decision.get("choice"))
        if predicted is not None:
            plan.memory_bytes = int(predicted)
        head = plan.reason.split("; auto:")[0]
        placement = (f" {plan.placement.value}, {plan.shards} shard{'s' if plan.shards != 1 else ''}"
                     if plan.route is Route.PS else "")
        plan.reason = f"{head}; auto: {plan.route.value}{placement} from step {step} (explain() shows why)"

    def _leave_ps(self, var: Variable, route: Route) -> None:
        """Collective: var's rows and server state go to the frontend's own variable and optimizer."""
        table, plan = var.table, var.plan
        storage = table.storage
        give_back_free_heap()  # the replica grows into the memory earlier steps freed
        if plan.placement is Placement.SHARDED:  # the shards free their rows as the replicas fill
            rows, slots, step = table.hand_over()
        else:  # every rank's shard held the whole table: the replica has the rows already
            state = table.state()
            rows, slots, step = None, {name: view.read() for name, view in state["slots"].items()}, state["step"]
            if table.attached is not None:  # the shard aliased the replica: it keeps a copy of its own
                table.attach(None)
        self.frontend.to_replica(var, rows)
        self.frontend.set_optimizer_state(var, slots, step)
        if plan.placement is not Placement.SHARDED:
            table.drop()  # its rows and server state now live in the frontend's variable and optimizer
        del rows, slots
        give_back_free_heap()  # what the hand-over's messages used
        var.table = None
        var.ps_home = {"placement": plan.placement, "shards": plan.shards, "partition": plan.partition,
                       "optimizer": plan.optimizer, "optimizer_source": plan.optimizer_source, "storage": storage}
        plan.route, plan.placement, plan.shards = route, Placement.NONE, 0
        plan.optimizer, plan.optimizer_source, plan.compression = None, "-", "none"
        plan.bytes_per_step = None
        self.sync_set.move(var)

    def _enter_ps(self, var: Variable, shards: int) -> None:
        """Collective: var's local rows and the wrapped optimizer's state for it (the same on every
        rank) become a table on the parameter server again, where it was before it left."""
        home, plan = var.ps_home, var.plan
        shards = shards or home["shards"]
        table = PSTable(var.name, plan.shape[0], var.dim, shards, home["partition"], home["optimizer"],
                        storage=home.get("storage"))
        rows, slots, step = self.frontend.replica_state(var, table.slot_names)
        replicated = home["placement"] is Placement.REPLICATED
        view = var.access.replica() if replicated else None
        if view is not None:
            table.attach(view)  # the shard's rows alias the replica, which stays
        else:
            if replicated:
                table.attach(None)  # (a replica it cannot alias: the shard owns a copy)
            table.scatter(rows)
        for k, name in enumerate(table.slot_names):
            table.scatter(slots[name], k)
        table.set_step(step)
        self.frontend.to_table(var, table)
        var.table, var.ps_home = table, None
        plan.route, plan.placement, plan.shards = Route.PS, home["placement"], shards
        plan.partition, plan.optimizer, plan.optimizer_source = home["partition"], home["optimizer"], \
            home["optimizer_source"]
        self.sync_set.move(var)

    def _reshard(self, var: Variable, shards: int) -> None:
        """Collective: a new table on `shards` shards takes var's rows and server state, each
        rank its new shard's, read from the old shards in chunks (no rank holds the table)."""
        old, plan = var.table, var.plan
        sharded = plan.placement is Placement.SHARDED
        view = None if sharded else var.access.replica()  # replicated: the shard may alias the replica
        new = PSTable(var.name, plan.shape[0], var.dim, shards, plan.partition, plan.optimizer, storage=old.storage)
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
    if not variables or not all(d and d.get("status") == "decided" and d.get("choice") in ROUTES for d in decisions):
        return False
    switch, world = Switch(sync_set, frontend), sync_set.ctx.world_size
    for var, decision in zip(variables, decisions):
        shards = min(int(decision.get("shards") or 0), world) or var.plan.shards
        decision = {**decision, "shards": shards, "why": f"from the checkpoint's plan: {decision.get('why', '')}"}
        var.access = getattr(var.access, "inner", var.access)  # this run was measuring: stop
        switch.apply(var, decision, int(decision.get("switched_at_step") or 0))
    return True
