"""Dynamic tables under a hashed Zipf id stream: step time against a fixed-size PS table at the
same rows touched per step, memory per stored row, and the table's growth and evictions over
time.

    python benchmarks/dynamic.py            # launches itself on 2 ranks; table, JSON, PNG in results/
    python benchmarks/dynamic.py --quick    # fewer, smaller steps
    python benchmarks/dynamic.py --rerender # redraw the plot from results/dynamic.json
    mpirun -np 2 python benchmarks/dynamic.py --rank-run [options]   # one run, printing JSON

The stream: every rank draws `--batch` Zipf(a) ranks per step from a truncated power law over
[1, 2^30], hashes each (splitmix64) into a raw int64 id and runs a training step's PS calls on
it: the pull of its rows and the push of their gradients (dim `--dim`, server Adagrad, so every
row carries one optimizer slot). Most ids are rare, so the table grows until it holds its
capacity, then evicts (LRU) every step.

Step time: once the dynamic table is full, steps alternate between it and a fixed-size table of
`capacity` rows fed the same Zipf ranks modulo its row count -- the same rows touched per step,
give or take collisions. `--repeats` blocks of `--timed` alternating steps each give one ratio
(median dynamic / median fixed, median over ranks) per block; the report is their median
(target: dynamic <= 1.25x fixed).

Memory per stored row: the growth of each rank's resident memory from before the dynamic table
existed, over the rows it stores (target: <= payload + optimizer slots + 32 bytes), next to the
engine's own accounting. Measured at the peak -- after the last step before the shard's
first batch eviction, when it holds nearly all of its share --, as the growth per row added
between a quarter of the peak and the peak (what a row costs, without the buffers every step
needs whatever the table holds), and at the end of the filling phase, where the shard
holds 7/8 to all of its share while its arena keeps the pages of the whole share.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
UNIVERSE_BITS = 30  # Zipf ranks drawn from [1, 2^30]: tens of millions of distinct ids
INITIALIZERS = {"normal": ("normal", 0.0, 0.01), "uniform": ("uniform", -0.01, 0.01)}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _zipf_ranks(rng, n: int, a: float) -> np.ndarray:
    """n draws of a power law P(r) ~ r^-a truncated to [1, 2^UNIVERSE_BITS] (inverse CDF)."""
    top = float(1 << UNIVERSE_BITS)
    u = rng.random(n)
    r = ((top ** (1 - a) - 1) * u + 1) ** (1 / (1 - a))
    return np.minimum(r.astype(np.int64), (1 << UNIVERSE_BITS) - 1)


def _hashed(ranks: np.ndarray) -> np.ndarray:
    from hybridsync.ps.dynamic_options import mix64

    return mix64(ranks.astype(np.uint64)).view(np.int64)


def rank_run(args) -> None:
    import hybridsync
    from hybridsync.ps import dynamic_options as dyn
    from hybridsync import runtime
    from hybridsync.ps.dynamic import DynamicTable
    from hybridsync.ps.table import PSTable, push

    hybridsync.init()
    world = runtime.world()
    rank, size = world.rank, world.size
    comm = runtime.mpi_comm()
    rule = {"name": "adagrad", "lr": 0.05}
    rng = np.random.default_rng(1000 + rank)
    seen = np.zeros(1 << (UNIVERSE_BITS - 3), np.uint8)  # a bit per Zipf rank: this rank's distinct ones
    seen[:] = 0  # resident now, so it does not count as the table's memory below

    def mark(ranks):
        np.bitwise_or.at(seen, ranks >> 3, (1 << (ranks & 7)).astype(np.uint8))
    grads = np.full((args.batch, args.dim), 0.01, np.float32)

    def step(table, ids):
        t0 = time.perf_counter()
        table.lookup(ids)
        push([table], [ids], [grads[:len(ids)]], 1.0 / size, [rule["lr"]], False)
        return time.perf_counter() - t0

    # The fixed table, warmed up first: buffers every step needs are resident before rss0.
    fixed = PSTable("fixed", args.capacity, args.dim, rule=rule)
    fixed.initialize(("normal", 0.0, 1.0), 1)
    for _ in range(3):
        step(fixed, _zipf_ranks(rng, args.batch, args.a) % args.capacity)

    # Phase 1: the dynamic table fills up, then evicts.
    rss0 = _rss()
    options = dyn.options("stream", capacity=args.capacity, evict="lru", seed=1, initializer=INITIALIZERS[args.init])
    table = DynamicTable("stream", args.dim, options, rule=rule)
    timeline, peak, before = [], None, None
    for s in range(args.steps):
        ranks = _zipf_ranks(rng, args.batch, args.a)
        mark(ranks)
        step(table, _hashed(ranks))
        st = table.stats()
        if peak is None and st["evicted"] > 0:  # the step before held the most rows, none evicted yet
            peak = before
        before = {"step": s + 1, "stored": st["stored"], "rss": _rss(),
                  "engine_bytes": st["map_bytes"] + st["row_bytes"]}
        if s % args.every == 0 or s == args.steps - 1:
            timeline.append({"step": s + 1, "stored": st["stored"], "admitted": st["admitted"],
                             "evicted": st["evicted"], "rss": _rss()})
    # Memory at the end of the filling phase: the table at capacity, evicting every step.
    table.engine.barrier("measure")
    accounting = table.stats()
    full_rss, full_stored = _rss(), accounting["stored"]

    # Phase 2: steady state, alternating with the fixed table at the same rows per step.
    dyn_times, fixed_times, dyn_unique, fixed_unique = [], [], [], []
    for s in range(args.timed * args.repeats):
        ranks = _zipf_ranks(rng, args.batch, args.a)
        mark(ranks)
        ids_dyn, ids_fixed = _hashed(ranks), ranks % args.capacity
        dyn_unique.append(len(np.unique(ids_dyn)))
        fixed_unique.append(len(np.unique(ids_fixed)))
        pair = [(table, ids_dyn, dyn_times), (fixed, ids_fixed, fixed_times)]
        for t, ids, out in pair if s % 2 == 0 else pair[::-1]:  # neither always goes first
            out.append(step(t, ids))
    distinct = np.zeros_like(seen) if rank == 0 else None
    from mpi4py import MPI

    comm.Reduce(seen, distinct, op=MPI.BOR, root=0)
    bits = np.array([bin(b).count("1") for b in range(256)], np.uint8)
    final = table.stats()
    payload = 4 * args.dim * (1 + len(table.slot_names))
    result = {
        "rank": rank, "timeline": timeline, "dyn_ms": [1e3 * t for t in dyn_times],
        "fixed_ms": [1e3 * t for t in fixed_times], "dyn_unique": dyn_unique, "fixed_unique": fixed_unique,
        "rss_bytes_per_row": (full_rss - rss0) / max(full_stored, 1), "stored_at_measure": full_stored,
        "peak": peak, "rss_bytes_per_row_peak": (peak["rss"] - rss0) / peak["stored"] if peak else None,
        "engine_bytes_per_row_peak": peak["engine_bytes"] / peak["stored"] if peak else None,
        "engine_bytes_per_row": (accounting["map_bytes"] + accounting["row_bytes"]) / max(accounting["stored"], 1),
        "payload_plus_slots": payload, "final": final,
        "distinct_ids": int(bits[distinct].sum(dtype=np.int64)) if rank == 0 else None,
        "ids_drawn": size * args.batch * (args.steps + args.timed * args.repeats),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)  # (one file per rank: long lines from two
    (Path(args.out) / f"rank-{rank}.json").write_text(json.dumps(result))  # ranks interleave on stdout)
    hybridsync.shutdown()


def _launch(args) -> list:
    import tempfile

    out_dir = tempfile.mkdtemp(prefix="hybridsync-dynamic-")
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, "-u", __file__, "--rank-run", "--steps", str(args.steps), "--timed", str(args.timed), "--repeats", str(args.repeats),
            "--batch", str(args.batch), "--dim", str(args.dim), "--capacity", str(args.capacity), "--a", str(args.a),
            "--every", str(args.every), "--init", args.init, "--out", out_dir]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    files = sorted(Path(out_dir).glob("rank-*.json"))
    results = [json.loads(f.read_text()) for f in files]
    if out.returncode != 0 or len(results) != 2:
        raise SystemExit(f"benchmark run failed (exit {out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return sorted(results, key=lambda r: r["rank"])


def _report(args, results) -> dict:
    med = lambda xs: float(np.median(xs))  # noqa: E731
    n = args.timed

    def block(key, b):  # median over ranks of each rank's median in block b
        return med([med(r[key][b * n:(b + 1) * n]) for r in results])

    def marginal(r):  # RSS per row added while filling, from a quarter of the peak to the peak
        peak = r["peak"]
        if not peak:
            return None
        start = next(p for p in r["timeline"] if p["stored"] >= peak["stored"] / 4)
        return (peak["rss"] - start["rss"]) / max(peak["stored"] - start["stored"], 1)

    ratios = [block("dyn_ms", b) / block("fixed_ms", b) for b in range(args.repeats)]
    dyn_ms = med([med(r["dyn_ms"]) for r in results])
    fixed_ms = med([med(r["fixed_ms"]) for r in results])
    summary = {
        "ranks": 2, "batch_per_rank": args.batch, "dim": args.dim, "capacity": args.capacity, "zipf_a": args.a,
        "universe_bits": UNIVERSE_BITS, "steps_filling": args.steps, "steps_timed_per_repeat": n,
        "repeats": args.repeats, "ids_drawn": results[0]["ids_drawn"], "distinct_ids": results[0]["distinct_ids"],
        "unique_rows_per_step_dynamic": med([med(r["dyn_unique"]) for r in results]),
        "unique_rows_per_step_fixed": med([med(r["fixed_unique"]) for r in results]),
        "step_ms_dynamic": dyn_ms, "step_ms_fixed": fixed_ms, "ratios": ratios, "ratio": med(ratios),
        "ratio_target": 1.25,
        "rss_bytes_per_row_peak": [r["rss_bytes_per_row_peak"] for r in results],
        "rss_bytes_per_added_row": [marginal(r) for r in results],
        "engine_bytes_per_row_peak": [r["engine_bytes_per_row_peak"] for r in results],
        "rss_bytes_per_row": [r["rss_bytes_per_row"] for r in results],
        "engine_bytes_per_row": [r["engine_bytes_per_row"] for r in results],
        "payload_plus_slots": results[0]["payload_plus_slots"],
        "bytes_per_row_target": results[0]["payload_plus_slots"] + 32,
        "stored_final": sum(r["final"]["stored"] for r in results),
        "evicted_final": sum(r["final"]["evicted"] for r in results),
    }
    show = lambda xs: ", ".join("-" if b is None else f"{b:.0f} B" for b in xs)  # noqa: E731
    lines = [
        f"dynamic tables, 2 ranks, {args.batch} ids per rank per step, dim {args.dim}, server Adagrad, "
        f"capacity {args.capacity} (LRU), Zipf a={args.a} over 2^{UNIVERSE_BITS} hashed",
        f"ids drawn: {summary['ids_drawn']:,}; distinct: {summary['distinct_ids']:,}",
        f"unique rows per step and rank: dynamic {summary['unique_rows_per_step_dynamic']:.0f}, "
        f"fixed {summary['unique_rows_per_step_fixed']:.0f}",
        f"step time at capacity, {args.repeats} repeats of {n} alternating steps: dynamic {dyn_ms:.2f} ms, "
        f"fixed {fixed_ms:.2f} ms (medians); ratio per repeat " + ", ".join(f"{x:.2f}" for x in ratios) +
        f"; median ratio {summary['ratio']:.2f} (target <= 1.25)",
        f"memory per stored row (payload + slots {summary['payload_plus_slots']} B, target <= "
        f"{summary['bytes_per_row_target']} B):",
        f"  shard full (the step before its first eviction): RSS growth "
        f"{show(summary['rss_bytes_per_row_peak'])}; engine accounting {show(summary['engine_bytes_per_row_peak'])}",
        f"  while filling (RSS per row added, from a quarter of the peak to the peak): "
        f"{show(summary['rss_bytes_per_added_row'])}",
        f"  end of filling (7/8 to all of the share stored, pages of the whole share kept): RSS growth "
        f"{show(summary['rss_bytes_per_row'])}; engine accounting {show(summary['engine_bytes_per_row'])}",
        f"end: {summary['stored_final']:,} rows stored, {summary['evicted_final']:,} evicted",
    ]
    print("\n".join(lines))
    return summary, lines


def _plot(results, path, repeats, ratio) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p["step"] for p in results[0]["timeline"]]
    total = lambda key: np.array([sum(r["timeline"][i][key] for r in results) for i in range(len(steps))])  # noqa: E731
    per_step = lambda key: np.diff(total(key), prepend=0) / np.diff(steps, prepend=0)  # noqa: E731
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot(steps, total("stored") / 1e6)
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("million rows, both ranks")
    ax[0].set_title("rows stored (LRU: batch eviction to 7/8 of a share)")
    ax[1].plot(steps, per_step("admitted") / 1e3, label="admitted", lw=0.7)
    ax[1].plot(steps, per_step("evicted") / 1e3, label="evicted", lw=0.7, alpha=0.7)
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("thousand rows per step, both ranks")
    ax[1].set_title("admissions and evictions")
    ax[1].legend()
    dyn = np.median([r["dyn_ms"] for r in results], axis=0)
    fixed = np.median([r["fixed_ms"] for r in results], axis=0)
    top = np.percentile(np.concatenate([dyn, fixed]), 98) * 1.2
    ax[2].plot(dyn, label="dynamic", lw=0.8)
    ax[2].plot(fixed, label="fixed", lw=0.8)
    n = len(dyn) // max(repeats, 1)
    for b in range(1, repeats):
        ax[2].axvline(b * n, color="grey", lw=0.5)
    ax[2].set_ylim(0, top)
    ax[2].set_xlabel(f"alternating step at capacity ({repeats} repeats)")
    ax[2].set_ylabel("ms (median over ranks)")
    ax[2].set_title(f"step time side by side (median ratio {ratio:.2f})")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank-run", action="store_true")
    p.add_argument("--rerender", action="store_true", help="redraw the plot from results/dynamic.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=900, help="steps filling the table")
    p.add_argument("--timed", type=int, default=30, help="alternating steps timed at capacity, per repeat")
    p.add_argument("--repeats", type=int, default=5, help="blocks of timed steps, one ratio each")
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--capacity", type=int, default=2_000_000)
    p.add_argument("--a", type=float, default=1.05)
    p.add_argument("--every", type=int, default=1, help="steps between timeline samples (1: no aliasing of the eviction sawtooth)")
    p.add_argument("--out", default="", help="(rank runs) where each rank writes its result")
    p.add_argument("--init", choices=sorted(INITIALIZERS), default="normal", help="the dynamic rows' initializer")
    args = p.parse_args()
    if args.quick:
        args.steps, args.timed, args.repeats, args.batch, args.capacity = 40, 10, 3, 16384, 200_000
    if args.rank_run:
        rank_run(args)
        return
    if args.rerender:
        saved = json.loads((RESULTS / "dynamic.json").read_text())
        _plot(saved["ranks"], RESULTS / "dynamic.png", saved["summary"]["repeats"], saved["summary"]["ratio"])
        return
    results = _launch(args)
    summary, lines = _report(args, results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dynamic.json").write_text(json.dumps({"summary": summary, "ranks": results}, indent=1))
    (RESULTS / "dynamic.md").write_text("```\n" + "\n".join(lines) + "\n```\n")
    _plot(results, RESULTS / "dynamic.png", args.repeats, summary["ratio"])
    print(f"wrote {RESULTS / 'dynamic.json'}, dynamic.md, dynamic.png")


if __name__ == "__main__":
    main()
