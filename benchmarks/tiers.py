"""Tables larger than memory (docs/storage.md): a disk tier under a dynamic table's id stream, a
fixed table larger than this machine's RAM, and 16-bit rows on the flagship workload.

    python benchmarks/tiers.py                  # every part; table, JSON, PNG in results/tiers.*
    python benchmarks/tiers.py --parts a,c      # some parts (the others keep their saved results)
    python benchmarks/tiers.py --quick          # tiny sizes, about a minute (results/tiers-quick.*)
    mpirun -np 2 python benchmarks/tiers.py --rank-run a|b [options]   # one part's ranks, JSON per rank

(a) The dynamic benchmark's stream (benchmarks/dynamic.py: per rank and step `--batch` Zipf(1.05)
    ranks over [1, 2^30], hashed into raw int64 ids; >= 25M distinct ids over the run) through two
    DynamicEmbedding tables at 2 ranks, fed the same ids each step in alternating order: one with
    memory for `--memory-rows` rows (cluster-wide) and an unbounded disk tier, one all in memory
    with unbounded capacity. Each step is a training step's PS calls: the pull of its rows and the
    push of their gradients (server Adagrad). Measures: rows stored against the distinct ids seen
    (no ttl_steps: they must be equal -- no row lost), a sample of ids (three steps' batches, hot
    and rare) whose rows and Adagrad slots must equal the all-in-memory table's bit for bit, and
    the step time of the tiered table over the all-in-memory one on the same stream: per block of
    steps at the end of the run (the most rows on disk), the median ratio (median over ranks), and
    the median over `--repeats` blocks (target <= 1.5x). Also the tier's rows, hit rate, bytes read
    and written, its file's disk use (allocated blocks) and each rank's peak RSS.
(b) A fixed table of `--ram-factor` x this machine's RAM of float32 rows (dim 32) -- e.g. 36 GiB on
    23 GiB -- as one hybridsync.torch.Embedding with a disk tier of `--big-memory-rows` rows in
    memory, in a small CTR model (13 dense features, 8 ids per sample from the table: hashed
    Zipf(1.05) ranks mod the rows, labels from a seeded teacher) trained with Adagrad at 2 ranks,
    batch 512 per rank. Measures samples/s over the timed steps, every rank's peak RSS
    (ru_maxrss; target <= 4 GiB), the disk the tier files actually use (untouched rows cost none:
    their values are a function of (seed, id)) and the training loss's fall. Then a checkpoint of
    the table (only its written rows, streamed) and its load into a new model: time, size, the
    peak RSS after both, and 1000 rows probed equal.
(c) 16-bit rows against float32 on the flagship workload (benchmarks/run_one.py's DLRM: 8 tables
    x 250k rows x 32, batch 512 per rank, SGD, system hybridsync-sharded) at 2 ranks: float32,
    float16, bfloat16 (nearest) and bfloat16 with stochastic rounding, `--rounds` interleaved
    rounds, medians: bytes per row on the shards, PS bytes sent per rank and step, step time, and
    the loss on held-out batches after a fixed number of steps.

The load average is printed before each part and kept in the JSON. The full run takes about 15
minutes on an idle 2-core machine (a: ~5, b: ~3, c: ~5).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

try:  # run as a script: its directory is first on sys.path
    import bench
    from dynamic import UNIVERSE_BITS, _hashed, _zipf_ranks
except ImportError:  # imported as benchmarks.tiers
    from benchmarks import bench
    from benchmarks.dynamic import UNIVERSE_BITS, _hashed, _zipf_ranks

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GIB = 2**30
RSS_TARGET = 4 * GIB
RATIO_TARGET = 1.5
DTYPES = [("float32", "nearest"), ("float16", "nearest"), ("bfloat16", "nearest"), ("bfloat16", "stochastic")]
BIG_DIM, BIG_FEATURES, BIG_BATCH, DENSE = 32, 8, 512, 13


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _disk_use(path: str) -> int:
    """Bytes a file takes on disk (allocated blocks, not its apparent size); 0 if gone."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


def _free_disk(path: Path) -> int:
    return shutil.disk_usage(path).free


def _ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("tiers.py: cannot read MemTotal from /proc/meminfo")


