"""The parameter server's kernels against the memory bandwidth of one core.

Builds and runs benchmarks/cpp/ps_kernels_bench.cc (cmake target hybridsync_ps_kernels_bench, in
build/kernels-bench): one shard's pull (gather) and push (duplicate ids summed, then SGD / Adagrad
/ Adam) and a dynamic shard's lookup, on Zipf(1.2) and uniform ids, in GB/s of the table rows they
touch, next to STREAM copy and triad measured in the same run on the same pinned core.

    python benchmarks/kernels.py                 # full size: 2M x 32 and 500k x 128 tables
    python benchmarks/kernels.py --quick         # small tables, few rounds (writes kernels-quick.*)
    python benchmarks/kernels.py --cachegrind    # also: instructions and cache misses per row of
                                                 # each kernel, simulated (valgrind; load-independent)
    python benchmarks/kernels.py --cachegrind-only --tables 1000000x32,250000x128
                                                 # the counts alone, no timed run (any load):
                                                 # writes results/kernels-cachegrind.{json,md}

Goals (issue 39): pull and push at >= 0.5x triad for 32-float rows and >= 0.7x for 128-float rows
(Zipf ids, row bytes). Writes benchmarks/results/kernels.{json,md,png} and updates docs/performance.md
between <!-- bench-kernels:start --> and <!-- bench-kernels:end -->.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench import RESULTS, ROOT, load_average, results_image, update_docs  # noqa: E402

BUILD = ROOT / "build" / "kernels-bench"
TARGET = "hybridsync_ps_kernels_bench"
GOALS = {32: 0.5, 128: 0.7}  # fraction of triad, by row width in floats
FULL_TABLES = "2000000x32,500000x128"


def build() -> Path:
    """The benchmark binary, configured and built on first use (later runs recompile what changed)."""
    if not shutil.which("cmake"):
        sys.exit("kernels.py: cmake is not installed (it builds benchmarks/cpp/ps_kernels_bench.cc)")
    BUILD.mkdir(parents=True, exist_ok=True)
    steps = [] if (BUILD / "CMakeCache.txt").exists() else [
        ["cmake", str(ROOT), "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"]]
    steps.append(["cmake", "--build", ".", "--target", TARGET, "-j", str(min(os.cpu_count() or 2, 4))])
    for cmd in steps:
        done = subprocess.run(cmd, cwd=BUILD, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"kernels.py: {' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return BUILD / TARGET


def measure(binary: Path, args) -> dict:
    """One run of the benchmark (its own table printed as it goes); its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kernels.json"
        cmd = [str(binary), "--json", str(out), "--cpu", str(args.cpu)]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--tables", args.tables] if args.tables else []
        cmd += [flag for flag, on in (("--no-dynamic", args.no_dynamic),) if on]
        for flag in ("batch", "rounds", "repeats"):
            if getattr(args, flag):
                cmd += [f"--{flag}", str(getattr(args, flag))]
        done = subprocess.run(cmd)
        if done.returncode != 0:
            sys.exit(f"kernels.py: {' '.join(cmd)} exited with {done.returncode}")
        return json.loads(out.read_text())


def summarise(run: dict) -> list[dict]:
    """Each kernel's row GB/s as a fraction of the run's triad and copy, and its goal."""
    triad, copy = run["stream"]["triad_gbps"], run["stream"]["copy_gbps"]
    rows = []
    for k in run["kernels"]:
        row = dict(k, vs_triad=k["row_gbps"] / triad, vs_copy=k["row_gbps"] / copy,
                   slots_vs_triad=k["row_slot_gbps"] / triad)
        goal = GOALS.get(k["dim"])
        if goal and k["dist"] == "zipf" and k["kernel"] in ("pull", "push"):
            row["goal"] = goal
            row["met"] = row["vs_triad"] >= goal
        rows.append(row)
    return rows


