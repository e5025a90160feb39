"""A step clock the scenario advances itself, for tests of the adaptive batch's decisions.

The adaptive batch times each step with the wall clock (hybridsync/adaptive/collect.py) and
chooses from those times. Under real wall time a test's decisions depend on the machine's load:
a loaded CI machine measured other step times, so the batch grew later, or a size was never
judged, and a check of "the batch grew" or "it was re-chosen after step 6" failed now and then.
With this clock a step lasts exactly what the scenario spends in it, so the decisions are the
same on every run, while the statistics, the exchange between ranks and the decisions themselves
run as in training (every rank under real mpirun). The step clock's own arithmetic is unit-tested
(tests/unit/test_adaptive.py).

    clock = StepClock.install()
    for xb, yb in loader:
        ...backward...
        clock.spend(0.01 + 1e-5 * len(xb))   # this micro-step's cost
        opt.step()
"""
from __future__ import annotations

import types


class StepClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += float(seconds)

    @classmethod
    def install(cls) -> "StepClock":
        """Replaces the wall clock of the adaptive step timing (only there: the engine, the
        timeline and the liveness checks keep real time) in this process."""
        from hybridsync.adaptive import collect

        clock = cls()
        collect.time = types.SimpleNamespace(perf_counter=clock)
        return clock
