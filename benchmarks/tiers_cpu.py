"""The CPU a disk tier costs per step, at one rank: part (a)'s stream through one table.

    mpirun -np 1 python benchmarks/tiers_cpu.py [--mode tiered|memory] [--steps 500] [--memory-rows 1000000]

Steps one `DynamicTable` -- with a disk tier and memory for `--memory-rows` rows, or all in
memory (unbounded) -- through the hashed Zipf stream of `benchmarks/tiers.py` part (a) (batch
65,536, dim 16, Adagrad), and takes `time.process_time()` around each lookup and push: on a
shared machine CPU time moves less with the load than wall time, so two builds can be compared
by running this alternately. Prints one JSON line: mean CPU per step over the steps after
`--skip`, the slow steps (over 1.8x the median: a tiered table's spill rounds, a
growing map's rehash) apart from the others, the rows stored, and a
hash of the rows and Adagrad slots of a fixed sample of ids (equal for tiered and all in memory,
and across builds that change no result)."""
import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.dynamic import _hashed, _zipf_ranks  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("tiered", "memory"), default="tiered")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--skip", type=int, default=100, help="first steps left out of the means")
    p.add_argument("--memory-rows", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--a", type=float, default=1.05, help="Zipf exponent")
    p.add_argument("--dir", default=None, help="where the tier file goes (default: a new temporary directory)")
    p.add_argument("--out", default="", help="also write the per-step CPU times here (JSON)")
    args = p.parse_args()

    import hybridsync
    from hybridsync.ps import dynamic_options as dyn
    from hybridsync.ps.dynamic import DynamicTable
    from hybridsync.ps.table import push

    hybridsync.init()
    rule = {"name": "adagrad", "lr": 0.05}
    init = ("normal", 0.0, 0.01)
    with tempfile.TemporaryDirectory(dir=args.dir) as tier_dir:
        if args.mode == "tiered":
            table = DynamicTable("tiered", args.dim, dyn.options("tiered", seed=1, initializer=init, disk_tier=True),
                                 rule=rule, storage={"memory_rows": args.memory_rows, "path": tier_dir})
        else:
            table = DynamicTable("memory", args.dim, dyn.options("memory", seed=1, initializer=init), rule=rule)
        grads = np.full((args.batch, args.dim), 0.01, np.float32)
        rng = np.random.default_rng(1000)
        cpu = []
        for _ in range(args.steps):
            ids = _hashed(_zipf_ranks(rng, args.batch, args.a))
            start = time.process_time()
            table.lookup(ids)
            push([table], [ids], [grads], 1.0, [rule["lr"]], False)
            cpu.append(1e3 * (time.process_time() - start))
        sample = np.unique(_hashed(_zipf_ranks(np.random.default_rng(5), 20000, args.a)))
        digest = hashlib.sha1(table.read_rows(sample).tobytes() + table.read_rows(sample, 0).tobytes()).hexdigest()
        timed = np.array(cpu[args.skip:])
        slow = timed > 1.8 * np.median(timed)
        result = {
            "mode": args.mode, "steps": args.steps, "cpu_ms_per_step": float(timed.mean()),
            "slow_steps": int(slow.sum()), "slow_step_cpu_ms": float(timed[slow].mean()) if slow.any() else 0.0,
            "other_step_cpu_ms": float(timed[~slow].mean()), "stored": table.stats()["stored"],
            "sample_hash": digest, "loadavg": os.getloadavg()[0],
        }
        print(json.dumps(result))
        if args.out:
            Path(args.out).write_text(json.dumps({**result, "cpu_ms": cpu}))
        table.drop()
    hybridsync.shutdown()


if __name__ == "__main__":
    main()
