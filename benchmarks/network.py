"""Network-bound benchmark: 2 hosts x 1 and x 2 ranks, links unlimited, 10 Gbit and 1 Gbit.

The hosts are network namespaces on this machine joined by a bridge (launch/cluster.py); a
link's rate is a token bucket on both its ends, and ranks on different hosts talk TCP. Same
workload as benchmarks/bench.py (DLRM, 8 x 250k x 32 tables, batch 512 per rank, SGD):

    python benchmarks/network.py                 # `make bench-network` (about an hour)
    python benchmarks/network.py --quick         # one repeat, fewer steps (writes network-quick.*)

TorchRec ("torchrec-cpu", benchmarks/torchrec_dlrm.py in its own venv: scripts/torchrec-venv.sh)
runs as on real hosts: one torchrun per host, meeting at a c10d rendezvous on host 0's address,
Gloo over the hosts' links.

Each round also runs every system on 1 rank with no network (the compute benchmarks/model.py is
calibrated with), and two independent 1-rank trainings at once on one core, as a host of the
2 x 2 runs has it: what that host's compute costs with no synchronisation at all, the bound
every 2 x 2 system here works under. Per configuration, medians over interleaved rounds: samples/s; bytes on the wire per rank per
step (the host link's counters over the timed steps, shared out to the host's ranks); where a
step's time goes (forward / backward / optimizer step, timed on every rank). Writes
benchmarks/results/network.{json,md,png} and updates docs/performance.md's network section. Needs
root (`--rerender`, which summarises network.json's runs again, does not).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench import (RESULTS, ROOT, SIDE_BY_SIDE, TORCHREC, free_port, load_average, median,  # noqa: E402
                              results_image, rounds_table, run, run_separately, update_docs, use_torchrec)
from launch.cluster import Cluster  # noqa: E402

SYSTEMS = ["hybridsync-default", "hybridsync-ps", "hybridsync-sharded", "hybridsync-replicated", "horovod-allgather",
           "horovod-allgather-yield", "horovod-sparse-as-dense", TORCHREC]
BASELINE, TUNED = "horovod-allgather", "horovod-allgather-yield"
RATES = ["unlimited", "10gbit", "1gbit"]
FLOOR_SYSTEM = "hybridsync-sharded"  # its 1-rank run: the workload's compute, whole tables local
FLOOR = "2 independent 1-rank runs on 1 core"


def shared_core_floor(jobs: int, steps: int, warmup: int, timeout: float = 900, extra=()) -> dict:
    """`jobs` independent 1-rank trainings started together on CPU 0 (no MPI job between them,
    so no synchronisation; their timed steps start together): their median ms/step is the compute
    of a host whose `jobs` ranks share one core, cache and memory bandwidth included."""
    with tempfile.TemporaryDirectory(prefix="hybridsync-floor-") as scratch:
        cmd = lambda: ["taskset", "-c", "0", sys.executable, str(ROOT / "benchmarks" / "run_one.py"), "--system",
                       FLOOR_SYSTEM, "--steps", str(steps), "--warmup", str(warmup), "--port", str(free_port()),
                       "--start-together", f"{scratch}:{jobs}", *extra]
        results = run_separately([cmd() for _ in range(jobs)], timeout)
    if isinstance(results, str):
        return {"system": FLOOR, "error": results}
    ms = median([r["ms_per_step"] for r in results])
    return {"system": FLOOR, "ranks": jobs, "ms_per_step": ms, "samples_per_s": results[0]["batch"] * jobs * 1e3 / ms,
            "phases_ms": {p: median([r["phases_ms"][p] for r in results]) for p in ("forward", "backward", "step")},
            "loss": median([r["loss"] for r in results])}


def plan(args):
    """(rate, per_host, system, steps, warmup, round) of every run, in order."""
    runs = []
    for round_ in range(args.repeats):
        k = round_ % len(args.systems)
        systems = args.systems[k:] + args.systems[:k]  # each round starts with another system
        for system in systems:  # one rank alone, no network: the compute the model is fitted with
            if system != "horovod-sparse-as-dense":
                runs.append(("local", 0, system, args.steps, args.warmup, round_))
        if 2 in args.per_host:
            runs.append(("local", 2, FLOOR, args.steps, args.warmup, round_))
        for rate in args.rates:
            for per_host in args.per_host:
                for system in systems:
                    dense = system == "horovod-sparse-as-dense"  # 256 MB all-reduced per step: few steps
                    runs.append((rate, per_host, system, args.dense_steps if dense else args.steps,
                                 2 if dense else args.warmup, round_))
    return runs


def summarise(raw):
    groups = {}
    for r in raw:
        if "error" not in r:
            groups.setdefault((r["rate"], r["per_host"], r["system"]), []).append(r)
    summary = []
    for (rate, per_host, system), rs in groups.items():
        summary.append({
            "rate": rate, "hosts": 2 if per_host and system != FLOOR else 1, "per_host": per_host,
            "ranks": per_host if system == FLOOR else max(1, 2 * per_host),
            "system": system,
            "repeats": len(rs),
            "samples_per_s": median([r["samples_per_s"] for r in rs]),
            "ms_per_step": median([r["ms_per_step"] for r in rs]),
            "wire_tx_per_rank_step": median([r.get("wire_tx_bytes_per_rank_step") for r in rs]),
            "wire_rx_per_rank_step": median([r.get("wire_rx_bytes_per_rank_step") for r in rs]),
            "phases_ms": {p: median([r["phases_ms"][p] for r in rs]) for p in ("forward", "backward", "step")},
            "loss": median([r["loss"] for r in rs]),
            **({"plan": rs[-1]["plan"]} if rs[-1].get("plan") else {}),
        })
    by = {(s["rate"], s["per_host"], s["system"]): s for s in summary}
    for s in summary:
        for key, base in (("vs_horovod", BASELINE), ("vs_horovod_tuned", TUNED)):
            b = by.get((s["rate"], s["per_host"], base))
            s[key] = s["samples_per_s"] / b["samples_per_s"] if b else None
        unlimited = by.get(("unlimited", s["per_host"], s["system"]))
        s["vs_own_unlimited"] = s["samples_per_s"] / unlimited["samples_per_s"] if unlimited else None
    order = {r: i for i, r in enumerate(["local"] + RATES)}
    summary.sort(key=lambda s: (s["per_host"], order.get(s["rate"], 9), s["system"]))
    return summary


def fmt(x, spec, scale=1.0):
    return "-" if x is None else format(x / scale, spec)


def markdown(summary, meta) -> str:
    lines = [
        f"Measured {meta['date']}: 2 hosts (network namespaces on one {meta['cores']}-core machine, TCP over a "
        f"bridge, each link rate-limited both ways), medians of {meta['repeats']} interleaved rounds, "
        f"{meta['steps']} timed steps ({meta['dense_steps']} for sparse-as-dense). Wire bytes: the host link's "
        "counters over the timed steps, per rank per step. Phases: forward / backward / optimizer step, ms."
        + (f" SMOKE RUN: tables of {meta['rows']:,} rows, not the workload's." if meta.get("rows") else ""),
        "",
        "| link | ranks | system | samples/s | ms/step | vs Horovod | vs Horovod (yield) | vs own unlimited | "
        "wire MiB out/in | fwd / bwd / step ms |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summary:
        ph = s["phases_ms"]
        where = ("2 on 1 core (no network)" if s["system"] == FLOOR else
                 f"2x{s['per_host']}" if s["per_host"] else "1 (no network)")
        lines.append(
            f"| {s['rate']} | {where} | {s['system']} | {fmt(s['samples_per_s'], ',.0f')} | "
            f"{fmt(s['ms_per_step'], '.1f')} | {fmt(s['vs_horovod'], '.2f')}x | {fmt(s['vs_horovod_tuned'], '.2f')}x | "
            f"{fmt(s['vs_own_unlimited'], '.2f')}x | {fmt(s['wire_tx_per_rank_step'], '.2f', 2**20)} / "
            f"{fmt(s['wire_rx_per_rank_step'], '.2f', 2**20)} | "
            f"{fmt(ph['forward'], '.1f')} / {fmt(ph['backward'], '.1f')} / {fmt(ph['step'], '.1f')} |")
    return "\n".join(lines)


def side_by_side(summary) -> str:
    """ms/step at 2 hosts x N per link rate: hybridsync as it comes next to what a team would
    pick today (vs own unlimited: samples/s over the same system's with the links unlimited)."""
    by = {(s["rate"], s["per_host"], s["system"]): s for s in summary}
    columns = [(system, name) for system, name in SIDE_BY_SIDE if any(k[2] == system for k in by)]
    lines = []
    for per_host in sorted({k[1] for k in by if k[1] and k[2] != FLOOR}):
        lines += ["", "", f"Side by side, 2 hosts x {per_host}, ms/step (vs the same system with the links unlimited):",
                  "", "| link | " + " | ".join(name for _, name in columns) + " |",
                  "| --- | " + " | ".join("---:" for _ in columns) + " |"]
        for rate in RATES:
            cells = []
            for system, _ in columns:
                s = by.get((rate, per_host, system))
                own = f" ({s['vs_own_unlimited']:.2f}x)" if s and s["vs_own_unlimited"] and rate != "unlimited" else ""
                cells.append(f"{s['ms_per_step']:.2f} ms{own}" if s and s["ms_per_step"] else "-")
            if any(c != "-" for c in cells):
                lines.append(f"| {rate} | " + " | ".join(cells) + " |")
    plans = sorted({(s["per_host"], s["plan"]) for s in summary if s.get("plan") and s["per_host"]})
    for per_host, plan in plans[-1:]:
        lines += ["", f"TorchRec's default planner at 2 hosts x {per_host}:", "", "```", plan, "```"]
    return "\n".join(lines)


def targets(summary):
    by = {(s["rate"], s["per_host"], s["system"]): s for s in summary}
    out = []
    s = by.get(("1gbit", 2, "hybridsync-sharded"))
    if s and s["vs_horovod_tuned"]:
        out.append(("2 hosts x 2 ranks at 1 Gbit >= 3x Horovod at its best", s["vs_horovod_tuned"] >= 3,
                    f"{s['vs_horovod_tuned']:.2f}x"))
    if s and s["vs_own_unlimited"]:
        out.append(("... and >= 0.9x hybridsync's own unthrottled speed", s["vs_own_unlimited"] >= 0.9,
                    f"{s['vs_own_unlimited']:.2f}x"))
    default = by.get(("1gbit", 2, "hybridsync-default"))
    if default and default["vs_own_unlimited"]:
        out.append(("hybridsync default, 2 hosts x 2 ranks at 1 Gbit >= 0.9x its own unthrottled speed",
                    default["vs_own_unlimited"] >= 0.9, f"{default['vs_own_unlimited']:.2f}x"))
    for rate in RATES:
        mine, theirs = by.get((rate, 2, "hybridsync-default")), by.get((rate, 2, TORCHREC))
        if mine and theirs and mine["samples_per_s"] and theirs["samples_per_s"]:
            out.append((f"hybridsync default vs TorchRec CPU, 2 hosts x 2 at {rate}", None,
                        f"{mine['samples_per_s'] / theirs['samples_per_s']:.2f}x the samples/s"))
    floor, tuned = by.get(("local", 2, FLOOR)), by.get(("1gbit", 2, TUNED))
    unlimited = by.get(("unlimited", 2, "hybridsync-sharded"))
    if floor and tuned and unlimited:
        out.append(("bound on this machine, where a host's 2 ranks share one core: 3x Horovod at its best at "
                    "1 Gbit is a step of", None,
                    f"{tuned['ms_per_step'] / 3:.1f} ms; 2 independent 1-rank trainings on one core, with no "
                    f"synchronisation at all, take {floor['ms_per_step']:.1f} ms, and hybridsync 2 x 2 with the "
                    f"links unlimited {unlimited['ms_per_step']:.1f} ms"))
    return out


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = [s for s in summary if s["per_host"] and s["rate"] != "local"]
    per_hosts = sorted({s["per_host"] for s in summary})
    fig, axes = plt.subplots(1, len(per_hosts), figsize=(6 * len(per_hosts), 4.5), squeeze=False)
    rates = [r for r in RATES if any(s["rate"] == r for s in summary)]
    systems = sorted({s["system"] for s in summary})
    width = 0.8 / max(1, len(systems))
    for ax, per_host in zip(axes[0], per_hosts):
        for i, system in enumerate(systems):
            values = [next((s["samples_per_s"] for s in summary if s["rate"] == r and s["per_host"] == per_host
                            and s["system"] == system), 0) for r in rates]
            ax.bar([j + i * width for j in range(len(rates))], values, width, label=system)
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(rates))], rates)
        ax.set(title=f"2 hosts x {per_host} rank(s)", ylabel="samples/s (higher is better)", yscale="log")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rates", default=",".join(RATES))
    p.add_argument("--per-host", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--dense-steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="1 repeat, 60 steps: a smoke run (writes network-quick.*)")
    p.add_argument("--rows", type=int, default=None,
                   help="rows per table (default: the workload's 250,000); smaller for smoke tests")
    p.add_argument("--name", default=None,
                   help="results/<name>.{json,md,png} (default: network; --quick: network-quick)")
    p.add_argument("--torchrec-python", default=None, help=f"the TorchRec venv's python for {TORCHREC!r} "
                   "(default: $HYBRIDSYNC_TORCHREC_PYTHON, else ~/.cache/hybridsync/torchrec-venv/bin/python)")
    p.add_argument("--no-docs", "--no-readme", dest="no_docs", action="store_true",
                   help="leave docs/performance.md as it is")
    p.add_argument("--rerender", action="store_true",
                   help="no runs: summarise benchmarks/results/<name>.json's runs again (tables, targets, docs page)")
    args = p.parse_args()
    args.systems, args.rates = args.systems.split(","), args.rates.split(",")
    args.per_host = [int(x) for x in args.per_host.split(",")]
    if args.quick:
        args.repeats, args.steps, args.warmup, args.dense_steps = 1, 60, 10, 3
    args.name = args.name or ("network-quick" if args.quick else "network")
    if args.rerender:
        previous = json.loads((RESULTS / f"{args.name}.json").read_text())
        report(previous["runs"], previous["meta"], args)
        return
    why = Cluster.unavailable()
    if why:
        sys.exit(f"network benchmark: cannot emulate hosts here: {why}")
    if TORCHREC in args.systems:
        use_torchrec(args.torchrec_python)
    raw = measure(args)
    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count(),
            "repeats": args.repeats, "steps": args.steps, "dense_steps": args.dense_steps}
    if args.rows:
        meta["rows"] = args.rows
    report(raw, meta, args)