def _need_disk(where: Path, need: int, what: str) -> None:
    """Refuses to start a part whose tier files could outgrow the free disk."""
    free = _free_disk(where)
    if free < need:
        raise SystemExit(f"tiers.py: part {what} may write up to {need / GIB:.1f} GiB of tier files under {where}, "
                         f"which has {free / GIB:.1f} GiB free: free some space, pass --dir on a larger disk, or "
                         "use fewer steps")


# -- rank runs (under mpirun) ---------------------------------------------------------------------------
def _write_rank_result(args, result: dict) -> None:
    import hybridsync

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # (one file per rank: long lines of two ranks interleave on stdout)
    (out / f"rank-{hybridsync.rank()}.json").write_text(json.dumps(result))


def rank_stream(args) -> None:
    """Part (a) on this rank: the hashed Zipf stream through a tiered and an all-in-memory table."""
    import hybridsync
    from hybridsync.ps import dynamic_options as dyn
    from hybridsync.ps.dynamic import DynamicTable
    from hybridsync.ps.table import push
    from hybridsync import runtime

    hybridsync.init()
    rank, size = hybridsync.rank(), hybridsync.size()
    rule = {"name": "adagrad", "lr": 0.05}
    init = ("normal", 0.0, 0.01)
    tier_dir = f"{args.dir}/stream-rank{rank}"
    tiered = DynamicTable("tiered", args.dim, dyn.options("tiered", seed=1, initializer=init, disk_tier=True),
                          rule=rule, storage={"memory_rows": args.memory_rows, "path": tier_dir})
    memory = DynamicTable("memory", args.dim, dyn.options("memory", seed=1, initializer=init), rule=rule)
    grads = np.full((args.batch, args.dim), 0.01, np.float32)
    seen = np.zeros(1 << (UNIVERSE_BITS - 3), np.uint8)  # a bit per Zipf rank: this rank's distinct ones
    rng = np.random.default_rng(1000 + rank)
    sample_steps = {0, args.steps // 2, args.steps - 1}
    sample, times = [], {"tiered": [], "memory": []}
    timeline = []

    def step(table, ids):
        t0 = time.perf_counter()
        table.lookup(ids)
        push([table], [ids], [grads[:len(ids)]], 1.0 / size, [rule["lr"]], False)
        return time.perf_counter() - t0

    for s in tqdm(range(args.steps), desc="(a) stream steps", disable=rank != 0, mininterval=10, file=sys.stderr):
        ranks = _zipf_ranks(rng, args.batch, args.a)
        np.bitwise_or.at(seen, ranks >> 3, (1 << (ranks & 7)).astype(np.uint8))
        ids = _hashed(ranks)
        if s in sample_steps:
            sample.append(ids)
        pair = [("tiered", tiered), ("memory", memory)]
        for name, table in pair if s % 2 == 0 else pair[::-1]:  # neither always goes first
            times[name].append(step(table, ids))
        if s % args.every == 0 or s == args.steps - 1:
            t = tiered.engine.tier_stats(tiered.handle)
            timeline.append({"step": s + 1, "in_memory": t["memory_rows"], "on_disk": t["disk_rows"]})
    tiered.engine.barrier("stream-done")
    # The sample: every row and Adagrad slot of the tiered table equals the all-in-memory one's.
    ids = np.unique(np.concatenate(sample))
    mismatched_rows = int(np.count_nonzero((tiered.read_rows(ids) != memory.read_rows(ids)).any(axis=1)))
    mismatched_slots = int(np.count_nonzero((tiered.read_rows(ids, 0) != memory.read_rows(ids, 0)).any(axis=1)))
    distinct = np.zeros_like(seen) if rank == 0 else None
    from mpi4py import MPI

    runtime.mpi_comm().Reduce(seen, distinct, op=MPI.BOR, root=0)
    bits = np.array([bin(b).count("1") for b in range(256)], np.uint8)
    tier = tiered.engine.tier_stats(tiered.handle)
    _write_rank_result(args, {
        "rank": rank, "tiered_ms": [1e3 * t for t in times["tiered"]], "memory_ms": [1e3 * t for t in times["memory"]],
        "stored_tiered": tiered.stats()["stored"], "stored_memory": memory.stats()["stored"],
        "distinct_ids": int(bits[distinct].sum(dtype=np.int64)) if rank == 0 else None,
        "sample_ids": int(len(ids)), "mismatched_rows": mismatched_rows, "mismatched_slots": mismatched_slots,
        "tier": tier, "tier_file_disk_bytes": _disk_use(tier["path"]), "peak_rss": _peak_rss(),
        "timeline": timeline, "ids_drawn": size * args.batch * args.steps,
    })
    hybridsync.shutdown()


def _teacher_score(ids: np.ndarray) -> np.ndarray:
    """A seeded score in [-1, 1) per id, with no per-row array (the table is larger than RAM)."""
    from hybridsync.ps.dynamic_options import mix64

    with np.errstate(over="ignore"):
        bits = mix64(ids.astype(np.uint64) ^ np.uint64(0x5DEECE66D))
    return ((bits >> np.uint64(11)).astype(np.float64) / 2.0**52 - 1.0).astype(np.float32)


def rank_big(args) -> None:
    """Part (b) on this rank: a CTR model over one fixed table larger than RAM, with a disk tier."""
    import torch
    import torch.nn.functional as F

    import hybridsync
    import hybridsync.torch as hvd

    torch.set_num_threads(1)
    hybridsync.init()
    rank = hybridsync.rank()
    tier_dir = f"{args.dir}/big-rank{rank}"

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = hvd.Embedding(args.big_rows, BIG_DIM, name="big", seed=1, initializer=("uniform", -0.01, 0.01),
                                     storage={"memory_rows": args.big_memory_rows, "path": tier_dir})
            self.mlp = torch.nn.Sequential(torch.nn.Linear(DENSE + BIG_FEATURES * BIG_DIM, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, 1))

        def forward(self, dense, ids):
            rows = self.emb(ids.reshape(-1)).reshape(len(ids), BIG_FEATURES * BIG_DIM)
            return self.mlp(torch.cat([dense, rows], 1)).squeeze(1)

    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.05), model=model)
    built_rss = _peak_rss()
    rng = np.random.default_rng(100 + rank)
    weight = np.random.default_rng(7).standard_normal(DENSE).astype(np.float32) / np.sqrt(DENSE)

    def batch():
        dense = rng.standard_normal((BIG_BATCH, DENSE)).astype(np.float32)
        ranks = _zipf_ranks(rng, BIG_BATCH * BIG_FEATURES, args.a)
        ids = (_hashed(ranks).view(np.uint64) % np.uint64(args.big_rows)).astype(np.int64)
        ids = ids.reshape(BIG_BATCH, BIG_FEATURES)
        label = (dense @ weight + _teacher_score(ids).mean(1) * 3.0 > 0).astype(np.float32)
        return torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(label)

    losses = []
    total = args.big_warmup + args.big_steps
    start = None
    for s in tqdm(range(total), desc="(b) larger-than-RAM steps", disable=rank != 0, mininterval=10, file=sys.stderr):
        if s == args.big_warmup:
            model.emb.table.engine.barrier("big-timed")  # (every push so far applied)
            start = time.perf_counter()
        dense, ids, label = batch()
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, ids), label)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.emb.table.engine.barrier("big-done")
    elapsed = time.perf_counter() - start
    tier = model.emb.table.tier_stats()
    trained_rss = _peak_rss()
    # A checkpoint of the whole table (its written rows, streamed), and its load into a new model
    # built alike: the time each takes, and what they add to the peak RSS.
    checkpoint = f"{args.dir}/big-checkpoint"
    t0 = time.perf_counter()
    hybridsync.save_checkpoint(checkpoint, model, opt)
    save_s = time.perf_counter() - t0
    saved_rss = _peak_rss()
    checkpoint_bytes = sum(f.stat().st_size for f in Path(checkpoint).resolve().iterdir())
    probe = torch.tensor(np.random.default_rng(5).integers(0, args.big_rows, 1000))
    with torch.no_grad():
        before = model.emb(probe).numpy()
    model.emb.table.drop()  # (its tier file goes; the new model's takes its place)
    del model, opt
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.05), model=model)
    t0 = time.perf_counter()
    hybridsync.load_checkpoint(checkpoint, model, opt)
    load_s = time.perf_counter() - t0
    with torch.no_grad():
        loaded_equal = bool(np.array_equal(model.emb(probe).numpy(), before))
    _write_rank_result(args, {
        "rank": rank, "elapsed_s": elapsed, "peak_rss": trained_rss, "built_rss": built_rss, "tier": tier, "tier_file_disk_bytes": _disk_use(tier["path"]),
        "tier_file_apparent_bytes": os.path.getsize(tier["path"]) if os.path.exists(tier["path"]) else 0,
        "loss_first": float(np.mean(losses[:20])), "loss_last": float(np.mean(losses[-20:])),
        "checkpoint_save_s": save_s, "checkpoint_load_s": load_s, "peak_rss_after_save": saved_rss,
        "peak_rss_after_load": _peak_rss(), "checkpoint_bytes": checkpoint_bytes, "checkpoint_probe_equal": loaded_equal,
    })
    hybridsync.shutdown()


