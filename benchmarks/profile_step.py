"""Where the flagship DLRM's step goes, phase by phase, at 1 and 2 ranks on one host.

    python benchmarks/profile_step.py                        # hybridsync default and PS, 1 and 2 ranks, 3 rounds
    python benchmarks/profile_step.py --compare ../old-tree  # also another checkout's hybridsync ("@before")

Every configuration runs benchmarks/run_one.py (the workload of benchmarks/bench.py: 8 x 250k x 32
tables, batch 512 per rank, SGD) twice per round, interleaved: once plain, for the step time and
the CPU each thread of each rank spent (/proc/self/task), and once with the timeline on
(HYBRIDSYNC_TIMELINE), whose spans cut the trainer thread's step into forward, PS pull, backward,
dense all-reduce, PS push, the rest of synchronize, the dense update and the loop around the
optimizer; the PS server thread's spans (serving pulls, applying pushes) are summed beside them.
"Waiting" is the step's wall time less the trainer thread's CPU time: the time the trainer spent
blocked (on the other rank, the network, or a core busy with another thread). With 2 ranks on
2 cores the limit is twice one rank's samples/s; the table prints the fraction reached, and
what two independent 1-rank trainings started together reach (no MPI job between them: the two
cores' shared cache and memory bandwidth are all they have in common), the limit this hardware
sets before any synchronisation.
Writes benchmarks/results/<name>.{json,md,png} and docs/performance.md's profile section.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import benchmarks.bench as bench  # noqa: E402
from benchmarks.bench import (RESULTS, ROOT, free_port, load_average, median, results_image, rounds_table,  # noqa: E402
                              run, update_docs)

TRAINER_PHASES = ("forward (model)", "PS pull", "backward (model)", "dense all-reduce", "PS push",
                  "rest of synchronize", "dense update", "around the optimizer")
SERVER_PHASES = ("server: serve pulls", "server: apply pushes")
TRAINER_THREAD = "main"  # run_one.py's name for the process's main thread, the trainer
SERVER_THREAD = "hybridsync-ps"


def _inside(event, span, slack_us=1.0) -> bool:
    return event["ts"] >= span["ts"] - slack_us and event["ts"] + event["dur"] <= span["ts"] + span["dur"] + slack_us


def phases_of_trace(events: list[dict], steps: int) -> dict:
    """Mean ms per step of each phase over the last `steps` steps of one rank's trace."""
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    trainer = [e for e in spans if e.get("cat") != "server"]
    server = [e for e in spans if e.get("cat") == "server"]
    forwards = [e for e in trainer if e["name"] == "forward"]
    if len(forwards) < steps:
        raise ValueError(f"the trace has {len(forwards)} forward spans, fewer than the {steps} timed steps")
    first = forwards[-steps]
    begin, end = first["ts"], max(e["ts"] + e["dur"] for e in trainer)
    timed = [e for e in trainer if e["ts"] >= begin - 1.0]
    top = [e for e in timed if e["name"] in ("forward", "backward", "synchronize", "optimizer update (dense)")]
    totals = dict.fromkeys(TRAINER_PHASES + SERVER_PHASES, 0.0)

    def within(span, prefix):
        return sum(e["dur"] for e in timed if e is not span and e["name"].startswith(prefix) and _inside(e, span))

    for span in top:
        name = span["name"]
        if name == "forward":
            pulls = within(span, "pull")
            totals["PS pull"] += pulls
            totals["forward (model)"] += span["dur"] - pulls
        elif name == "backward":
            starts = within(span, "all-reduce")
            totals["dense all-reduce"] += starts
            totals["backward (model)"] += span["dur"] - starts
        elif name == "synchronize":
            pushes, reduces = within(span, "push"), within(span, "all-reduce")
            totals["PS push"] += pushes
            totals["dense all-reduce"] += reduces
            totals["rest of synchronize"] += span["dur"] - pushes - reduces
        else:
            totals["dense update"] += span["dur"]
    totals["around the optimizer"] = (end - begin) - sum(s["dur"] for s in top)
    for e in server:
        if begin <= e["ts"] <= end:
            totals["server: serve pulls" if "pull" in e["name"] else "server: apply pushes"] += e["dur"]
    return {k: v / 1e3 / steps for k, v in totals.items()}


