"""The route registry (route, placement) -> synchronizer class, and SyncSet: the synchronizers
of one distributed optimizer, driven the same way by every frontend."""
from __future__ import annotations

from .. import timeline
from ..types import Placement, Route
from .base import SyncContext, Synchronizer, Variable

_SYNCHRONIZERS: dict = {}


def register(route: Route, placement: Placement = Placement.NONE):
    """Class decorator: the synchronizer of `route` with `placement`."""
    def decorate(cls):
        _SYNCHRONIZERS[(route, placement)] = cls
        return cls
    return decorate


def synchronizer_class(route: Route, placement: Placement, variable: str):
    _load_routes()
    cls = _SYNCHRONIZERS.get((route, placement))
    if cls is None:
        raise NotImplementedError(f"variable '{variable}': route {route.value} with placement "
                                  f"{placement.value} is not available")
    return cls


def _load_routes() -> None:
    # The route modules register themselves on import.
    from . import allgather, dense, ps_routes  # noqa: F401


def key(route: Route, placement: Placement) -> str:
    """The name a route's state is saved under."""
    return f"{route.value}/{placement.value}"


class SyncSet:
    def __init__(self, ctx: SyncContext):
        self.ctx = ctx
        self.by_route: dict = {}  # (route, placement) -> Synchronizer
        self.route_of: dict = {}  # Variable -> (route, placement)
        self._order: list = []  # synchronizers, those that only send (PS pushes) first
        self.verified = False
        self.auto = None  # sync: auto while it measures (hybridsync.planning.measure.AutoStrategy)
        self._held: list = []  # synchronizers whose exchange waits for apply_held() / discard_held()

    def assign(self, var: Variable) -> Synchronizer:
        """Puts var under its planned route's synchronizer (made on first use)."""
        route = (var.plan.route, var.plan.placement)
        sync = self.by_route.get(route)
        if sync is None:
            sync = self.by_route[route] = synchronizer_class(*route, var.name)(self.ctx)
            self._order = sorted(self.by_route.values(), key=lambda s: s.waits)
        sync.add(var)
        sync.verified = self.verified
        self.route_of[var] = route
        return sync

    def move(self, var: Variable) -> Synchronizer:
        """var leaves its synchronizer for the one of its plan's (new) route."""
        old = self.by_route[self.route_of.pop(var)]
        old.variables.remove(var)
        if not old.variables:
            del self.by_route[next(k for k, s in self.by_route.items() if s is old)]
            self._order = sorted(self.by_route.values(), key=lambda s: s.waits)
        return self.assign(var)

    def prepare(self) -> None:
        for sync in self.by_route.values():
            sync.prepare()

    def mark_verified(self) -> None:
        self.verified = True
        for sync in self.by_route.values():
            sync.verified = True

    def grad_ready(self, var: Variable) -> None:
        self.by_route[self.route_of[var]].grad_ready(var)

    def synchronize(self, hold_updates: bool = False) -> None:
        """Every route's exchange. Routes that only send (PS pushes) go first, so their messages
        travel while the routes that wait complete. hold_updates: the routes that change the
        variables themselves (the parameter server applies its rule as it takes a push) wait for
        apply_held() -- the step may still be skipped (discard_held())."""
        auto = self.auto
        if auto is not None:
            auto.before_sync()
        stats = self.ctx.stats
        if stats is not None:
            stats.begin_sync()
        self._held = [sync for sync in self._order if hold_updates and sync.applies_updates]
        for sync in self._order:
            if sync not in self._held:
                sync.synchronize()
        if stats is not None:  # (on the dense backend, so that a rank that called join() takes part)
            stats.end_step(self.ctx.allreduce_sum, routes_settled=auto is None)
        if not self._held:
            self._step_done()

    def apply_held(self) -> None:
        """The held routes' exchange (synchronize(hold_updates=True), then the step is taken)."""
        held, self._held = self._held, []
        for sync in held:
            sync.synchronize()
        if held:
            self._step_done()

    def discard_held(self) -> None:
        """The step was skipped on every rank: the held routes send nothing (a rank that takes it
        while another skips it meets a collective the other never calls: both raise)."""
        held, self._held = self._held, []
        for sync in held:
            sync.discard()
        if held:
            self._step_done()

    def holding(self) -> bool:
        return bool(self._held)

    def _step_done(self) -> None:
        # (sync: auto counts the step only once its rows were pushed or dropped: a switch off the
        # parameter server between synchronize() and a held push would lose them)
        if self.auto is not None and self.auto.after_sync():
            self.auto = None  # decided: from now on no auto work at all

    def step_taken(self) -> None:
        """The frontend applied (or skipped) the step's update: a `sync: auto` move decided at its
        synchronize is made now (planning.switch.AutoFrontend.moves_after_step)."""
        if self.auto is not None and self.auto.after_step():
            self.auto = None

    def in_flight(self) -> bool:
        return any(sync.in_flight() for sync in self.by_route.values())

    def rescale_accumulators(self, factor: float) -> None:
        """Collective: every route's accumulated squared gradients times `factor` (the PS
        tables' Adagrad sums; the frontend rescales its own optimizer's)."""
        for sync in self._order:
            sync.rescale_accumulators(factor)

    def state_dict(self) -> dict:
        """Collective: each route's state (server optimizer state of PS tables), by route."""
        with timeline.span("state_dict", "ps"):
            state = {key(*route): sync.state_dict() for route, sync in self.by_route.items()}
        return {k: v for k, v in state.items() if v}

    def load_state_dict(self, state: dict) -> dict:
        """Loads each route's state into the variables that have it now; returns the rest (by
        route, then variable): state of variables whose route or table does not exist yet."""
        rest = {}
        for name, tables in state.items():
            sync = next((s for route, s in self.by_route.items() if key(*route) == name), None)
            placed = sync.load_state_dict(tables) if sync is not None else set()
            left = {var: value for var, value in tables.items() if var not in placed}
            if left:
                rest[name] = left
        return rest