def markdown(run: dict, rows: list[dict], meta: dict) -> str:
    s = run["stream"]
    lines = [
        f"Measured {meta['date']} on CPU {run['cpu']} (pinned), load average {' / '.join(map(str, meta['loadavg']))} "
        f"before the run; THP `{run['thp']}`; requests of {run['batch']:,} ids, {run['rounds']} per pass, medians "
        f"of {run['repeats']} passes. STREAM on {s['array_bytes'] >> 20} MiB arrays: copy {s['copy_gbps']:.2f} GB/s "
        f"(best {s['copy_best_gbps']:.2f}), triad {s['triad_gbps']:.2f} GB/s (best {s['triad_best_gbps']:.2f}). "
        "Row GB/s: distinct rows touched x row bytes / time (each row once, read or read+written); "
        "+slots: with the optimizer's slot rows; all: also the other row buffers the kernel streams through, each "
        "once (a pull's output rows; a push's raw gradient rows, one per id, and its summed rows). "
        "Goal: pull and push (Zipf) >= 0.5x triad at 32 floats, >= 0.7x at 128."
        + (" SMOKE RUN: small tables, few rounds." if meta.get("quick") else ""),
        "",
        "| kernel | ids | rule | table | rows/request | us/request | ns/row | row GB/s | +slots GB/s | all GB/s "
        "| x triad | goal |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        goal = (f"{'met' if r['met'] else 'MISSED'} (>= {r['goal']}x)" if "goal" in r else "")
        lines.append(
            f"| {r['kernel']} | {r['dist']} | {r['rule'] or '-'} | {r['rows']:,} x {r['dim']} | "
            f"{r['unique_per_request']:,.0f} | {r['us_per_request']:.1f} | {r['ns_per_row']:.1f} | {r['row_gbps']:.2f} | "
            f"{r['row_slot_gbps']:.2f} | {r.get('all_gbps', float('nan')):.2f} | {r['vs_triad']:.2f} | {goal} |")
    return "\n".join(lines)


# -- cachegrind: per-row instruction and cache-miss counts, simulated ------------------------------

# (kernel, rule, bench flags): "push sgd +stats" is the push of an adaptive job, whose shards also
# compute the noise scale's squared norms.
CACHEGRIND_KERNELS = [("pull", None, []), ("pull+dedup", None, []), ("push", "sgd", []), ("push", "adagrad", []),
                      ("push", "adam", []), ("push", "sgd", ["--statistics"]), ("dyn", None, [])]


def per_function(text: str) -> dict[str, dict[str, int]]:
    """{function: {event: count}} from a cachegrind output file."""
    events = re.search(r"^events: (.*)$", text, re.M).group(1).split()
    out, current = {}, None
    for line in text.splitlines():
        if line.startswith("fn="):
            current = out.setdefault(line[3:], dict.fromkeys(events, 0))
        elif current is not None and line[:1].isdigit():
            for event, value in zip(events, line.split()[1:]):
                current[event] += int(value)
    return out


def short_name(function: str) -> str:
    """'hybridsync::RowAggregator::add(hybridsync::GradientRows const&)' -> 'RowAggregator::add'."""
    name = function.split(":", 1)[1] if function.startswith("???:") else function
    name = name.replace("hybridsync::", "").replace("(anonymous namespace)::", "")
    return re.sub(r"\(.*$", "", name).rsplit("/", 1)[-1].rsplit(":", 1)[-1] if ".S:" in name or ".c:" in name \
        else re.sub(r"\(.*$", "", name)


def cachegrind_totals(binary: Path, kernel: str, rule: str | None, table: str, dist: str, repeats: int,
                      rounds: int, batch: int, llc: int, flags: list) -> tuple[dict, dict, float]:
    """Whole-program and per-function event counts of one kernel alone, `repeats` passes; and
    its rows per request."""
    with tempfile.TemporaryDirectory() as tmp:
        out, js = Path(tmp) / "cg.out", Path(tmp) / "k.json"
        cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--LL={llc},16,64",
               f"--cachegrind-out-file={out}", str(binary), "--only", kernel, "--tables", table, "--dists", dist,
               "--repeats", str(repeats), "--draw-passes", "3", "--rounds", str(rounds), "--batch", str(batch),
               "--json", str(js)]
        if rule:
            cmd += ["--rules", rule]
        cmd += flags
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"kernels.py: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        text = out.read_text()
        events = re.search(r"^events: (.*)$", text, re.M).group(1).split()
        totals = [int(x) for x in re.search(r"^summary: (.*)$", text, re.M).group(1).split()]
        unique = json.loads(js.read_text())["kernels"][0]["unique_per_request"]
        return dict(zip(events, totals)), per_function(text), unique


