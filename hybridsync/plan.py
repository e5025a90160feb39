"""The plan: one route per variable, as plain data. It prints as a table (explain()),
serialises to JSON, and a plan written as JSON loads back as a config."""
from __future__ import annotations

import dataclasses
import json
import sys
import threading
import weakref

from .types import GradKind, Placement, Route


@dataclasses.dataclass
class VariablePlan:
    name: str
    shape: tuple
    dtype: str
    kind: GradKind | None  # None: decided by the first backward pass
    route: Route | None
    placement: Placement = Placement.NONE
    shards: int = 0  # PS shards holding the table (0: not on the PS)
    partition: str = "cyclic"
    compression: str = "none"
    optimizer: dict | None = None  # server-side rule, e.g. {"name": "adagrad", "lr": 0.1}
    optimizer_source: str = "-"  # "wrapped" (follows the optimizer, LR schedules too) | "config"
    reason: str = ""
    bytes_per_step: int | None = None  # measured after the first steps
    # sync: auto -- {"status": "measuring" | "decided", "steps": K, then the measured density,
    # each candidate's predicted ms, "choice", "margin"} (hybridsync.sync.auto)
    auto: dict | None = None
    staleness: int = 0  # bounded staleness of a PS table (0: synchronous; docs/staleness.md)
    # what this rank's pulls of it missed: {"pulls", "last_lag", "max_lag", "mean_lag", "held", "wait_s"}
    lag: dict | None = None
    # a dynamic table's options {"capacity", "admit_after", "evict", "ttl_steps"} (None: not dynamic)
    dynamic: dict | None = None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["kind"] = self.kind.value if self.kind else None
        d["route"] = self.route.value if self.route else None
        d["placement"] = self.placement.value
        return d

    @classmethod
    def from_json(cls, d: dict) -> "VariablePlan":
        d = dict(d)
        d["shape"] = tuple(d["shape"])
        d["kind"] = GradKind(d["kind"]) if d.get("kind") else None
        d["route"] = Route(d["route"]) if d.get("route") else None
        d["placement"] = Placement(d.get("placement", "-"))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclasses.dataclass
class Plan:
    variables: list[VariablePlan]
    framework: str = "torch"
    backend: str = ""
    world_size: int = 1
    backend_reason: str = ""
    adaptive: dict | None = None  # hybridsync.adaptive's summary (noise scale, batch, gain), if on
    offline: bool = False  # made by `python -m hybridsync explain`: no step has run, nothing measured

    def by_name(self) -> dict[str, VariablePlan]:
        return {v.name: v for v in self.variables}

    def table(self) -> str:
        """The plan as a fixed-width text table, one row per variable."""
        headers = ["variable", "shape", "kind", "route", "placement", "shards", "server optimizer",
                   "compression", "bytes/step", "why"]
        rows = []
        for v in self.variables:
            opt = "-"
            if v.optimizer:
                extra = ", ".join(f"{k}={_short(x)}" for k, x in v.optimizer.items() if k != "name")
                opt = f"{v.optimizer['name']}({extra})" if extra else v.optimizer["name"]
            rows.append([
                v.name, "x".join(str(d) for d in v.shape) or "scalar",
                v.kind.value if v.kind else "(first backward)",
                v.route.value if v.route else "(first backward)", v.placement.value,
                str(v.shards) if v.shards else "-", opt, v.compression,
                _human_bytes(v.bytes_per_step) if v.bytes_per_step is not None else "(after step 1)",
                v.reason,
            ])
        reason = f" - {self.backend_reason}" if self.backend_reason and self.backend_reason != "default" else ""
        title = (f"hybridsync plan ({self.framework}, {self.world_size} rank{'s' if self.world_size != 1 else ''}, "
                 f"dense backend: {self.backend or '-'}{reason})")
        lines = [title] + format_table(headers, rows)
        auto = [v for v in self.variables if v.auto]
        if auto:
            from .sync.cost_model import describe_auto

            lines += ["", "sync: auto"] + ["  " + describe_auto(v.name, v.auto, v.shape) for v in auto]
        dynamic = [v for v in self.variables if v.dynamic]
        if dynamic:
            lines += ["", "dynamic tables (options)"] + ["  " + describe_dynamic(v) for v in dynamic]
        bounded = [v for v in self.variables if v.staleness]
        if bounded:
            lines += ["", "bounded staleness (k: a pull waits while another rank is more than k steps behind)"
                      if self.offline else
                      "bounded staleness (lag: the other ranks' steps a pull's rows missed, this rank)"]
            lines += ["  " + describe_staleness(v, self.offline) for v in bounded]
        if self.adaptive:
            from .adaptive.report import describe

            lines += ["", *describe(self.adaptive)]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"framework": self.framework, "backend": self.backend, "backend_reason": self.backend_reason,
                "world_size": self.world_size, "variables": [v.to_json() for v in self.variables],
                **({"adaptive": self.adaptive} if self.adaptive else {})}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        return cls([VariablePlan.from_json(v) for v in d["variables"]], d.get("framework", "torch"),
                   d.get("backend", ""), d.get("world_size", 1), d.get("backend_reason", ""))


