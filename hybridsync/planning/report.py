"""The plan rendered: explain()'s tables (the plan, sync: auto's decision, dynamic tables,
bounded staleness, the adaptive batch), its JSON, and the registry of live plans explain() prints.
The plan itself is data (plan.py)."""
from __future__ import annotations

import json
import sys
import threading
import weakref

from .. import runtime
from ..adaptive.report import describe as describe_adaptive
from ..ps.dynamic import live_statistics
from ..ps.table import live_tier_statistics
from ..settings import settings
from .estimate import PS, human_bytes
from .plan import Plan, VariablePlan
from ..ps.storage import describe as describe_storage


def render(plan: Plan) -> str:
    """The plan as a fixed-width text table, one row per variable, then its sections (sync: auto,
    dynamic tables, bounded staleness, adaptive batch)."""
    headers = ["variable", "shape", "kind", "route", "placement", "shards", "server optimizer",
               "compression", "bytes/step", "memory/rank", "why"]
    rows = []
    for v in plan.variables:
        opt = "-"
        if v.optimizer:
            extra = ", ".join(f"{k}={_short(x)}" for k, x in v.optimizer.items() if k != "name")
            opt = f"{v.optimizer['name']}({extra})" if extra else v.optimizer["name"]
        rows.append([
            v.name, "x".join(str(d) for d in v.shape) or "scalar",
            v.kind.value if v.kind else "(first backward)",
            v.route.value if v.route else "(first backward)", v.placement.value,
            str(v.shards) if v.shards else "-", opt, v.compression,
            human_bytes(v.bytes_per_step) if v.bytes_per_step is not None else "(after step 1)",
            human_bytes(v.memory_bytes) if v.memory_bytes is not None else "-",
            v.reason,
        ])
    reason = f" - {plan.backend_reason}" if plan.backend_reason and plan.backend_reason != "default" else ""
    title = (f"hybridsync plan ({plan.framework}, {plan.world_size} rank{'s' if plan.world_size != 1 else ''}, "
             f"dense backend: {plan.backend or '-'}{reason})")
    lines = [title] + format_table(headers, rows)
    auto = [v for v in plan.variables if v.auto]
    if auto:
        lines += ["", "sync: auto"] + ["  " + describe_auto(v.name, v.auto, v.shape) for v in auto]
    dynamic = [v for v in plan.variables if v.dynamic]
    if dynamic:
        lines += ["", "dynamic tables (options)"] + ["  " + describe_dynamic(v) for v in dynamic]
    stored = [v for v in plan.variables if v.storage]
    if stored:
        lines += ["", "table storage (rows on the shards; optimizer slots stay float32)"]
        lines += [f"  {v.name}: {describe_storage(v.storage)}" for v in stored]
    bounded = [v for v in plan.variables if v.staleness]
    if bounded:
        lines += ["", "bounded staleness (k: a pull waits while another rank is more than k steps behind)"
                  if plan.offline else
                  "bounded staleness (lag: the other ranks' steps a pull's rows missed, this rank)"]
        lines += ["  " + describe_staleness(v, plan.offline) for v in bounded]
    if plan.adaptive:
        lines += ["", *describe_adaptive(plan.adaptive)]
    return "\n".join(lines)


