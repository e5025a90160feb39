"""Memory per rank, Horovod against hybridsync: the lifetime peak (ru_maxrss) and the steady RSS of
every rank, in both orders a Horovod script may use (Horovod's README wraps the optimizer, then
broadcasts the parameters; many scripts broadcast first), against the size of the tables.

    python benchmarks/memory.py                 # the sweep: 1/2/4 ranks, both orders, 4 table sizes,
                                                # then the capped run; table, JSON and PNG in results/
    python benchmarks/memory.py --quick         # 1 and 2 ranks, 2 sizes, no capped run
    python benchmarks/memory.py --switch        # Horovod against `sync: auto` switching every table
                                                # to a replica, 1/2/4 ranks: results/memory-switch.md
    mpirun -np 2 python benchmarks/memory.py --system hybridsync --order wrap-first   # one run

Each run builds the benchmark's DLRM (examples/torch_dlrm.py: `--tables` x `--rows` x `--dim`
tables, nn.Embedding(sparse=True) built whole, as a Horovod user builds them), wraps and
broadcasts in the given order, and trains `--steps` steps. Both systems load mpi4py first (as
benchmarks/run_one.py does: hybridsync needs it).

The capped run shows the point of sharding: each rank gets a memory limit (a cgroup of its own,
`--cap-mib`), and a table larger than that limit is trained at 4 ranks. Horovod keeps a replica
of every table on every rank and is killed; hybridsync creates the rows on the shards directly
(the model's tables built on the `meta` device, TorchRec's convention), so each rank holds a
quarter. Needs root and a cgroup-v1 memory controller (this machine's); says so otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARK = "MEMORY-RESULT"
SYSTEMS = ("horovod", "hybridsync")
# hybridsync made to switch: links that make every replica far cheaper than the parameter server
# (point-to-point 50 ms / 100 kB/s, collectives free), so `sync: auto` moves each table from its shards
# to a replica after AUTO_STEPS steps -- the moment the issue's "a switch to a replica never peaks
# above Horovod" is about.
SWITCH = "hybridsync-switch"
# Horovod on the route the switch chose: its default (sparse gradients all-gathered) against a
# switch to allgather, sparse_as_dense=True against a switch to allreduce-as-dense.
HOROVOD_DENSE = "horovod-sparse-as-dense"
HOROVOD_FOR_ROUTE = {"allgather": "horovod", "allreduce-as-dense": HOROVOD_DENSE}
AUTO_STEPS = 3
SWITCH_LINKS = {"p2p_latency_s": 5e-2, "p2p_bandwidth": 1e5, "allreduce_latency_s": 1e-6,
                "allreduce_bandwidth": 10e9, "memory_bandwidth": 5e9, "collective_s": 1e-6,
                "ranks": 0, "hosts": 1, "source": "benchmarks/memory.py --switch", "format": 2}
ORDERS = ("wrap-first", "broadcast-first")
CGROUP = Path("/sys/fs/cgroup/memory")


def _mib(nbytes: float) -> float:
    return nbytes / 2**20


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _join_capped_cgroup(rank: int, cap_mib: int) -> None:
    """This rank alone under a memory limit: a cgroup of its own (over the limit, the kernel kills it)."""
    group = CGROUP / f"hybridsync-bench-{os.getppid()}-{rank}"
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(str(cap_mib << 20))
    (group / "cgroup.procs").write_text(str(os.getpid()))


# -- one run, on the ranks of this job ------------------------------------------------------------
def run_system(args) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "examples"))
    from torch_dlrm import DLRM, SyntheticCriteo, torch_embedding

    from mpi4py import MPI  # both systems (hybridsync needs it; the benchmark harness loads it for both)

    torch.set_num_threads(1)
    if args.cap_mib:
        _join_capped_cgroup(MPI.COMM_WORLD.Get_rank(), args.cap_mib)
    if args.system in ("horovod", HOROVOD_DENSE):
        import horovod.torch as hvd

        hvd.init()
        dense = args.system == HOROVOD_DENSE
        wrap = lambda opt, model: hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),  # noqa: E731
                                                           sparse_as_dense=dense)
    else:
        import hybridsync
        import hybridsync.torch as hvd

        hvd.init()
        config = {"auto_steps": AUTO_STEPS, "auto_trial_steps": 0} if args.system == SWITCH else None
        wrap = lambda opt, model: hybridsync.DistributedOptimizer(opt, model=model, config=config)  # noqa: E731
    rank, size = hvd.rank(), hvd.size()
    phases = {"init": _rss()}
    torch.manual_seed(0)
    if args.meta:  # rows created on the shards directly (TorchRec's convention): nobody holds a table
        def embedding(rows, dim):
            return torch.nn.Embedding(rows, dim, sparse=True, device="meta")
    else:
        embedding = torch_embedding
    model = DLRM(args.tables, args.rows, args.dim, embedding=embedding)
    phases["build"] = _rss()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    if args.order == "wrap-first":  # Horovod's README
        opt = wrap(sgd, model)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = wrap(sgd, model)
    phases["wrap+broadcast"] = _rss()
    data = SyntheticCriteo(args.batch, args.tables, args.rows, seed=rank)
    losses = []
    for _ in range(args.steps):
        dense, sparse, label = data.batch()
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), label)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    phases["steps"] = _rss()
    mine = {"rank": rank, "phases": phases, "peak": _peak(), "steady": _rss(),
            "loss_first": float(np.mean(losses[:3])) if losses else None,
            "loss_last": float(np.mean(losses[-3:])) if losses else None}
    if not args.system.startswith("horovod"):  # where each table ended: the switch run must have moved them
        mine["routes"] = {v.name: v.route.value for v in opt.plan.variables
                          if v.kind is not None and v.kind.value == "sparse"}
    everyone = MPI.COMM_WORLD.gather(mine, root=0)
    if rank == 0:
        print(f"{MARK} " + json.dumps({"system": args.system, "np": size, "order": args.order, "rows": args.rows,
                                       "tables": args.tables, "dim": args.dim, "meta": args.meta,
                                       "cap_mib": args.cap_mib, "ranks": everyone}), flush=True)


def rank_command(np_: int, system: str, order: str, rows: int, tables: int, dim: int, steps: int, batch: int,
                 meta: bool = False, cap_mib: int = 0) -> list:
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, "-u", str(Path(__file__).resolve()), "--system", system, "--order", order,
            "--rows", str(rows), "--tables", str(tables), "--dim", str(dim), "--steps", str(steps),
            "--batch", str(batch)]
    return cmd + (["--meta"] if meta else []) + (["--cap-mib", str(cap_mib)] if cap_mib else [])


def parse(output: str) -> dict | None:
    lines = [line for line in output.splitlines() if line.startswith(MARK)]
    return json.loads(lines[-1][len(MARK) + 1:]) if lines else None


def measure(np_, system, order, rows, tables, dim, steps, batch, meta=False, cap_mib=0, timeout=900) -> dict:
    """One mpirun; the result, or {"failed": why} (e.g. a rank killed over its memory cap)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    if system == SWITCH:
        env["HYBRIDSYNC_CACHE_DIR"] = _switch_links(np_)
    proc = subprocess.run(rank_command(np_, system, order, rows, tables, dim, steps, batch, meta, cap_mib),
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    result = parse(proc.stdout)
    if proc.returncode != 0 or result is None:
        killed = "Killed" in proc.stdout + proc.stderr or "signal 9" in proc.stdout + proc.stderr
        return {"system": system, "np": np_, "order": order, "rows": rows, "tables": tables, "dim": dim,
                "meta": meta, "cap_mib": cap_mib,
                "failed": "killed over its memory cap" if killed else f"exit {proc.returncode}",
                "tail": (proc.stdout + proc.stderr)[-1500:]}
    return result


def _switch_links(np_: int) -> str:
    """A cache directory whose links file (for this host, np_ ranks) makes replicas cheap."""
    import socket
    import tempfile

    from hybridsync.comm.probe import cache_path

    cache = tempfile.mkdtemp(prefix="hybridsync-bench-links-")
    with open(cache_path([socket.gethostname()] * np_, cache), "w") as fh:
        json.dump(SWITCH_LINKS, fh)
    return cache


def switch_run(args) -> None:
    """Horovod against hybridsync switching every table to a replica mid-run, at 1/2/4 ranks:
    each rank's lifetime peak; the verdict is hybridsync's worst rank over Horovod's worst."""
    results, lines = [], ["| ranks | Horovod (its setting) peak MiB (max rank) | hybridsync, switched, peak MiB "
                          "(max rank) | ratio | routes after the switch |", "|---:|---:|---:|---:|---|"]
    steps = max(args.steps, AUTO_STEPS + 5)
    for np_ in (1, 2, 4):
        hyb = measure(np_, SWITCH, "wrap-first", args.rows, args.tables, args.dim, steps, args.batch)
        routes = sorted(set(hyb["ranks"][0].get("routes", {}).values())) if "failed" not in hyb else []
        baseline = HOROVOD_FOR_ROUTE.get(routes[0], "horovod") if len(routes) == 1 else "horovod"
        hvd = measure(np_, baseline, "wrap-first", args.rows, args.tables, args.dim, steps, args.batch)
        results += [hyb, hvd]
        print(f"np={np_}: {SWITCH} {hyb.get('failed', 'ok')} ({', '.join(routes)}), {baseline} "
              f"{hvd.get('failed', 'ok')}", file=sys.stderr)
        if "failed" in hvd or "failed" in hyb:
            lines.append(f"| {np_} | {hvd.get('failed', '')} | {hyb.get('failed', '')} | | |")
            continue
        peak_hvd, peak_hyb = (max(x["peak"] for x in r["ranks"]) for r in (hvd, hyb))
        lines.append(f"| {np_} | {_mib(peak_hvd):.1f} ({baseline}) | {_mib(peak_hyb):.1f} | "
                     f"{peak_hyb / peak_hvd:.3f} | {', '.join(routes)} |")
    text = (f"## A switch to replicas against Horovod on the same route ({args.tables} x {args.rows:,} x {args.dim} "
            f"tables, wrap-first, {steps} steps; target ratio <= 1.02)\n\n" + "\n".join(lines))
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory-switch.json").write_text(json.dumps({"runs": results}, indent=1))
    (RESULTS / "memory-switch.md").write_text(text + "\n")


# -- the sweep --------------------------------------------------------------------------------------
def table_mib(r: dict) -> float:
    return _mib(r["tables"] * r["rows"] * r["dim"] * 4)


def report(results: list) -> str:
    lines = ["| system | ranks | order | tables MiB | peak MiB per rank (max / min) | steady MiB per rank (max) |",
             "|---|---:|---|---:|---:|---:|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['system']} | {r['np']} | {r['order']} | {table_mib(r):.0f} | {r['failed']} | |")
            continue
        peaks = [_mib(x["peak"]) for x in r["ranks"]]
        steady = [_mib(x["steady"]) for x in r["ranks"]]
        lines.append(f"| {r['system']} | {r['np']} | {r['order']} | {table_mib(r):.0f} | "
                     f"{max(peaks):.1f} / {min(peaks):.1f} | {max(steady):.1f} |")
    return "\n".join(lines)


def ratios(results: list) -> str:
    """hybridsync's peak over Horovod's, rank by rank, for every (ranks, order, size)."""
    out = ["| ranks | order | tables MiB | worst rank: hybridsync peak / Horovod peak | steady ratio (max rank) |",
           "|---:|---|---:|---:|---:|"]
    by = {(r["system"], r["np"], r["order"], r["rows"]): r for r in results if "failed" not in r}
    for (system, np_, order, rows), hyb in sorted(by.items()):
        hvd = by.get(("horovod", np_, order, rows))
        if system != "hybridsync" or hvd is None:
            continue
        worst = max(h["peak"] / v["peak"] for h, v in zip(sorted(hyb["ranks"], key=lambda x: x["rank"]),
                                                           sorted(hvd["ranks"], key=lambda x: x["rank"])))
        steady = max(x["steady"] for x in hyb["ranks"]) / max(x["steady"] for x in hvd["ranks"])
        out.append(f"| {np_} | {order} | {table_mib(hyb):.0f} | {worst:.3f} | {steady:.3f} |")
    return "\n".join(out)


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    done = [r for r in results if "failed" not in r and r["order"] == "wrap-first" and not r["cap_mib"]]
    for ax, what in zip(axes, ("peak", "steady")):
        for system, style in (("horovod", "--"), ("hybridsync", "-")):
            for np_ in sorted({r["np"] for r in done}):
                runs = sorted((r for r in done if r["system"] == system and r["np"] == np_), key=table_mib)
                if runs:
                    ax.plot([table_mib(r) for r in runs], [_mib(max(x[what] for x in r["ranks"])) for r in runs],
                            style, marker="o", label=f"{system}, {np_} rank{'s' if np_ > 1 else ''}")
        ax.set_xlabel("embedding tables (MiB of fp32 rows)")
        ax.set_title(f"{'lifetime peak (ru_maxrss)' if what == 'peak' else 'steady RSS after training'}, worst rank")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MiB per rank")
    axes[1].legend(fontsize=8)
    fig.suptitle("Memory per rank: Horovod (replica of every table on every rank) vs hybridsync (sharded)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def capped_run(args) -> list:
    """A table bigger than the per-rank cap, trained at 4 ranks: Horovod as its users build the
    model; hybridsync with the tables created on the shards."""
    if os.geteuid() != 0 or not (CGROUP / "memory.limit_in_bytes").exists():
        print("capped run skipped: it needs root and the cgroup-v1 memory controller at /sys/fs/cgroup/memory",
              file=sys.stderr)
        return []
    out = []
    for system, meta in (("horovod", False), ("hybridsync", True)):
        r = measure(4, system, "wrap-first", args.cap_rows, args.tables, args.dim, args.cap_steps, args.batch,
                    meta=meta, cap_mib=args.cap_mib)
        for group in CGROUP.glob("hybridsync-bench-*"):  # the ranks' groups, empty now
            try:
                group.rmdir()
            except OSError:
                pass
        out.append(r)
        status = r.get("failed") or (f"trained {args.cap_steps} steps, loss {r['ranks'][0]['loss_first']:.3f} -> "
                                     f"{r['ranks'][0]['loss_last']:.3f}, peak "
                                     f"{max(_mib(x['peak']) for x in r['ranks']):.0f} MiB")
        print(f"capped ({args.cap_mib} MiB per rank, tables {table_mib(r):.0f} MiB), {system}: {status}",
              file=sys.stderr)
    return out


def launch(args) -> None:
    nps = (1, 2) if args.quick else (1, 2, 4)
    sizes = (62_500, 250_000) if args.quick else (62_500, 125_000, 250_000, 500_000)
    results = []
    for rows in sizes:
        for np_ in nps:
            for order in ORDERS:
                for system in SYSTEMS:
                    start = time.monotonic()
                    results.append(measure(np_, system, order, rows, args.tables, args.dim, args.steps, args.batch))
                    print(f"{system} np={np_} {order} rows={rows}: {time.monotonic() - start:.0f} s", file=sys.stderr)
    capped = [] if args.quick else capped_run(args)
    text = ("## Memory per rank (MiB)\n\n" + report(results) + "\n\n## hybridsync / Horovod\n\n" + ratios(results) +
            ("\n\n## Capped run (per-rank memory limit, 4 ranks)\n\n" + report(capped) if capped else ""))
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps({"runs": results, "capped": capped}, indent=1))
    (RESULTS / "memory.md").write_text(text + "\n")
    plot(results, RESULTS / "memory.png")
    print(f"\nwrote {RESULTS / 'memory.json'}, memory.md and memory.png", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=(*SYSTEMS, SWITCH, HOROVOD_DENSE), help="run this system on the ranks of this job")
    p.add_argument("--order", choices=ORDERS, default="wrap-first")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=250_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--meta", action="store_true", help="build the tables on the meta device")
    p.add_argument("--cap-mib", type=int, default=0, help="each rank runs under this memory limit")
    p.add_argument("--switch", action="store_true",
                   help="launcher: only Horovod against a switch to replicas, at 1/2/4 ranks")
    p.add_argument("--quick", action="store_true", help="launcher: fewer sizes and ranks, no capped run")
    p.add_argument("--cap-rows", type=int, default=1_500_000, help="launcher: rows per table in the capped run")
    p.add_argument("--cap-steps", type=int, default=30, help="launcher: steps of the capped run")
    args = p.parse_args()
    if args.system:
        run_system(args)
    elif args.switch:
        switch_run(args)
    else:
        if args.cap_mib == 0:
            args.cap_mib = 1024
        launch(args)


if __name__ == "__main__":
    main()