def format_table(headers: list, rows: list) -> list[str]:
    """Fixed-width columns: the header line, a dashed rule, one line per row."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def auto_decision_table(variables: list, step: int) -> str:
    """What `sync: auto` chose for each of its variables (VariablePlans, decided), in the plan's
    table format: the route from now on and, briefly, the numbers it was chosen on."""
    from .sync.cost_model import format_time

    headers = ["variable", "route", "shards", "density", "rows/rank", "over ranks", "predicted",
               "why"]
    rows = []
    for v in variables:
        auto, measured = v.auto or {}, (v.auto or {}).get("measured", {})
        predicted = sorted((auto.get("predicted_ms") or {}).items(), key=lambda kv: kv[1])
        rows.append([
            v.name, v.route.value if v.route else "-", str(v.shards) if v.shards else "-",
            f"{measured.get('density', 0.0):.2%}", f"{measured.get('rows_per_rank', 0.0):.1f}",
            f"{measured.get('union_rows', 0.0):.1f}", ", ".join(f"{r} {format_time(ms)}" for r, ms in predicted),
            auto.get("why", ""),
        ])
    title = (f"hybridsync sync: auto decided at step {step}: each table's route from now on "
             "(predicted: the table's exchange and update per step; explain() shows more)")
    return "\n".join([title] + format_table(headers, rows))


def describe_dynamic(v: VariablePlan) -> str:
    """One line: a dynamic table's options (a plan written as JSON keeps them, and loads back)."""
    d = v.dynamic
    return (f"{v.name}: capacity {d.get('capacity') or 'unbounded'}, admit after {d.get('admit_after', 1)} touches, "
            f"evict {d.get('evict') or 'none'}, ttl {d.get('ttl_steps') or 'none'} steps")


def describe_staleness(v: VariablePlan, offline: bool = False) -> str:
    """One line: a table's bound and the lag its pulls saw so far (a plan made offline: the bound)."""
    if offline:
        return f"{v.name}: staleness {v.staleness}"
    lag = v.lag or {}
    if not lag.get("pulls"):
        return f"{v.name}: staleness {v.staleness}; no pull yet"
    return (f"{v.name}: staleness {v.staleness}; lag last {lag['last_lag']}, max {lag['max_lag']}, "
            f"mean {lag['mean_lag']:.2f} over {lag['pulls']} pulls; {lag['held']} held at the bound "
            f"({lag['wait_s']:.2f} s in pulls)")


def _short(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# The plans of live distributed optimizers, newest last, for explain().
_registry: list = []
_lock = threading.Lock()


# `sync: auto` variables whose plan this process printed while they were still measuring (by id;
# a variable's entry goes with it): their decision is printed here too, once it is made.
_shown_measuring: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def announce(plan: "Plan") -> None:
    """Rank 0 prints a plan once it is made, when HYBRIDSYNC_EXPLAIN=1 (hybridsync-run)."""
    from . import runtime
    from .settings import settings

    if settings().explain and runtime.world().rank == 0:
        _print_plans([plan])


def announce_auto_decision(variables: list, step: int) -> None:
    """Prints what `sync: auto` decided (auto_decision_table) where the plan was printed while it
    was measuring -- by explain() on this rank, or by announce() -- so whoever read "measuring"
    reads the outcome too."""
    with _lock:
        shown = [v for v in variables if _shown_measuring.pop(id(v), None) is v]
    if shown:
        write_lines(auto_decision_table(variables, step))


def register(plan_source) -> None:
    """Registers an object with a `.plan` property (a distributed optimizer)."""
    with _lock:
        _registry.append(weakref.ref(plan_source))


def current_plans() -> list[Plan]:
    with _lock:
        live = [r() for r in _registry]
        _registry[:] = [r for r, obj in zip(list(_registry), live) if obj is not None]
        return [obj.plan for obj in live if obj is not None]


def explain(file=None, as_json: bool = False) -> str:
    """Prints (and returns) the plan of every live DistributedOptimizer."""
    plans = current_plans()
    if as_json:
        text = json.dumps([p.to_json() for p in plans], indent=2)
    elif not plans:
        text = "hybridsync: no DistributedOptimizer has been created yet"
    else:
        return _print_plans(plans, file)
    write_lines(text, file)
    return text


def _dynamic_lines() -> list:
    import sys

    if "hybridsync.ps.dynamic" not in sys.modules:  # no dynamic table was ever made
        return []
    from .ps.dynamic import explain_lines

    return explain_lines()


def _print_plans(plans: list, file=None) -> str:
    text = "\n".join(["\n\n".join(p.table() for p in plans)] + _dynamic_lines())
    with _lock:
        for v in (v for p in plans for v in p.variables):
            if v.auto and v.auto.get("status") == "measuring":
                _shown_measuring[id(v)] = v
    write_lines(text, file)
    return text


def write_lines(text: str, file=None) -> None:
    """One write per line: horovodrun and mpirun tag each chunk they read with the rank, so a
    table written in one go (or a print whose newline is a second write, as with
    PYTHONUNBUFFERED) comes out with rank tags in the middle of lines."""
    file = file or sys.stdout
    for line in text.splitlines():
        file.write(line + "\n")
    file.flush()