# -- the parent: launches, collects, reports ----------------------------------------------------------
def _launch_ranks(part: str, args, extra: list) -> list:
    """`--rank-run part` on 2 ranks under mpirun; each rank's JSON, in rank order. Rank 0's
    progress bar comes through on stderr."""
    out_dir = tempfile.mkdtemp(prefix=f"hybridsync-tiers-{part}-")
    cmd = bench.mpirun(2) + [sys.executable, "-u", __file__, "--rank-run", part, "--out", out_dir,
                             "--dir", str(args.dir), *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT, timeout=3600)
        results = [json.loads(f.read_text()) for f in sorted(Path(out_dir).glob("rank-*.json"))]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if done.returncode != 0 or len(results) != 2:
        raise SystemExit(f"part {part} failed (exit {done.returncode}):\n{done.stdout[-4000:]}")
    return sorted(results, key=lambda r: r["rank"])


def part_stream(args) -> dict:
    slot_bytes = args.dim * 4 * 2  # (row + Adagrad slot)
    _need_disk(args.dir, int(1.1 * 2 * args.batch * args.steps * slot_bytes), "a")
    ranks = _launch_ranks("a", args, ["--steps", str(args.steps), "--batch", str(args.batch), "--dim", str(args.dim),
                                      "--memory-rows", str(args.memory_rows), "--a", str(args.a),
                                      "--every", str(args.every)])
    med = bench.median
    block = args.block
    n = len(ranks[0]["tiered_ms"])
    blocks = [(n - (args.repeats - b) * block, n - (args.repeats - b - 1) * block) for b in range(args.repeats)]
    ratios = [med([med(r["tiered_ms"][lo:hi]) for r in ranks]) / med([med(r["memory_ms"][lo:hi]) for r in ranks])
              for lo, hi in blocks]
    tier = [r["tier"] for r in ranks]
    lookups = sum(t["hits"] + t["loads"] for t in tier)
    summary = {
        "ranks": 2, "batch_per_rank": args.batch, "dim": args.dim, "zipf_a": args.a, "steps": args.steps,
        "memory_rows": args.memory_rows, "ids_drawn": ranks[0]["ids_drawn"], "distinct_ids": ranks[0]["distinct_ids"],
        "stored_tiered": sum(r["stored_tiered"] for r in ranks), "stored_memory": sum(r["stored_memory"] for r in ranks),
        "rows_in_memory": sum(t["memory_rows"] for t in tier), "rows_on_disk": sum(t["disk_rows"] for t in tier),
        "sample_ids": sum(r["sample_ids"] for r in ranks),
        "mismatched_rows": sum(r["mismatched_rows"] for r in ranks),
        "mismatched_slots": sum(r["mismatched_slots"] for r in ranks),
        "hit_rate": sum(t["hits"] for t in tier) / lookups if lookups else None,
        "bytes_read": sum(t["bytes_read"] for t in tier), "bytes_written": sum(t["bytes_written"] for t in tier),
        "tier_file_disk_bytes": sum(r["tier_file_disk_bytes"] for r in ranks),
        "peak_rss_per_rank": [r["peak_rss"] for r in ranks],
        "step_ms_tiered": med([med(r["tiered_ms"][blocks[0][0]:]) for r in ranks]),
        "step_ms_memory": med([med(r["memory_ms"][blocks[0][0]:]) for r in ranks]),
        "whole_run_ratio": sum(sum(r["tiered_ms"]) for r in ranks) / sum(sum(r["memory_ms"]) for r in ranks),
        "block_steps": block, "repeats": args.repeats, "ratios": ratios, "ratio": med(ratios),
        "ratio_target": RATIO_TARGET,
    }
    summary["no_row_lost"] = summary["stored_tiered"] == summary["distinct_ids"] == summary["stored_memory"]
    summary["sample_equal"] = summary["mismatched_rows"] == 0 and summary["mismatched_slots"] == 0
    return {"summary": summary, "ranks": ranks}