def cachegrind(binary: Path, args, llc: int) -> list[dict]:
    """Per distinct row: instructions, D1 and last-level misses of each kernel. Two runs per kernel,
    1 and 3 passes, each drawing the requests of 3 passes: their difference is 2 passes of the
    kernel alone (the same setup cancels), each on ids of its own. Cachegrind
    simulates caches without hardware prefetchers and ignores prefetch instructions, so its misses
    are the demand misses the kernel's access pattern makes (a cold row costs at least row bytes / 64).
    The simulated last level is this machine's (`llc` bytes, 16-way)."""
    if not shutil.which("valgrind"):
        sys.exit("kernels.py --cachegrind: valgrind is not installed")
    tables = args.tables or (FULL_TABLES if not args.quick else "200000x32,50000x128")
    rows = []
    for table in tables.split(","):
        dim = int(table.split("x")[1])
        for kernel, rule, flags in CACHEGRIND_KERNELS:
            name = (kernel if not rule else f"push {rule}") + (" +stats" if "--statistics" in flags else "")
            print(f"cachegrind: {name} on {table} (zipf) ...", flush=True)
            one, one_fn, unique = cachegrind_totals(binary, kernel, rule, table, "zipf", 1, args.cg_rounds,
                                                    args.cg_batch, llc, flags)
            three, three_fn, _ = cachegrind_totals(binary, kernel, rule, table, "zipf", 3, args.cg_rounds,
                                                   args.cg_batch, llc, flags)
            per_row = 2 * args.cg_rounds * unique * (2 if kernel == "dyn" else 1)  # dyn: lookup and pull
            diff = {e: (three[e] - one[e]) / per_row for e in three}
            functions = []  # where the instructions and misses of the kernel's passes go
            for fn, counts in three_fn.items():
                base = one_fn.get(fn, {})
                d = {e: (counts[e] - base.get(e, 0)) / per_row for e in counts}
                if d["Ir"] >= 0.02 * diff["Ir"]:
                    functions.append({"function": short_name(fn), "ir_per_row": d["Ir"],
                                      "d1_misses_per_row": d.get("D1mr", 0) + d.get("D1mw", 0),
                                      "ll_misses_per_row": d.get("DLmr", 0) + d.get("DLmw", 0)})
            functions.sort(key=lambda f: -f["ir_per_row"])
            rows.append({"kernel": name, "table": table, "dim": dim, "rows_per_request": unique,
                         "lines_per_row": dim * 4 / 64,
                         "ir_per_row": diff["Ir"],
                         "d1_misses_per_row": diff.get("D1mr", 0) + diff.get("D1mw", 0),
                         "ll_misses_per_row": diff.get("DLmr", 0) + diff.get("DLmw", 0),
                         "ll_read_misses_per_row": diff.get("DLmr", 0),
                         "functions": functions})
    return rows