def measure(args) -> list:
    """Every run of the plan, on 2 emulated hosts; one result per run (failures included)."""
    raw = []
    extra = ("--rows", str(args.rows)) if args.rows else ()
    with Cluster(2, prefix="hsb", subnet="10.231.8") as cluster:
        current, current_round = None, -1
        for rate, per_host, system, steps, warmup, round_ in tqdm(plan(args), desc="network runs", unit="run"):
            if round_ != current_round:
                current_round = round_
                tqdm.write(f"round {round_ + 1}/{args.repeats}: load average {' / '.join(map(str, load_average()))}")
            if rate != current and rate != "local":
                for host in cluster.names:
                    cluster.set_rate(host, None if rate == "unlimited" else rate)
                current = rate
            loadavg = load_average()
            if system == FLOOR:
                result = shared_core_floor(per_host, steps, warmup, extra=extra)
            elif rate == "local":
                result = run(system, 1, steps, warmup, extra=extra)
            else:
                result = run(system, 2 * per_host, steps, warmup, cluster=cluster, per_host=per_host, extra=extra)
            result.update(rate=rate, per_host=per_host, round=round_, loadavg=loadavg)
            if "error" in result:
                tqdm.write(f"FAILED {system} 2x{per_host} at {rate}: {result['error'][-400:]}")
            raw.append(result)
    return raw