def part_big(args) -> dict:
    ram = _ram()
    rows = args.big_rows or math.ceil(args.ram_factor * ram / (BIG_DIM * 4))
    slot_bytes = BIG_DIM * 4 * 2  # (row + Adagrad slot)
    touched = 2 * (args.big_warmup + args.big_steps) * BIG_BATCH * BIG_FEATURES  # (at most)
    _need_disk(args.dir, int(2.2 * min(rows, touched) * slot_bytes), "b")  # (tier files, and a checkpoint of as much)
    ranks = _launch_ranks("b", args, ["--big-rows", str(rows), "--big-memory-rows", str(args.big_memory_rows),
                                      "--big-steps", str(args.big_steps), "--big-warmup", str(args.big_warmup),
                                      "--a", str(args.a)])
    tier = [r["tier"] for r in ranks]
    lookups = sum(t["hits"] + t["loads"] for t in tier)
    summary = {
        "ranks": 2, "ram_bytes": ram, "rows": rows, "dim": BIG_DIM, "table_bytes": rows * BIG_DIM * 4,
        "table_over_ram": rows * BIG_DIM * 4 / ram, "memory_rows": args.big_memory_rows,
        "batch_per_rank": BIG_BATCH, "ids_per_sample": BIG_FEATURES, "steps": args.big_steps,
        "samples_per_s": args.big_steps * BIG_BATCH * 2 / max(r["elapsed_s"] for r in ranks),
        "peak_rss_per_rank": [r["peak_rss"] for r in ranks], "rss_target": RSS_TARGET,
        "peak_rss_after_building_per_rank": [r["built_rss"] for r in ranks],
        "rss_within_target": all(r["peak_rss"] <= RSS_TARGET for r in ranks),
        "tier_file_disk_bytes": sum(r["tier_file_disk_bytes"] for r in ranks),
        "tier_file_apparent_bytes": sum(r["tier_file_apparent_bytes"] for r in ranks),
        "rows_on_disk": sum(t["disk_rows"] for t in tier), "rows_in_memory": sum(t["memory_rows"] for t in tier),
        "hit_rate": sum(t["hits"] for t in tier) / lookups if lookups else None,
        "bytes_read": sum(t["bytes_read"] for t in tier), "bytes_written": sum(t["bytes_written"] for t in tier),
        "loss_first": bench.median([r["loss_first"] for r in ranks]),
        "loss_last": bench.median([r["loss_last"] for r in ranks]),
        "checkpoint_save_s": max(r["checkpoint_save_s"] for r in ranks),
        "checkpoint_load_s": max(r["checkpoint_load_s"] for r in ranks),
        "checkpoint_bytes": ranks[0]["checkpoint_bytes"],
        "peak_rss_after_checkpoint_per_rank": [r["peak_rss_after_load"] for r in ranks],
        "checkpoint_probe_equal": all(r["checkpoint_probe_equal"] for r in ranks),
    }
    return {"summary": summary, "ranks": ranks}