def format_table(headers: list, rows: list) -> list[str]:
    """Fixed-width columns: the header line, a dashed rule, one line per row."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def auto_decision_table(variables: list, step: int) -> str:
    """What `sync: auto` chose for each of its variables (VariablePlans, decided), in the plan's
    table format: the route from now on and, briefly, the numbers it was chosen on."""
    headers = ["variable", "route", "shards", "density", "rows/rank", "over ranks", "predicted",
               "measured step", "why"]
    rows = []
    for v in variables:
        auto, measured = v.auto or {}, (v.auto or {}).get("measured", {})
        predicted = sorted((auto.get("predicted_ms") or {}).items(), key=lambda kv: kv[1])
        rows.append([
            v.name, v.route.value if v.route else "-", str(v.shards) if v.shards else "-",
            f"{measured.get('density', 0.0):.2%}", f"{measured.get('rows_per_rank', 0.0):.1f}",
            f"{measured.get('union_rows', 0.0):.1f}", ", ".join(f"{r} {format_time(ms)}" for r, ms in predicted),
            ", ".join(f"{t['routes'].get(v.name, '?')} {format_time(t['step_ms'])}"
                      for t in auto.get("trials") or []) or "-",
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


# The plans of live distributed optimizers, newest last, for explain().
_registry: list = []
_lock = threading.Lock()


# `sync: auto` variables whose plan this process printed while they were still measuring (by id;
# a variable's entry goes with it): their decision is printed here too, once it is made.
_shown_measuring: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def announce(plan: "Plan") -> None:
    """Rank 0 prints a plan once it is made, when HYBRIDSYNC_EXPLAIN=1 (hybridsync-run)."""
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
    """Per live dynamic table, this rank's shards' rows stored against their share of capacity,
    rows admitted / evicted / expired in the newest step and in total, and bytes per stored row
    (rows, optimizer slots, and the id map with its per-row counters)."""
    rows = []
    for name, s in live_statistics():
        per_row = lambda b: f"{b / s['stored']:.0f} B" if s["stored"] else "-"  # noqa: E731
        rows.append([name, f"{s['stored']}/{s['capacity'] or 'unbounded'}",
                     f"{s['last_admitted']}/{s['last_evicted']}/{s['last_expired']}",
                     f"{s['admitted']}/{s['evicted']}/{s['expired']}", str(s["pending"]),
                     per_row(s["row_bytes"] + s["map_bytes"]), per_row(s["map_bytes"])])
    if not rows:
        return []
    head = ["dynamic table", "stored/capacity", "adm/evict/exp last step", "adm/evict/exp total", "pending",
            "bytes/row", "of which map"]
    return ["", "dynamic tables (this rank's shards):"] + format_table(head, rows)


def _tier_lines() -> list:
    """Per live table with a disk tier, this rank's shard: rows in memory (against its share) and
    on disk, the share of lookups memory served, and the tier's bytes read and written per step."""
    rows = []
    for name, s in live_tier_statistics():
        lookups, steps = s["hits"] + s["loads"], max(s["steps"], 1)
        rows.append([name, s["dtype"], f"{s['memory_rows']}/{s['memory_share']}", str(s["disk_rows"]),
                     f"{s['hits'] / lookups:.1%}" if lookups else "-", human_bytes(s["bytes_read"] // steps),
                     human_bytes(s["bytes_written"] // steps)])
    if not rows:
        return []
    head = ["tiered table", "dtype", "memory/share", "on disk", "hit rate", "read/step", "written/step"]
    return ["", "tables with a disk tier (this rank's shard):"] + format_table(head, rows)


def _print_plans(plans: list, file=None) -> str:
    text = "\n".join(["\n\n".join(render(p) for p in plans)] + _dynamic_lines() + _tier_lines())
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


def format_time(ms: float) -> str:
    return f"{ms:.3f} ms" if ms >= 1 else f"{ms * 1e3:.1f} us"


def describe_auto(name: str, auto: dict, shape) -> str:
    """One line of explain() for a `sync: auto` variable (plan.VariablePlan.auto)."""
    if auto.get("status") != "decided":
        return f"{name}: measuring ({auto.get('steps')} steps on ps, then the route is chosen once)"
    m = auto.get("measured", {})
    pred = auto.get("predicted_ms", {})
    cands = ", ".join(f"{r} {format_time(ms)}" for r, ms in sorted(pred.items(), key=lambda kv: kv[1]))
    k = auto.get("shards", 0)
    shards = f" on {k} shard{'s' if k != 1 else ''}" if auto.get("choice") == PS else ""
    memory = ", ".join(f"{r} {human_bytes(b)}" for r, b in (auto.get("memory_bytes") or {}).items())
    trials = auto.get("trials") or []
    measured = ", ".join(f"{t['routes'].get(name, '?')} {format_time(t['step_ms'])}" for t in trials)
    return (f"{name}: density {m.get('density', 0.0):.2%} ({m.get('rows_per_rank', 0.0):.1f} rows/rank, "
            f"{m.get('union_rows', 0.0):.1f} over ranks, of {shape[0] if shape else '?'}; "
            f"{m.get('bytes_per_step', 0.0):.0f} B/rank/step; compute {m.get('compute_ms', 0.0):.2f} ms) | "
            f"predicted: {cands} | memory/rank: {memory or '-'} | "
            f"measured step: {measured or 'not tried'} | choice: {auto.get('choice')}{shards} at step {auto.get('switched_at_step')}, "
            f"margin {auto.get('margin', 0.0):+.0%} ({auto.get('why', '')})")