def report(raw: list, meta: dict, args) -> None:
    """Summary, targets, plot and results/network.{json,md,png}; the docs page's section."""
    summary = summarise(raw)
    checks = targets(summary)
    target_lines = "\n".join(f"- {'info' if ok is None else 'met' if ok else 'MISSED'}: {n} ({d})"
                             for n, ok, d in checks)
    failed = [f"{r['system']} 2x{r['per_host']} {r['rate']}" for r in raw if "error" in r]
    table = (markdown(summary, meta) + side_by_side(summary) + rounds_table(raw)
             + ("\n\nFailed runs: " + ", ".join(failed) if failed else ""))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "targets": [{"target": n, "met": ok, "measured": d} for n, ok, d in checks],
         "runs": raw}, indent=2))
    (RESULTS / f"{args.name}.md").write_text(table + "\n\nTargets:\n\n" + target_lines + "\n")
    plot(summary, RESULTS / f"{args.name}.png")
    print(table + "\n\nTargets:\n" + target_lines)
    print(f"\nwrote {RESULTS / args.name}.json, .md, .png")
    if not args.no_docs and not args.quick and args.name == "network" and not meta.get("rows"):
        update_docs("bench-network", table + "\n\n" + target_lines + "\n\n" + results_image("network benchmark", "network.png"))


if __name__ == "__main__":
    main()