def part_dtypes(args) -> dict:
    runs = []
    configs = list(DTYPES)
    # Each round starts with another row type: a slow spell of this shared machine lands on all alike.
    plan = [(round_, configs[round_ % len(configs):] + configs[:round_ % len(configs)]) for round_ in range(args.rounds)]
    with tqdm(total=args.rounds * len(configs), desc="(c) flagship runs", unit="run") as bar:
        for round_, order in plan:
            tqdm.write(f"(c) round {round_ + 1}/{args.rounds}: load average {' / '.join(map(str, bench.load_average()))}")
            for dtype, rounding in order:
                extra = ["--row-dtype", dtype, "--rounding", rounding, "--eval-batches", str(args.eval_batches)]
                result = bench.run("hybridsync-sharded", 2, args.flagship_steps, args.flagship_warmup, extra=extra)
                if "error" in result:
                    raise SystemExit(f"part c: {dtype}/{rounding} failed:\n{result['error']}")
                runs.append({**result, "round": round_, "loadavg": bench.load_average()})
                bar.update()
    med = bench.median
    rows_total = 8 * 250_000
    summary = []
    for dtype, rounding in configs:
        rs = [r for r in runs if (r["row_dtype"], r["rounding"]) == (dtype, rounding)]
        summary.append({
            "dtype": dtype, "rounding": rounding, "repeats": len(rs),
            "bytes_per_row": med([r["row_store_bytes"] / rows_total for r in rs]),
            "ps_bytes_sent_per_rank_step": med([r["ps_bytes_sent_per_rank_step"] for r in rs]),
            "ms_per_step": med([r["ms_per_step"] for r in rs]), "samples_per_s": med([r["samples_per_s"] for r in rs]),
            "train_loss": med([r["loss"] for r in rs]), "held_out_loss": med([r["eval_loss"] for r in rs]),
        })
    return {"summary": summary, "steps": args.flagship_steps, "eval_batches": args.eval_batches, "runs": runs}


