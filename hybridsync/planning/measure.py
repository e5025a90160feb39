"""`sync: auto` (the default for sparse variables): measure, let the model prune, let the clock decide.

1. For the first K steps (`auto_steps` in the config, else HYBRIDSYNC_AUTO_STEPS, default 20)
   each auto variable runs on the parameter server -- which applies the wrapped optimizer's
   update exactly whatever the density -- while this module records the rows each rank touched
   per step and how long the steps took.
2. After step K, on every rank at once (inside the step's synchronize, a collective point), the
   counts are gathered on rank 0, which predicts each variable's time and memory per rank on
   each candidate route (estimate.py; the candidates apply exactly the same update: choose.py),
   drops the routes over the memory budget and those predicted far slower than the best, and
   broadcasts the assignments worth trying: the model's choice, and each other route where it
   is not pruned.
3. Each trial assignment runs for TRIAL_STEPS steps (a switch is exact: switch.py), timed; the
   assignment whose median step is shortest on the slowest rank -- the parameter server's, from
   step 1, among them -- is kept, and the variables move there for good. Then this object
   detaches itself: later steps do no auto work at all.

The plan records, per variable, what was measured, each route's predicted time and memory, each
trial's measured step, the choice and why (explain() prints them; the JSON plan keeps them and
loads back as a fixed config), and wherever the plan was printed while it measured, the decision
is printed as a table (report.announce_auto_decision). After an hvd.join() -- the ranks then
took different numbers of steps -- measuring starts again, and nothing is decided while a rank
has joined. The frontend supplies what is framework-specific (switch.AutoFrontend).
"""
from __future__ import annotations

import time

import numpy as np

from .. import ps, timeline
from ..adaptive.exchange import gather_rows
from ..comm import probe
from ..sync.base import Variable
from . import estimate
from .choose import assignments_to_try
from .report import announce_auto_decision
from .switch import Switch

TRIAL_STEPS = 8  # steps each trial assignment runs (config: auto_trial_steps): the first TRIAL_WARMUP
TRIAL_WARMUP = 2  # are not timed (a switch's own cost, and caches settling)


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

    __slots__ = ("inner", "ids", "spent_s")

    def __init__(self, inner):
        self.inner, self.ids, self.spent_s = inner, None, 0.0

    def rows(self):
        got = self.inner.rows()
        if got is not None:
            start = time.perf_counter()
            self.ids = np.unique(np.asarray(got[0], dtype=np.int64))
            self.spent_s += time.perf_counter() - start  # the PS's measured step leaves this out
        return got

    def __getattr__(self, name):
        return getattr(self.inner, name)