def read_rank_traces(path: Path) -> list[list[dict]]:
    files = sorted(path.parent.glob(f"{path.stem}.rank*{path.suffix}"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
    return [json.loads(f.read_text()) for f in files if not f.name.endswith(".partial")]


def profile_run(system: str, ranks: int, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="hybridsync-profile-") as scratch:
        trace = Path(scratch) / "trace.json"
        result = run(system, ranks, steps, warmup, extra=("--timeline", str(trace)))
        if "error" in result:
            return result
        per_rank = [phases_of_trace(events, steps) for events in read_rank_traces(trace)]
    if len(per_rank) != ranks:
        return {"system": system, "ranks": ranks, "error": f"{len(per_rank)} rank traces for {ranks} ranks"}
    return {**result, "traced_phases_ms": {k: sum(r[k] for r in per_rank) / ranks for k in per_rank[0]}}


def independent_pair(system: str, steps: int, warmup: int, timeout: float = 600) -> dict:
    """Two 1-rank trainings of `system` started together, each its own process and MPI job:
    their summed samples/s is what the two cores give with nothing synchronised."""
    with tempfile.TemporaryDirectory(prefix="hybridsync-pair-") as scratch:
        cmd = lambda: bench.mpirun(1) + [sys.executable, str(ROOT / "benchmarks" / "run_one.py"), "--system", system,
                                         "--steps", str(steps), "--warmup", str(warmup), "--port", str(free_port()),
                                         "--start-together", f"{scratch}:2"]
        results = bench.run_separately([cmd(), cmd()], timeout)
    if isinstance(results, str):
        return {"system": system, "ranks": 2, "error": results}
    return {"system": system, "ranks": 2, "samples_per_s": sum(r["samples_per_s"] for r in results),
            "ms_per_step": median([r["ms_per_step"] for r in results])}


def plan(args) -> list[tuple]:
    runs = []
    for round_ in range(args.repeats):
        k = round_ % len(args.systems)
        for system in args.systems[k:] + args.systems[:k]:
            for ranks in args.ranks:
                runs += [("plain", system, ranks, round_), ("traced", system, ranks, round_)]
        if 2 in args.ranks:
            runs.append(("independent", args.systems[0].split("@")[0], 2, round_))
    return runs


def thread_split(result: dict) -> dict:
    """Mean over ranks of ms of CPU per step: the trainer, the PS server, every other thread."""
    out = {"trainer": [], "PS server": [], "other threads": []}
    for threads in result["thread_cpu_ms_per_step_per_rank"]:
        out["trainer"].append(threads.get(TRAINER_THREAD, 0.0))
        out["PS server"].append(threads.get(SERVER_THREAD, 0.0))
        out["other threads"].append(sum(v for k, v in threads.items() if k not in (TRAINER_THREAD, SERVER_THREAD)))
    return {k: sum(v) / len(v) for k, v in out.items()}


def summarise(raw: list[dict]) -> list[dict]:
    groups = {}
    pairs = [r["samples_per_s"] for r in raw if r["kind"] == "independent" and "error" not in r]
    for r in raw:
        if "error" not in r and r["kind"] != "independent":
            groups.setdefault((r["system"], r["ranks"]), {"plain": [], "traced": []})[r["kind"]].append(r)
    summary = []
    for (system, ranks), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        plain, traced = runs["plain"], runs["traced"]
        if not plain or not traced:
            continue
        cpu = [thread_split(r) for r in plain]
        s = {"system": system, "ranks": ranks, "repeats": len(plain),
             "ms_per_step": median([r["ms_per_step"] for r in plain]),
             "samples_per_s": median([r["samples_per_s"] for r in plain]),
             "traced_ms_per_step": median([r["ms_per_step"] for r in traced]),
             "cpu_ms": {k: median([c[k] for c in cpu]) for k in cpu[0]},
             "process_cpu_ms": median([sum(r["cpu_ms_per_step_per_rank"]) / ranks for r in plain]),
             "phases_ms": {k: median([r["traced_phases_ms"][k] for r in traced]) for k in traced[0]["traced_phases_ms"]}}
        s["waiting_ms"] = max(0.0, s["ms_per_step"] - s["cpu_ms"]["trainer"])
        summary.append(s)
    ones = {s["system"]: s for s in summary if s["ranks"] == 1}
    for s in summary:
        one = ones.get(s["system"])
        if one and s["ranks"] > 1:
            s["scaling"] = s["samples_per_s"] / one["samples_per_s"]
            s["of_core_limit"] = s["scaling"] / min(s["ranks"], 2)  # this machine's 2 cores
            if pairs and s["ranks"] == 2:
                s["independent_pair_samples_per_s"] = median(pairs)
                s["of_independent_pair"] = s["samples_per_s"] / median(pairs)
                s["independent_pair_of_core_limit"] = median(pairs) / (2 * one["samples_per_s"])
    return summary


def markdown(summary: list[dict], meta: dict, raw: list[dict]) -> str:
    cols = [f"{s['system'].removeprefix('hybridsync-')} x{s['ranks']}" for s in summary]
    lines = [f"Measured {meta['date']} ({meta['repeats']} interleaved rounds of {meta['steps']} steps, {meta['warmup']} "
             "warm-up; medians). Trainer-thread phases from the timeline run (ms per step, mean over ranks); "
             "step time, CPU and waiting from the plain run.", "",
             "| ms per step | " + " | ".join(cols) + " |", "| --- |" + " ---: |" * len(cols)]

    def row(label, values, fmt="{:.2f}"):
        lines.append(f"| {label} | " + " | ".join("-" if v is None else fmt.format(v) for v in values) + " |")

    row("**step (plain run)**", [s["ms_per_step"] for s in summary])
    row("samples/s", [s["samples_per_s"] for s in summary], "{:,.0f}")
    row("2 ranks / (2 x 1 rank): of the 2-core limit", [s.get("of_core_limit") for s in summary], "{:.2f}")
    row("2 independent 1-rank runs at once / (2 x 1 rank)", [s.get("independent_pair_of_core_limit") for s in summary],
        "{:.2f}")
    row("2 ranks / 2 independent 1-rank runs", [s.get("of_independent_pair") for s in summary], "{:.2f}")
    row("step with the timeline on", [s["traced_ms_per_step"] for s in summary])
    for phase in TRAINER_PHASES:
        row(f"trainer: {phase}", [s["phases_ms"][phase] for s in summary])
    for phase in SERVER_PHASES:
        row(phase + " (own thread)", [s["phases_ms"][phase] for s in summary])
    row("CPU: trainer thread", [s["cpu_ms"]["trainer"] for s in summary])
    row("CPU: PS server thread", [s["cpu_ms"]["PS server"] for s in summary])
    row("CPU: other threads (MPI, Horovod, torch)", [s["cpu_ms"]["other threads"] for s in summary])
    row("trainer waiting (step - trainer CPU)", [s["waiting_ms"] for s in summary])
    return "\n".join(lines) + rounds_table(raw)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{s['system'].removeprefix('hybridsync-')}\nx{s['ranks']}" for s in summary]
    bottom = [0.0] * len(summary)
    for phase in TRAINER_PHASES:
        values = [s["phases_ms"][phase] for s in summary]
        ax.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.plot(labels, [s["ms_per_step"] for s in summary], "k_", markersize=40, label="step, plain run")
    ax.set_ylabel("ms per step (trainer thread)")
    ax.set_title("Where the DLRM step goes (timeline phases, mean over ranks)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", default="hybridsync-default,hybridsync-ps")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=40, help="enough for sync: auto to settle its routes")
    p.add_argument("--compare", default=None, help="another checkout: its hybridsync systems run as '<system>@before'")
    p.add_argument("--name", default="profile", help="results/<name>.{json,md,png}")
    p.add_argument("--no-docs", action="store_true", help="leave docs/performance.md as it is")
    args = p.parse_args()
    args.systems, args.ranks = args.systems.split(","), [int(r) for r in args.ranks.split(",")]
    if args.compare:
        bench.COMPARE_TREE = Path(args.compare).resolve()
        args.systems += [f"{s}@before" for s in args.systems]
    raw, seen = [], set()
    for kind, system, ranks, round_ in tqdm(plan(args), desc="profile runs", unit="run"):
        loadavg = load_average() if round_ not in seen else None
        if loadavg:
            seen.add(round_)
            tqdm.write(f"round {round_ + 1}/{args.repeats}: load average {' / '.join(map(str, loadavg))}")
        if kind == "independent":
            result = independent_pair(system, args.steps, args.warmup)
        elif kind == "plain":
            result = run(system, ranks, args.steps, args.warmup)
        else:
            result = profile_run(system, ranks, args.steps, args.warmup)
        result.update(kind=kind, round=round_, loadavg=loadavg)
        if "error" in result:
            tqdm.write(f"{kind} {system} x{ranks}: {result['error'][-500:]}")
        raw.append(result)
    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "repeats": args.repeats, "steps": args.steps,
            "warmup": args.warmup, "systems": args.systems, "ranks": args.ranks}
    summary = summarise(raw)
    text = markdown(summary, meta, raw)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"meta": meta, "summary": summary, "raw": raw}, indent=1))
    (RESULTS / f"{args.name}.md").write_text(text + "\n")
    plot(summary, RESULTS / f"{args.name}.png")
    print(text)
    if not args.no_docs and args.name == "profile":
        update_docs("profile", text + "\n\n" + results_image("where the step goes", f"{args.name}.png"))


if __name__ == "__main__":
    main()