# -- report -----------------------------------------------------------------------------------------
def _lines(parts: dict) -> list:
    lines = []
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    if "a" in parts:
        s = parts["a"]["summary"]
        lines += [
            f"(a) dynamic stream, 2 ranks, {s['batch_per_rank']} ids per rank and step, dim {s['dim']}, server Adagrad, "
            f"Zipf a={s['zipf_a']} over 2^{UNIVERSE_BITS} hashed, {s['steps']} steps; memory for {s['memory_rows']:,} "
            "rows + an unbounded disk tier, against all in memory (unbounded capacity), alternating on the same ids",
            f"    ids drawn {s['ids_drawn']:,}; distinct {s['distinct_ids']:,}; stored: tiered {s['stored_tiered']:,} "
            f"({s['rows_in_memory']:,} in memory, {s['rows_on_disk']:,} on disk), all in memory {s['stored_memory']:,} "
            f"-> {'no row lost' if s['no_row_lost'] else 'ROWS LOST'}",
            f"    sample of {s['sample_ids']:,} ids (3 steps' batches): {s['mismatched_rows']} rows and "
            f"{s['mismatched_slots']} Adagrad slots differ from all in memory"
            f"{' (bit for bit equal)' if s['sample_equal'] else ''}",
            f"    step time, last {s['repeats']} blocks of {s['block_steps']} steps: tiered {s['step_ms_tiered']:.1f} ms, "
            f"all in memory {s['step_ms_memory']:.1f} ms (medians); ratio per block "
            + ", ".join(f"{x:.2f}" for x in s["ratios"])
            + f"; median {s['ratio']:.2f}x (target <= {s['ratio_target']}x); whole run {s['whole_run_ratio']:.2f}x",
            f"    tier: hit rate {s['hit_rate']:.1%}, read {gib(s['bytes_read'])}, written {gib(s['bytes_written'])}, "
            f"files use {gib(s['tier_file_disk_bytes'])} of disk; peak RSS per rank "
            + ", ".join(gib(b) for b in s["peak_rss_per_rank"]),
        ]
    if "b" in parts:
        s = parts["b"]["summary"]
        lines += [
            f"(b) fixed table of {s['rows']:,} x {s['dim']} float32 rows = {gib(s['table_bytes'])} "
            f"({s['table_over_ram']:.2f}x this machine's {gib(s['ram_bytes'])} RAM), memory for {s['memory_rows']:,} "
            f"rows + a disk tier, 2 ranks, batch {s['batch_per_rank']} per rank x {s['ids_per_sample']} ids, Adagrad, "
            f"{s['steps']} timed steps",
            f"    {s['samples_per_s']:,.0f} samples/s; peak RSS per rank "
            + ", ".join(gib(b) for b in s["peak_rss_per_rank"])
            + f" (target <= {gib(s['rss_target'])}: {'met' if s['rss_within_target'] else 'MISSED'}); loss "
            f"{s['loss_first']:.4f} -> {s['loss_last']:.4f}",
            f"    disk used by the tier files: {gib(s['tier_file_disk_bytes'])} (apparent "
            f"{gib(s['tier_file_apparent_bytes'])}) for {s['rows_on_disk']:,} rows on disk: untouched rows cost none; "
            f"hit rate {s['hit_rate']:.1%}, read {gib(s['bytes_read'])}, written {gib(s['bytes_written'])}",
        ]
        if "checkpoint_save_s" in s:
            lines.append(
                f"    checkpoint of the whole table (its written rows): {gib(s['checkpoint_bytes'])}, saved in "
                f"{s['checkpoint_save_s']:.1f} s, loaded into a new model in {s['checkpoint_load_s']:.1f} s "
                f"({'1000 rows probed: equal' if s['checkpoint_probe_equal'] else 'PROBED ROWS DIFFER'}); peak RSS per "
                "rank after both " + ", ".join(gib(b) for b in s["peak_rss_after_checkpoint_per_rank"]))
    if "c" in parts:
        c = parts["c"]
        lines += [f"(c) flagship DLRM (8 x 250k x 32, batch 512 per rank, SGD), hybridsync-sharded at 2 ranks, "
                  f"{c['steps']} steps, held-out loss over {c['eval_batches']} batches; medians of "
                  f"{c['summary'][0]['repeats']} interleaved rounds",
                  f"    {'rows':<22} {'bytes/row':>9} {'PS sent/rank/step':>18} {'ms/step':>8} {'samples/s':>10} "
                  f"{'train loss':>10} {'held-out loss':>13}"]
        for s in c["summary"]:
            name = s["dtype"] + (" (stochastic)" if s["rounding"] == "stochastic" else "")
            lines.append(f"    {name:<22} {s['bytes_per_row']:>9.1f} {s['ps_bytes_sent_per_rank_step'] / 1024:>15.1f} KiB "
                         f"{s['ms_per_step']:>8.2f} {s['samples_per_s']:>10,.0f} {s['train_loss']:>10.4f} "
                         f"{s['held_out_loss']:>13.4f}")
    return lines


