"""`sync: auto` against hand-written YAML, side by side: is the automatic choice the best one?

Workloads: the DLRM of benchmarks/bench.py, the same with a small densely used table 0
(`--hot-rows`: most of its rows are touched every step), and the NLP examples (word2vec and the
sampled-softmax language model; their own throughput over the whole run, auto's measuring steps
included). Each runs as a user writes it
(nn.Embedding(sparse=True), DistributedOptimizer(..., model=model)) under

  auto        no config: the defaults, `sync: auto` for sparse variables
  ps          benchmarks/configs/ps.yaml: every table on the PS, sharded
  allgather   benchmarks/configs/allgather.yaml: every table all-gathered (Horovod's way)
  dense       benchmarks/configs/dense.yaml: every table all-reduced as dense (the DLRM only)
  hot_dense   benchmarks/configs/hot_dense.yaml: table 0 all-reduced as dense, the rest on the PS
              (the hot workload only)

on one host (--ranks, default 2; `--ranks 1,2,4` for the flagship comparison) and on 2 emulated
hosts x 2 ranks at 1 Gbit (launch/cluster.py; root), in interleaved rounds, medians, the load
average kept with each run. Reports auto / the best hand-written config per workload and place,
and the routes auto chose with their predicted times (from the plan). Writes
benchmarks/results/auto.{json,md,png} and updates docs/performance.md's `sync: auto` section.

    python benchmarks/auto.py [--quick] [--no-network] [--ranks 1,2,4] [--workloads dlrm] [--configs auto,ps]
    python benchmarks/auto.py --rerender       # no runs: results/auto.json summarised again
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench import RESULTS, ROOT, load_average, median, run, update_docs  # noqa: E402

CONFIGS = ROOT / "benchmarks" / "configs"
WORKLOADS = {"dlrm": [], "dlrm-hot": ["--hot-rows", "256"]}
# The NLP examples, run as they are (their own throughput line; sync: auto measures within the run).
EXAMPLES = {"word2vec": ("torch_word2vec.py", ["--log-every", "100000"]),
            "lm": ("torch_lm.py", ["--log-every", "100000"])}
CANDIDATES = {"dlrm": ["auto", "ps", "allgather", "dense"], "dlrm-hot": ["auto", "ps", "allgather", "hot_dense"],
              "word2vec": ["auto", "ps", "allgather"], "lm": ["auto", "ps", "allgather"]}


def config_args(name: str) -> list[str]:
    return [] if name == "auto" else ["--config", str(CONFIGS / f"{name}.yaml")]


def run_example(workload, name, ranks, steps, cluster=None, per_host=1, timeout=900):
    """An NLP example under mpirun; its samples (pairs or words) per second."""
    import os
    import re
    import subprocess

    from benchmarks.bench import mpirun

    script, extra = EXAMPLES[workload]
    env = {**os.environ, "HYBRIDSYNC_EXPLAIN": "1"}  # rank 0 prints auto's decisions
    launcher = mpirun(ranks)
    if cluster is not None:
        env = cluster.env(env)
        launcher += ["-H", cluster.hosts_arg(per_host)]
    cmd = launcher + [sys.executable, str(ROOT / "examples" / script), "--steps", str(steps), *extra,
                      *config_args(name)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    found = re.search(r"steps on \d+ rank\(s\): ([\d,]+) (?:pairs|words)/s", out.stdout)
    if out.returncode != 0 or not found:
        return {"error": (out.stdout + out.stderr)[-2000:]}
    rate = float(found.group(1).replace(",", ""))
    return {"samples_per_s": rate, "ms_per_step": None, "routes": decided_routes(out.stdout)}


def decided_routes(stdout: str):
    """{variable: 'ps/4' | route} from the table `sync: auto` printed when it decided
    (hybridsync.planning.report.auto_decision_table; None if it did not run: a config fixed every route)."""
    marker = "sync: auto decided at step"
    if marker not in stdout:
        return None
    rows = stdout.split(marker, 1)[1].splitlines()[3:]  # past the title's end, the header and its rule
    routes = {}
    for line in rows:
        cells = line.split()
        if len(cells) < 3 or not (cells[2] == "-" or cells[2].isdigit()):
            break
        name, route, shards = cells[:3]
        routes[name] = f"{route}/{shards}" if route == "ps" else route
    return routes


def plan(args, places):
    runs = []
    for round_ in range(args.repeats):
        for place in places:
            for workload, candidates in CANDIDATES.items():
                if workload not in args.workloads:
                    continue
                candidates = [c for c in candidates if not args.configs or c in args.configs]
                k = round_ % len(candidates)
                for name in candidates[k:] + candidates[:k]:
                    runs.append((place, workload, name))
    return runs


def summarise(raw):
    groups = {}
    for r in raw:
        if "error" not in r:
            groups.setdefault((r["place"], r["workload"], r["config"]), []).append(r)
    rows = []
    for (place, workload, name), rs in sorted(groups.items()):
        rows.append({"place": place, "workload": workload, "config": name, "repeats": len(rs),
                     "samples_per_s": median([r["samples_per_s"] for r in rs]),
                     "ms_per_step": median([r["ms_per_step"] for r in rs]),
                     "routes": rs[-1].get("routes"), "auto": rs[-1].get("auto"),
                     "loadavg": [r.get("loadavg") for r in rs]})
    verdicts = []
    for place, workload in sorted({(r["place"], r["workload"]) for r in rows}):
        mine = [r for r in rows if r["place"] == place and r["workload"] == workload]
        auto = next((r for r in mine if r["config"] == "auto"), None)
        hand = [r for r in mine if r["config"] != "auto"]
        if auto and hand:
            best = max(hand, key=lambda r: r["samples_per_s"])
            verdicts.append({"place": place, "workload": workload, "best_hand_written": best["config"],
                             "auto_over_best": auto["samples_per_s"] / best["samples_per_s"],
                             "auto_routes": auto["routes"]})
    return rows, verdicts, prediction_errors(rows)


def prediction_errors(rows):
    """The cost model against the measurements: for each hand-written config, the step-time
    difference from all-PS that auto's predictions (per variable, summed) said it would make,
    and the difference measured (DLRM workloads, which report ms/step)."""
    out = []
    for auto in (r for r in rows if r["config"] == "auto" and r.get("auto") and r["ms_per_step"]):
        same = {r["config"]: r for r in rows if (r["place"], r["workload"]) == (auto["place"], auto["workload"])}
        ps = same.get("ps")
        if not ps or not ps["ms_per_step"]:
            continue
        for name, r in same.items():
            if name in ("auto", "ps") or not r["ms_per_step"] or not r["routes"]:
                continue
            predicted = 0.0
            for var, route in r["routes"].items():
                costs = (auto["auto"].get(var) or {}).get("predicted_ms") or {}
                route = route.split("/")[0]
                if route in costs and "ps" in costs:
                    predicted += costs[route] - costs["ps"]
            out.append({"place": auto["place"], "workload": auto["workload"], "config": name,
                        "predicted_ms_vs_ps": predicted, "measured_ms_vs_ps": r["ms_per_step"] - ps["ms_per_step"]})
    return out


def markdown(rows, verdicts, meta, errors=(), unfinished=()) -> str:
    lines = [f"Measured {meta['date']}; medians of {meta['repeats']} interleaved rounds. DLRM: {meta['steps']} timed "
             f"steps after {meta['warmup']} untimed ones, within which auto measures ({meta['auto_steps']} steps) and "
             f"switches; NLP: the examples' own rate over {meta['nlp_steps']} steps, auto's measuring included.", "",
             "| where | workload | config | samples/s | ms/step | load average (1 min) at each run |",
             "| --- | --- | --- | ---: | ---: | --- |"]
    for r in rows:
        ms = "-" if r["ms_per_step"] is None else f"{r['ms_per_step']:.2f}"
        load = ", ".join(f"{x[0]:.2f}" for x in r.get("loadavg") or [] if x)
        lines.append(f"| {r['place']} | {r['workload']} | {r['config']} | {r['samples_per_s']:,.0f} | {ms} | {load} |")
    for r in unfinished:
        lines.append(f"| {r['place']} | {r['workload']} | {r['config']} | - | - | {r['error']} |")
    lines += ["", "| where | workload | best hand-written | auto / best | what auto chose |", "| --- | --- | --- | ---: | --- |"]
    for v in verdicts:
        chose = ", ".join(f"{k}: {x}" for k, x in (v["auto_routes"] or {}).items())
        lines.append(f"| {v['place']} | {v['workload']} | {v['best_hand_written']} | {v['auto_over_best']:.3f}x | {chose} |")
    if errors:
        lines += ["", "The cost model vs the measurements: each config's step time minus all-PS, as auto's per-variable "
                  "predictions add up and as measured (ms):", "",
                  "| where | workload | config | predicted | measured |", "| --- | --- | --- | ---: | ---: |"]
        for e in errors:
            lines.append(f"| {e['place']} | {e['workload']} | {e['config']} | {e['predicted_ms_vs_ps']:+.2f} | "
                         f"{e['measured_ms_vs_ps']:+.2f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    # auto measures 20 steps, then tries up to 3 assignments for 8 steps each: 44 steps at most
    p.add_argument("--warmup", type=int, default=60, help="untimed steps; auto decides within them")
    # 1000: a 300-step word2vec run lasts 1.5 s, where this machine's noise (+-5%) and auto's
    # one-time cost (~30 ms) weigh more than they do in any real training run.
    p.add_argument("--nlp-steps", type=int, default=1000, help="steps of each NLP example run (auto's included)")
    p.add_argument("--no-network", action="store_true", help="one host only")
    p.add_argument("--ranks", default="2", help="rank counts on one host, comma-separated (e.g. 1,2,4)")
    p.add_argument("--workloads", default=",".join(CANDIDATES), help=f"of {', '.join(CANDIDATES)}")
    p.add_argument("--configs", default="", help="only these configs, comma-separated (e.g. auto,ps)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-docs", action="store_true", help="leave docs/performance.md as it is")
    p.add_argument("--rerender", action="store_true",
                   help="no runs: summarise benchmarks/results/auto.json's runs again (tables, docs page)")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.steps, args.nlp_steps = 1, 60, 60
    if args.rerender:
        previous = json.loads((RESULTS / "auto.json").read_text())
        report(previous["runs"], previous["meta"], args)
        return
    args.workloads = args.workloads.split(",")
    args.configs = [c for c in args.configs.split(",") if c]
    places = [f"1 host x {n}" for n in args.ranks.split(",")]
    cluster = None
    if not args.no_network:
        from launch.cluster import Cluster

        why = Cluster.unavailable()
        if why:
            print(f"auto benchmark: no emulated hosts ({why}); one host only", file=sys.stderr)
        else:
            cluster = Cluster(2, rate="1gbit", prefix="hsa", subnet="10.231.10").up()
            places.append("2 hosts x 2, 1 Gbit")
    raw = []
    timed_out = set()  # (place, workload, config): a run that timed out once is not repeated
    try:
        for place, workload, name in tqdm(plan(args, places), desc="auto runs", unit="run"):
            if (place, workload, name) in timed_out:
                raw.append({"error": "not run: timed out in an earlier round", "place": place,
                            "workload": workload, "config": name, "loadavg": load_average()})
                continue
            extra = [*WORKLOADS.get(workload, []), *config_args(name), "--print-routes"]
            on_cluster = place.startswith("2 hosts")
            if workload in EXAMPLES:
                result = run_example(workload, name, 4 if on_cluster else 2, args.nlp_steps,
                                     cluster=cluster if on_cluster else None, per_host=2)
            elif on_cluster:
                result = run("hybridsync", 4, args.steps, args.warmup, cluster=cluster, per_host=2, extra=extra)
            else:
                result = run("hybridsync", int(place.rsplit("x ", 1)[1]), args.steps, args.warmup, extra=extra)
            result.update(place=place, workload=workload, config=name, loadavg=load_average())
            if "timed out" in result.get("error", ""):
                timed_out.add((place, workload, name))
            if "error" in result:
                tqdm.write(f"FAILED {workload} {name} on {place}: {result['error'][-400:]}")
            raw.append(result)
    finally:
        if cluster is not None:
            cluster.down()
    from hybridsync.settings import settings

    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "repeats": args.repeats,
            "steps": args.steps, "warmup": args.warmup, "nlp_steps": args.nlp_steps,
            "auto_steps": settings().auto_steps}
    report(raw, meta, args)


def report(raw: list, meta: dict, args) -> None:
    """Summary, verdicts, the cost model's errors; results/auto.{json,md}; the docs page's section."""
    rows, verdicts, errors = summarise(raw)
    done = {(r["place"], r["workload"], r["config"]) for r in rows}
    unfinished = {}
    for r in raw:  # a config with no finished run at a place: why (its first failure)
        key = (r["place"], r["workload"], r["config"])
        if "error" in r and key not in done and key not in unfinished:
            unfinished[key] = {"place": key[0], "workload": key[1], "config": key[2],
                               "error": r["error"].strip().splitlines()[-1][:120]}
    table = markdown(rows, verdicts, meta, errors, list(unfinished.values()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "auto.json").write_text(json.dumps({"meta": meta, "summary": rows, "verdicts": verdicts,
                                                   "prediction_errors": errors, "runs": raw}, indent=2))
    (RESULTS / "auto.md").write_text(table + "\n")
    plot(rows, RESULTS / "auto.png")
    print(table)
    print(f"\nwrote {RESULTS / 'auto.json'}, auto.md and auto.png")
    if not args.quick and not args.no_docs:
        update_docs("bench-auto", table)


def plot(rows: list, path: Path) -> None:
    """ms/step (DLRM workloads) per place, one bar per config, auto first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r["ms_per_step"]]
    if not timed:
        return
    groups = sorted({(r["workload"], r["place"]) for r in timed})
    configs = sorted({r["config"] for r in timed}, key=lambda c: (c != "auto", c))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        values = [next((r["ms_per_step"] for r in timed if (r["workload"], r["place"]) == g and r["config"] == config),
                       0.0) for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label="auto (default)" if config == "auto"
               else config)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))])
    ax.set_xticklabels([f"{w}\n{p}" for w, p in groups], fontsize=8)
    ax.set_yscale("log")  # all-dense is 100x the rest at 2+ ranks: on a linear axis the others vanish
    ax.set_ylabel("ms per step (median, log scale, lower is better)")
    ax.set_title("sync: auto (default) against each route fixed in YAML")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