class AutoStrategy:
    """Measures a SyncSet's auto variables, tries the assignments worth trying, keeps the fastest."""

    def __init__(self, sync_set, variables: list, frontend, steps: int, budget: int, links=None,
                 fixed_bytes: float = 0.0, trial_steps: int = TRIAL_STEPS):
        """Collective (the link probe, unless `links` is given). budget: bytes per rank the
        tables may take (memory_per_rank); fixed_bytes: what the variables auto does not route
        take of it; trial_steps: steps each tried assignment runs (0: the model's choice is
        taken untried)."""
        self.sync_set, self.frontend, self.steps = sync_set, frontend, int(steps)
        self.trial_steps = int(trial_steps)
        self.budget, self.fixed_bytes = budget, fixed_bytes
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
        self.step_s: list = []  # this rank's step times in the current phase
        self.trials: list = []  # assignments still to try, then each tried one's measured step
        self.measured: list = []  # (assignment, this rank's median step) per finished phase
        self._sync_end = None
        self._last_step_end = None
        self._due = None  # the move decided, still to make (after_step)
        self._joins = ps.joins()

    # -- every step ---------------------------------------------------------------------------------
    def before_sync(self) -> None:
        if self._sync_end is not None:
            self.compute_s.append(time.perf_counter() - self._sync_end)

    def after_sync(self) -> bool:
        """Records the step; at the end of a phase, decides what runs next and moves the
        variables there -- or, for a frontend that says the step's update is still to come
        (moves_after_step), leaves the move to after_step(). True when done."""
        if ps.joins() != self._joins:
            self._measure_afresh()
        now = time.perf_counter()
        if self._last_step_end is not None:
            self.step_s.append(now - self._last_step_end)
        self._last_step_end = now
        if not self.trials:  # still measuring on the parameter server
            for var in self.variables:
                rec = var.access
                self.ids[var].append(rec.ids if rec.ids is not None else np.zeros(0, np.int64))
                if self.step_s:
                    self.step_s[-1] -= rec.spent_s
                rec.ids, rec.spent_s = None, 0.0
        self.step += 1
        phase_end = self.steps if not self.trials else self.steps + self.trial_steps * len(self.measured)
        if self.step < phase_end or not self._everyone_steps():
            self._sync_end = time.perf_counter()
            return False
        with timeline.span(f"sync: auto ({len(self.variables)} variables)", "ps"):
            self._phase_done()
        if getattr(self.frontend, "moves_after_step", False):
            return False
        return self.after_step()

    def after_step(self) -> bool:
        """The move decided at the end of the phase, once the step's update is applied (a
        replica's pending gradient would not reach a table it moves to). True when done."""
        due, self._due = self._due, None
        if due is None:
            return False
        with timeline.span(f"sync: auto ({len(self.variables)} variables)", "ps"):
            done = due()
        self._sync_end = self._last_step_end = time.perf_counter()  # (a switch is no step)
        return done

    def _everyone_steps(self) -> bool:
        """Collective over the ranks still stepping: whether none has called hvd.join() (it takes
        part in this sum with zeros). A decision gathers every rank's measurements, so a rank that
        ran out of data first must train again -- after the join, measuring starts afresh."""
        ctx = self.sync_set.ctx
        if ctx.world_size == 1:
            return True
        return len(gather_rows(ctx.allreduce_sum, ctx.backend.rank, ctx.world_size, [], "hybridsync.auto.ready")) \
            == ctx.world_size

    def _median_step(self, warmup: int) -> float:
        times = self.step_s[warmup:] or self.step_s
        return float(np.median(times)) if times else 0.0

    # -- phases ---------------------------------------------------------------------------------------
    def _phase_done(self) -> None:
        backend = self.sync_set.ctx.backend
        if not self.trials:  # the parameter server's phase: predict, and choose what to try
            current = {var.name: {"choice": estimate.PS, "shards": var.plan.shards} for var in self.variables}
            self.measured.append((current, self._median_step(warmup=2)))
            mine = {"ids": [self.ids[var] for var in self.variables],
                    "compute_s": float(np.median(self.compute_s)) if self.compute_s else 0.0}
            everyone = backend.allgather_object(mine, name="hybridsync.auto.stats")
            plan = self._plan_trials(everyone) if backend.rank == 0 else None
            plan = backend.broadcast_object(plan, 0, name="hybridsync.auto.trials")
            self.ids.clear()
            self.predictions, self.trials = plan["predictions"], plan["trials"]
            if not self.trials:  # nothing worth trying (or nothing the frontend can try)
                self.measured = []
                self._due = lambda: self._finish(plan["decided"])
                return
        else:  # a trial ended
            self.measured.append((self.trials[len(self.measured) - 1], self._median_step(TRIAL_WARMUP)))
        self.step_s = []
        if len(self.measured) <= len(self.trials):  # the next trial
            trial = self.trials[len(self.measured) - 1]
            self._due = lambda: self._switch_to(trial, trial=True)
            return
        steps = backend.allgather_object([t for _, t in self.measured], name="hybridsync.auto.trial_times")
        slowest = [max(rank[i] for rank in steps) for i in range(len(self.measured))]
        best = min(range(len(slowest)), key=lambda i: (slowest[i], i))
        self.measured = [(a, t) for (a, _), t in zip(self.measured, slowest)]
        self._due = lambda: self._finish(self.measured[best][0])

    def _plan_trials(self, everyone: list) -> dict:
        """Rank 0: each variable's predictions, and the assignments to try."""
        predictions = {var.name: self._predict(i, var, everyone) for i, var in enumerate(self.variables)}
        trials, decided = assignments_to_try(predictions, self.budget - self.fixed_bytes,
                                             self.frontend.returns_to_ps and self.trial_steps > 0)
        return {"predictions": predictions, "trials": trials, "decided": decided}

    def _predict(self, i: int, var: Variable, everyone: list) -> dict:
        per_rank = [[len(ids) for ids in stats["ids"][i]] for stats in everyone]
        steps = len(per_rank[0])
        union = [len(np.unique(np.concatenate([stats["ids"][i][s] for stats in everyone]))) for s in range(steps)]
        compute = max(stats["compute_s"] for stats in everyone)
        world = self.sync_set.ctx.world_size
        stats = estimate.TableStats(
            name=var.name, num_rows=int(var.plan.shape[0]), dim=var.dim, world_size=world,
            placement=var.plan.placement.value, rows_per_rank=float(np.mean(per_rank)),
            union_rows=float(np.mean(union)), compute_s=compute, steps=steps,
            candidates=self.frontend.candidates(var))
        decision = estimate.decide(stats, self.links, var.plan.shards)
        slots = estimate.SLOTS.get((var.plan.optimizer or {}).get("name", "sgd"), 0)
        memory = {route: estimate.memory_per_rank(route, stats.num_rows, var.dim, world,
                                                  decision.shards or var.plan.shards, var.plan.placement.value,
                                                  slots, stats.rows_per_rank, storage=var.plan.storage)
                  for route in stats.candidates}
        measured = {"steps": steps, "rows_per_rank": round(stats.rows_per_rank, 3),
                    "union_rows": round(stats.union_rows, 3), "density": round(stats.density, 6),
                    "bytes_per_step": round(stats.bytes_per_step, 1), "compute_ms": round(compute * 1e3, 4)}
        return {**decision.to_json(), "measured": measured, "candidates": list(stats.candidates),
                "memory_bytes": {r: int(b) for r, b in memory.items()}, "ps_current_shards": var.plan.shards}

    def _switch_to(self, assignment: dict, trial: bool) -> bool:
        """Collective: every auto variable to its route in `assignment` (name -> choice, shards)."""
        switch = Switch(self.sync_set, self.frontend)
        for var in self.variables:
            if isinstance(var.access, _Recording):
                var.access = var.access.inner
            switch.move(var, assignment[var.name]["choice"], assignment[var.name]["shards"])
        return False

    def _finish(self, assignment: dict) -> bool:
        """Collective: the variables go to `assignment` for good; the plan says what was measured."""
        self._switch_to(assignment, trial=False)
        tried = [{"routes": {n: a["choice"] for n, a in a_.items()}, "step_ms": round(t * 1e3, 4)}
                 for a_, t in self.measured]
        for var in self.variables:
            p = self.predictions[var.name]
            choice = assignment[var.name]
            why = (f"measured fastest of {len(self.measured)} assignments ({_measured_list(self.measured)})"
                   if self.measured else p["why"] + ("; the replicas that fit in memory_per_rank"
                                                     if p.get("over_budget") else ""))
            decision = {**p, "choice": choice["choice"], "shards": choice["shards"], "why": why,
                        "trials": tried}
            Switch(self.sync_set, self.frontend).record(var, decision, self.step)
        announce_auto_decision([var.plan for var in self.variables], self.step)
        return True


def _measured_list(measured: list) -> str:
    def name(assignment):
        routes = sorted({a["choice"] for a in assignment.values()})
        return "+".join(routes)
    return ", ".join(f"{name(a)} {t * 1e3:.2f} ms" for a, t in measured)