def cachegrind_markdown(rows: list[dict], args) -> str:
    lines = ["", f"Cachegrind (simulated caches, no hardware prefetch; Zipf ids, requests of {args.cg_batch:,}, "
             f"{args.cg_rounds} per pass; the difference of 3 and 1 passes, per distinct row; a row of d floats is "
             "d/16 cache lines, the fewest misses a cold row can cost; 'dyn' is a lookup and a pull, per row each):", "",
             "| kernel | table | instructions/row | D1 misses/row | LL misses/row (reads) | lines/row | "
             "instructions/row by function |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        where = ", ".join(f"{f['function']} {f['ir_per_row']:.0f}" for f in r["functions"][:4])
        lines.append(f"| {r['kernel']} | {r['table']} | {r['ir_per_row']:.0f} | {r['d1_misses_per_row']:.2f} | "
                     f"{r['ll_misses_per_row']:.2f} ({r['ll_read_misses_per_row']:.2f}) | {r['lines_per_row']:.0f} | "
                     f"{where} |")
    return "\n".join(lines)


def plot(rows: list[dict], run: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["dim"] for r in rows})
    fig, axes = plt.subplots(1, len(dims), figsize=(7 * len(dims), 4.5), squeeze=False)
    for ax, dim in zip(axes[0], dims):
        mine = [r for r in rows if r["dim"] == dim and not r["kernel"].startswith("push:")]
        labels = sorted({(r["kernel"], r["rule"]) for r in mine}, key=lambda kr: [x["kernel"] for x in mine].index(kr[0]))
        for i, dist in enumerate(("zipf", "uniform")):
            values = [next((r["row_gbps"] for r in mine if (r["kernel"], r["rule"]) == kr and r["dist"] == dist), 0)
                      for kr in labels]
            ax.bar([j + 0.4 * i for j in range(len(labels))], values, 0.4, label=f"{dist} ids")
        ax.axhline(run["stream"]["triad_gbps"], color="black", ls="--", label="STREAM triad")
        ax.axhline(run["stream"]["copy_gbps"], color="gray", ls=":", label="STREAM copy")
        if dim in GOALS:
            ax.axhline(GOALS[dim] * run["stream"]["triad_gbps"], color="red", ls="-.", label=f"goal {GOALS[dim]}x triad")
        ax.set_xticks([j + 0.2 for j in range(len(labels))], [f"{k} {r}".strip() for k, r in labels], rotation=30,
                      ha="right", fontsize=8)
        table = next(r for r in mine)
        ax.set(title=f"{table['rows']:,} x {dim} floats", ylabel="GB/s of row bytes (higher is better)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def last_level_cache_bytes() -> int:
    """This machine's largest cache, as the benchmark reads it (the simulated last level)."""
    largest = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
        largest = max(largest, int(size.rstrip("KM")) * scale)
    return largest or 32 << 20


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small tables, few rounds: a smoke run (kernels-quick.*)")
    p.add_argument("--cpu", type=int, default=0, help="the core to pin to (default 0)")
    p.add_argument("--tables", default=None, help=f"ROWSxDIM,... (default {FULL_TABLES})")
    p.add_argument("--batch", type=int, default=None, help="ids per request (default 16384)")
    p.add_argument("--rounds", type=int, default=None, help="requests per timed pass (default 64)")
    p.add_argument("--repeats", type=int, default=None, help="passes; medians are reported (default 7)")
    p.add_argument("--no-dynamic", action="store_true", help="leave out the dynamic table's lookup")
    p.add_argument("--cachegrind", action="store_true",
                   help="also count instructions and cache misses per row under valgrind (slow, load-independent)")
    p.add_argument("--cachegrind-only", action="store_true",
                   help="only the cachegrind counts (no timed run: any load will do); writes "
                        "results/<name>.{json,md} (default name kernels-cachegrind)")
    p.add_argument("--cg-rounds", type=int, default=8, help="cachegrind: requests per pass")
    p.add_argument("--cg-batch", type=int, default=16384, help="cachegrind: ids per request")
    p.add_argument("--name", default=None, help="results/<name>.{json,md,png} (default kernels; --quick: kernels-quick)")
    p.add_argument("--no-docs", action="store_true", help="leave docs/performance.md as it is")
    args = p.parse_args()
    if args.cachegrind_only:
        args.name = args.name or "kernels-cachegrind"
        binary = build()
        cg = cachegrind(binary, args, last_level_cache_bytes())
        table = cachegrind_markdown(cg, args).lstrip("\n")
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(cg, indent=2))
        (RESULTS / f"{args.name}.md").write_text(table + "\n")
        print("\n" + table + f"\n\nwrote {RESULTS / args.name}.json, .md")
        return
    args.name = args.name or ("kernels-quick" if args.quick else "kernels")
    binary = build()
    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "loadavg": load_average(),
            "quick": args.quick}
    run = measure(binary, args)
    rows = summarise(run)
    table = markdown(run, rows, meta)
    cg = cachegrind(binary, args, run["llc_bytes"]) if args.cachegrind else None
    if cg:
        table += "\n" + cachegrind_markdown(cg, args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"meta": meta, "run": run, "summary": rows,
                                                          "cachegrind": cg}, indent=2))
    (RESULTS / f"{args.name}.md").write_text(table + "\n")
    plot(rows, run, RESULTS / f"{args.name}.png")
    print("\n" + table)
    print(f"\nwrote {RESULTS / args.name}.json, .md, .png")
    if not args.no_docs and not args.quick and args.name == "kernels":
        update_docs("bench-kernels", table + "\n\n" + results_image("PS kernels vs STREAM", "kernels.png"))


if __name__ == "__main__":
    main()
