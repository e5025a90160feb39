"""Memory of wrapping a model whose nn.Embedding(sparse=True) tables were built whole: Horovod
against hybridsync (sharded placement: each table moves onto the PS shards), per rank.

    python scripts/wrap_memory.py [-np 2] [--repeats 5] [--systems horovod,hybridsync]  # an mpirun per run
    mpirun -np 2 python scripts/wrap_memory.py --system hybridsync         # one system, this job

Each system builds the benchmark's DLRM (8 tables x 250,000 x 32 by default, SGD), broadcasts
rank 0's parameters, wraps the optimizer with its DistributedOptimizer and trains a few steps
(mpi4py is loaded first in both, as in benchmarks/run_one.py: hybridsync needs it, and it
costs ~2 MiB).
Every rank reports, in MiB: its resident memory (VmRSS) after each phase, the peak (VmHWM)
within each phase (the peak is reset between phases through /proc/self/clear_refs where the
kernel allows it), and the lifetime peak after each phase (ru_maxrss), which is what matters
for "does wrapping ever need more memory than Horovod".
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
MARK = "WRAP-MEMORY"
SYSTEMS = ("horovod", "hybridsync")


def _status(key: str) -> int:
    """A /proc/self/status value in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _lifetime_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Phases:
    """The first phase starts at process start. Resetting VmHWM resets ru_maxrss too, so the
    lifetime peak is the running maximum of the phase peaks when the peak can be reset."""

    def __init__(self):
        self.rows, self.resettable, self.lifetime = [], True, 0

    def mark(self, name: str) -> None:
        peak = _status("VmHWM")
        self.lifetime = max(self.lifetime, peak) if self.resettable else _lifetime_peak()
        self.rows.append({"phase": name, "rss": _status("VmRSS"), "phase_peak": peak, "lifetime_peak": self.lifetime})
        self.resettable = _reset_peak() and self.resettable


def run_system(args) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "examples"))
    from torch_dlrm import DLRM

    from mpi4py import MPI  # (both systems: hybridsync needs it, and the benchmark's harness loads it for both)

    torch.set_num_threads(1)
    phases = Phases()
    if args.system == "horovod":
        import horovod.torch as hvd

        hvd.init()
    else:
        import hybridsync
        import hybridsync.torch as hvd

        hvd.init()
    rank, size = hvd.rank(), hvd.size()
    phases.mark("init")
    torch.manual_seed(0)
    model = DLRM(args.tables, args.rows, args.dim)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    phases.mark("build+broadcast")
    if args.system == "horovod":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    else:
        opt = hybridsync.DistributedOptimizer(sgd, model=model)
    phases.mark("wrap")
    rng = np.random.default_rng(rank)
    for _ in range(args.steps):
        dense = torch.from_numpy(rng.standard_normal((args.batch, 13)).astype(np.float32))
        sparse = torch.from_numpy((rng.zipf(1.2, (args.batch, args.tables)) % args.rows).astype(np.int64))
        label = torch.from_numpy((rng.random(args.batch) < 0.5).astype(np.float32))
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(dense, sparse), label).backward()
        opt.step()
    phases.mark(f"{args.steps} steps")
    everyone = MPI.COMM_WORLD.gather({"rank": rank, "phases": phases.rows, "resettable": phases.resettable}, root=0)
    if rank == 0:
        print(f"{MARK} " + json.dumps({"system": args.system, "size": size, "ranks": everyone}), flush=True)


def mib(n: int) -> str:
    return f"{n / 2**20:7.1f}"


def _phase(rank_result: dict, name: str) -> dict:
    return next(p for p in rank_result["phases"] if p["phase"] == name)


def report(runs: list) -> None:
    """runs: one list of per-system results per repeat; the tables show the first repeat, the
    summary medians over all."""
    import statistics

    print("MiB per rank. rss: resident after the phase; phase peak: the most resident during it; "
          "lifetime peak: ru_maxrss so far.")
    for res in runs[0]:
        for r in sorted(res["ranks"], key=lambda x: x["rank"]):
            note = "" if r["resettable"] else " (phase peaks not resettable: lifetime HWM)"
            print(f"\n{res['system']} -np {res['size']}, rank {r['rank']}{note}")
            print(f"  {'phase':18s} {'rss':>7s} {'phase peak':>10s} {'lifetime peak':>13s}")
            for p in r["phases"]:
                print(f"  {p['phase']:18s} {mib(p['rss'])} {mib(p['phase_peak']):>10s} {mib(p['lifetime_peak']):>13s}")
    print(f"\nmedians over {len(runs)} run(s): lifetime peak once wrapped, and what wrapping added to the "
          "peak before it (the most resident during the wrap - the lifetime peak before it)")
    systems = [res["system"] for res in runs[0]]
    ranks = sorted(r["rank"] for r in runs[0][0]["ranks"])
    print(f"  {'':8s}" + "".join(f" {s + ' peak':>16s} {s + ' adds':>16s}" for s in systems))
    for rank in ranks:
        cells = []
        for k, _ in enumerate(systems):
            rows = [next(r for r in run[k]["ranks"] if r["rank"] == rank) for run in runs]
            peak = statistics.median(_phase(r, "wrap")["lifetime_peak"] for r in rows)
            adds = statistics.median(_phase(r, "wrap")["phase_peak"] - _phase(r, "build+broadcast")["lifetime_peak"]
                                     for r in rows)
            cells.append(f" {mib(peak):>16s} {adds / 2**20:+16.1f}")
        print(f"  rank {rank:<3d}" + "".join(cells))


def launch(args) -> None:
    runs = []
    for _ in range(args.repeats):
        results = []
        for system in args.systems.split(","):
            cmd = ["mpirun", "-np", str(args.np), "--oversubscribe", "--bind-to", "none"]
            if os.geteuid() == 0:
                cmd.append("--allow-run-as-root")
            cmd += [sys.executable, "-u", __file__, "--system", system, "--steps", str(args.steps),
                    "--tables", str(args.tables), "--rows", str(args.rows), "--dim", str(args.dim),
                    "--batch", str(args.batch)]
            env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            start = time.monotonic()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            lines = [l for l in proc.stdout.splitlines() if l.startswith(MARK)]
            if proc.returncode != 0 or not lines:
                sys.exit(f"{system} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
            results.append(json.loads(lines[-1][len(MARK) + 1:]))
            print(f"{system}: {time.monotonic() - start:.0f} s", file=sys.stderr)
        runs.append(results)
    report(runs)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=SYSTEMS, help="run this system on the ranks of this job")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="launcher: systems to compare, one mpirun each")
    p.add_argument("-np", "--np", type=int, default=2, help="launcher: ranks")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=250_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1, help="launcher: runs of each system (medians reported)")
    p.add_argument("--json", default=None, help="launcher: also write the results here")
    args = p.parse_args()
    if args.system:
        run_system(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
