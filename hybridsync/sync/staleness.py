"""Bounded staleness, as users see it: after each push, what this rank's pulls of each bounded
table missed (the lag, in the other ranks' steps) goes into its plan row -- explain() prints it --
and, with HYBRIDSYNC_TIMELINE, into a counter per table. The bound itself is kept by the C++
engine (csrc/ps/bounded.cc); docs/staleness.md."""
from __future__ import annotations

from .. import timeline


def observe(variables: list) -> None:
    """Reads each bounded table's lag counters into var.plan.lag (and the timeline)."""
    if not variables:
        return
    tl = timeline.get()
    for var in variables:
        s = var.table.staleness()
        pulls = s["pulls"]
        var.plan.lag = {"pulls": pulls, "last_lag": s["last_lag"], "max_lag": s["max_lag"],
                        "mean_lag": s["lag_sum"] / pulls if pulls else 0.0, "held": s["held"],
                        "wait_s": round(s["wait_s"], 4)}
        if tl is not None:
            tl.counter(f"staleness lag {var.name}", {"value": s["last_lag"]}, cat="staleness")