def _plot(parts: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [p for p in ("a", "b", "c") if p in parts]
    fig, axes = plt.subplots(1, len(shown), figsize=(6 * len(shown), 4.2), squeeze=False)
    for ax, part in zip(axes[0], shown):
        if part == "a":
            ranks = parts["a"]["ranks"]
            tiered = np.median([r["tiered_ms"] for r in ranks], axis=0)
            memory = np.median([r["memory_ms"] for r in ranks], axis=0)
            ax.plot(tiered, lw=0.6, label=f"memory for {parts['a']['summary']['memory_rows']:,} rows + disk tier")
            ax.plot(memory, lw=0.6, label="all in memory", alpha=0.8)
            ax.set_ylim(0, np.percentile(np.concatenate([tiered, memory]), 98) * 1.2)
            ax.set(xlabel="step", ylabel="ms (median over ranks)",
                   title=f"(a) dynamic stream: median ratio {parts['a']['summary']['ratio']:.2f}x")
            ax.legend(fontsize=8)
        elif part == "b":
            s = parts["b"]["summary"]
            ax.bar(["table", "RAM", "rank 0 RSS", "rank 1 RSS", "disk used"],
                   [s["table_bytes"] / GIB, s["ram_bytes"] / GIB, *(b / GIB for b in s["peak_rss_per_rank"]),
                    s["tier_file_disk_bytes"] / GIB], color=["C0", "C7", "C1", "C1", "C2"])
            ax.axhline(RSS_TARGET / GIB, color="red", lw=0.8, ls="--", label="RSS target 4 GiB")
            ax.set(ylabel="GiB", title=f"(b) table {s['table_over_ram']:.2f}x RAM: {s['samples_per_s']:,.0f} samples/s")
            ax.legend(fontsize=8)
        else:
            rows = parts["c"]["summary"]
            names = [s["dtype"].replace("float", "fp").replace("bfp", "bf") + ("\nstoch." if s["rounding"] == "stochastic"
                                                                                else "") for s in rows]
            x = np.arange(len(rows))
            ax.bar(x - 0.2, [s["ms_per_step"] for s in rows], 0.4, label="ms/step")
            ax.set_xticks(x, names)
            ax.set_ylabel("ms per step")
            twin = ax.twinx()
            twin.bar(x + 0.2, [s["held_out_loss"] for s in rows], 0.4, color="C3", label="held-out loss")
            low = min(s["held_out_loss"] for s in rows)
            twin.set_ylim(low * 0.98, max(s["held_out_loss"] for s in rows) * 1.01)
            twin.set_ylabel("held-out loss")
            ax.set_title("(c) 16-bit rows on the flagship DLRM")
            handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
            twin.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper left")  # (twin: drawn on top)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank-run", choices=("a", "b"), help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--parts", default="a,b,c", help="comma-separated: a (stream), b (larger than RAM), c (16-bit rows)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (about a minute); writes results/tiers-quick.*")
    p.add_argument("--dir", type=Path, default=None, help="where the tier files go (default: a new temporary directory)")
    p.add_argument("--rerender", action="store_true", help="redraw the plot and table from the JSON")
    p.add_argument("--a", type=float, default=1.05, help="Zipf exponent of the id streams (a, b)")
    g = p.add_argument_group("(a) the dynamic stream")
    g.add_argument("--steps", type=int, default=1050)
    g.add_argument("--batch", type=int, default=65536, help="ids per rank and step")
    g.add_argument("--dim", type=int, default=16)
    g.add_argument("--memory-rows", type=int, default=2_000_000, help="rows in memory, both ranks")
    g.add_argument("--block", type=int, default=30, help="steps per timed block")
    g.add_argument("--repeats", type=int, default=5, help="timed blocks of steps at the end of the run")
    g.add_argument("--every", type=int, default=10, help="steps between timeline samples")
    g = p.add_argument_group("(b) a table larger than RAM")
    g.add_argument("--ram-factor", type=float, default=1.55, help="the table's float32 rows over this machine's RAM")
    g.add_argument("--big-rows", type=int, default=0, help="rows (0: from --ram-factor)")
    g.add_argument("--big-memory-rows", type=int, default=1_000_000, help="rows in memory, both ranks")
    g.add_argument("--big-steps", type=int, default=3000)
    g.add_argument("--big-warmup", type=int, default=30)
    g = p.add_argument_group("(c) 16-bit rows on the flagship")
    g.add_argument("--flagship-steps", type=int, default=1000)
    g.add_argument("--flagship-warmup", type=int, default=20)
    g.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the four row types")
    g.add_argument("--eval-batches", type=int, default=20)
    args = p.parse_args()
    if args.rank_run:
        {"a": rank_stream, "b": rank_big}[args.rank_run](args)
        return
    stem = "tiers-quick" if args.quick else "tiers"
    if args.quick:
        args.steps, args.batch, args.memory_rows, args.block, args.every = 60, 8192, 20_000, 10, 5
        args.big_rows = args.big_rows or 5_000_000
        args.big_memory_rows, args.big_steps, args.big_warmup = 20_000, 40, 5
        args.flagship_steps, args.flagship_warmup, args.eval_batches, args.rounds = 60, 5, 4, 1
        args.repeats = min(args.repeats, 3)
    if args.rerender:
        saved = json.loads((RESULTS / f"{stem}.json").read_text())
        print("\n".join(_lines(saved["parts"])))
        _plot(saved["parts"], RESULTS / f"{stem}.png")
        return
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(parts) - {"a", "b", "c"})
    if unknown:
        raise SystemExit(f"tiers.py: --parts: unknown part(s) {', '.join(unknown)} (known: a, b, c)")
    if min(args.repeats, args.block, args.rounds) < 1:
        raise SystemExit("tiers.py: --repeats, --block and --rounds must be >= 1")
    if "a" in parts and args.repeats * args.block > args.steps:
        raise SystemExit(f"tiers.py: --repeats x --block ({args.repeats * args.block}) is more than --steps ({args.steps})")
    scratch = args.dir is None
    args.dir = Path(tempfile.mkdtemp(prefix="hybridsync-tiers-")) if scratch else args.dir.absolute()
    args.dir.mkdir(parents=True, exist_ok=True)
    saved_path = RESULTS / f"{stem}.json"
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {"parts": {}}
    runners = {"a": part_stream, "b": part_big, "c": part_dtypes}
    try:
        for part in parts:
            load = bench.load_average()
            print(f"part ({part}): load average {' / '.join(map(str, load))}", flush=True)
            result = runners[part](args)
            saved["parts"][part] = {**result, "loadavg_before": load, "loadavg_after": bench.load_average(),
                                    "quick": args.quick}
    finally:
        if scratch:
            shutil.rmtree(args.dir, ignore_errors=True)
    lines = _lines(saved["parts"])
    print("\n".join(lines))
    RESULTS.mkdir(parents=True, exist_ok=True)
    saved_path.write_text(json.dumps(saved, indent=1))
    (RESULTS / f"{stem}.md").write_text("```\n" + "\n".join(lines) + "\n```\n")
    _plot(saved["parts"], RESULTS / f"{stem}.png")
    print(f"wrote {saved_path}, {stem}.md, {stem}.png")


if __name__ == "__main__":
    main()
