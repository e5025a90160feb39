"""One benchmark configuration on the ranks of one `mpirun` (run by benchmarks/bench.py).

Every system trains the same DLRM (examples/torch_dlrm.py) with SGD on the same global
batches: step s uses a global batch of ranks x batch samples from a shared seed, and rank r
trains on its slice, so runs at any rank count (and the single-process reference with the
whole global batch) see the same data. Batches are generated before the timed loop.
Rank 0 prints one line `BENCH-RESULT {json}`.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

SYSTEMS = ("hybridsync-default", "hybridsync-ps", "hybridsync-sharded", "hybridsync-replicated", "hybridsync",
           "horovod-allgather", "horovod-allgather-yield", "horovod-sparse-as-dense", "ddp-gloo")
# A script as its user writes it (the DLRM's nn.Embedding tables, DistributedOptimizer(model=...)):
# "hybridsync-default" as it comes (`sync: auto` on), "hybridsync-ps" with HYBRIDSYNC_AUTO=off
# (every table on the parameter server, sharded).
AS_WRITTEN = ("hybridsync", "hybridsync-default", "hybridsync-ps")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=512, help="per rank")
    p.add_argument("--global-ranks", type=int, default=0,
                   help="single-process reference: train on the whole global batch of this many ranks")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=250_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--hot-rows", type=int, default=0,
                   help="table 0 gets this many rows, most of them used every step (a densely used table)")
    p.add_argument("--config", default=None,
                   help="systems 'hybridsync', 'hybridsync-default', 'hybridsync-ps': this YAML decides the routes "
                        "(none: the defaults, sync: auto)")
    p.add_argument("--print-routes", action="store_true",
                   help="hybridsync systems: report each sparse variable's final route (and auto's numbers)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="hybridsync systems: after the timed steps, save a checkpoint here and load it back, timed")
    p.add_argument("--wire-iface", default=None,
                   help="count the bytes this host sends/receives on this interface over the timed steps")
    p.add_argument("--row-dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="hybridsync-sharded: how the shards store the tables' rows (storage: dtype)")
    p.add_argument("--rounding", choices=("nearest", "stochastic"), default="nearest",
                   help="hybridsync-sharded with 16-bit rows: storage: rounding")
    p.add_argument("--timeline", default=None,
                   help="hybridsync systems: record a Chrome-trace timeline of every step here (HYBRIDSYNC_TIMELINE)")
    p.add_argument("--start-together", default=None, metavar="DIR:N",
                   help="separate 1-rank jobs run side by side: wait after the warm-up until N of them are ready "
                        "(a file each in DIR), so their timed steps overlap")
    p.add_argument("--eval-batches", type=int, default=0,
                   help="after training: the loss on this many held-out batches (same teacher, other samples)")
    return p.parse_args()


def wire_bytes(iface):
    """(tx, rx) bytes of this host's interface so far; None without one."""
    if not iface:
        return None
    stats = Path("/sys/class/net") / iface / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def thread_cpu_ticks() -> dict:
    """{thread name: CPU clock ticks (user + system) so far} of this process's threads, threads of
    one name summed, the main thread as "main": which thread spends a rank's core (the trainer,
    the PS server, MPI's and Horovod's background threads)."""
    ticks, main_thread = {}, str(os.getpid())
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = "main" if task.name == main_thread else stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        ticks[name] = ticks.get(name, 0) + int(fields[11]) + int(fields[12])  # utime, stime
    return ticks


def start_together(spec: str, timeout_s: float = 300.0) -> None:
    """Marks this process ready in DIR and waits until N processes are (no MPI job joins them)."""
    folder, count = spec.rsplit(":", 1)
    Path(folder, f"ready.{os.getpid()}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(Path(folder).glob("ready.*"))) < int(count):
        if time.monotonic() > deadline:
            raise TimeoutError(f"--start-together {spec}: fewer than {count} jobs ready after {timeout_s:.0f} s")
        time.sleep(0.001)


def measure_checkpoint(path, model, opt, comm):
    """Seconds to save and to load a checkpoint, its bytes, and this rank's RSS before the save
    and its peak during it (sampled every 2 ms: ru_maxrss only keeps the lifetime peak)."""
    import threading

    import psutil

    import hybridsync

    me = psutil.Process()
    before, peak, done = me.memory_info().rss, [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            done.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    comm.barrier()
    sampler.start()
    start = time.perf_counter()
    hybridsync.save_checkpoint(path, model, opt)
    saved = time.perf_counter() - start
    done.set()
    sampler.join()
    comm.barrier()
    start = time.perf_counter()
    hybridsync.load_checkpoint(path, model, opt)
    loaded = time.perf_counter() - start
    files = Path(path).resolve()
    size = sum(f.stat().st_size for f in files.iterdir())
    return {"save_s": saved, "load_s": loaded, "bytes": size, "rss_before": before, "rss_peak": max(peak[0], before)}


def final_routes():
    """({sparse variable: route[/shards]}, {variable: what sync: auto measured and chose})."""
    import io

    import hybridsync

    plans = json.loads(hybridsync.explain(file=io.StringIO(), as_json=True))
    routes, auto = {}, {}
    for plan in plans:
        for v in plan["variables"]:
            if v["kind"] == "sparse" or v.get("auto"):
                routes[v["name"]] = v["route"] + (f"/{v['shards']}" if v.get("shards") else "")
                if v.get("auto"):
                    auto[v["name"]] = v["auto"]
    return routes, auto


def global_batches(args, ranks, rank, share):
    """This rank's slices of the global batches (dense, ids, labels) for every step."""
    from torch_dlrm import SyntheticCriteo

    import torch

    data = SyntheticCriteo(args.batch * ranks, args.tables, args.rows, seed=args.seed, hot_rows=args.hot_rows)
    out, ids_all = [], []
    for _ in range(args.warmup + args.steps):
        dense, sparse, label = data.batch()
        part = slice(rank * share, (rank + 1) * share)
        out.append((dense[part].contiguous(), sparse[part].contiguous(), label[part].contiguous()))
        ids_all.append(sparse.numpy())
    return out, ids_all


def held_out_loss(args, model, ranks, rank, share):
    """Mean loss over args.eval_batches batches the run never trained on (the same teacher; a
    data seed of its own), each rank its slice of every global batch; every rank evaluates the
    same number of batches (a PS lookup is collective)."""
    import torch
    import torch.nn.functional as F
    from torch_dlrm import SyntheticCriteo

    data = SyntheticCriteo(args.batch * ranks, args.tables, args.rows, seed=args.seed + 10_000, hot_rows=args.hot_rows)
    part = slice(rank * share, (rank + 1) * share)
    losses = []
    with torch.no_grad():
        for _ in range(args.eval_batches):
            dense, sparse, label = data.batch()
            out = model(dense[part].contiguous(), sparse[part].contiguous())
            losses.append(F.binary_cross_entropy_with_logits(out, label[part]).item())
    return float(np.mean(losses))


def build(args, rank, size):
    """(model, optimizer, engine or None) for the system under test."""
    import torch
    from torch_dlrm import DLRM

    torch.manual_seed(args.seed)
    sgd = lambda model: torch.optim.SGD(model.parameters(), lr=args.lr)
    dlrm = lambda **kw: DLRM(args.tables, args.rows, args.dim, hot_rows=args.hot_rows, **kw)
    if args.system == "hybridsync-replicated":
        os.environ.setdefault("HYBRIDSYNC_AUTO", "off")  # this system is the pinned PS route, not a choice
    if args.system.startswith("hybridsync"):
        import hybridsync
        import hybridsync.torch as hvd
        from hybridsync import ps

        hvd.init()
        if args.system == "hybridsync-sharded":
            # Tables created on the shards directly: no rank ever holds a whole table.
            storage = None if args.row_dtype == "float32" else {"dtype": args.row_dtype, "rounding": args.rounding}
            model = dlrm(embedding=lambda r, d: hvd.Embedding(r, d, initializer=("uniform", -1 / np.sqrt(r),
                                                                                    1 / np.sqrt(r)),
                                                              storage=storage))
            opt = hybridsync.DistributedOptimizer(sgd(model), model=model)
        elif args.system in AS_WRITTEN:  # as a user writes it: routes by `sync: auto` or the YAML
            model = dlrm()
            hvd.broadcast_parameters(model.state_dict(), 0)
            opt = hybridsync.DistributedOptimizer(sgd(model), model=model, config=args.config)
        else:
            model = dlrm()
            hvd.broadcast_parameters(model.state_dict(), 0)
            opt = hybridsync.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
        return model, opt, ps.engine()
    if args.system.startswith("horovod"):
        import horovod.torch as hvd

        hvd.init()
        model = dlrm()
        hvd.broadcast_parameters(model.state_dict(), 0)
        opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                       sparse_as_dense=args.system == "horovod-sparse-as-dense")
        return model, opt, None
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=size)
    model = torch.nn.parallel.DistributedDataParallel(dlrm())
    return model, sgd(model), None


def unique_row_minimum(ids_all, args, size, steps):
    """Per rank and step, the fewest PS bytes a rank must send: gradients of the unique rows it
    needs from other shards, plus the rows other ranks need from its shard (cyclic shards)."""
    if size == 1:
        return 0.0
    row = args.dim * 4
    total = np.zeros(size)
    for step in steps:
        ids = ids_all[step]
        for t in range(args.tables):
            uniques = [np.unique(ids[r * args.batch:(r + 1) * args.batch, t]) for r in range(size)]
            for r in range(size):
                remote = int(np.count_nonzero(uniques[r] % size != r))
                served = sum(int(np.count_nonzero(uniques[q] % size == r)) for q in range(size) if q != r)
                total[r] += (remote + served) * row
    return float(total.mean() / len(steps))


class _MPICoordinator:
    """Barriers and result gathering for the systems that run on MPI."""

    def __init__(self):
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self):
        self.comm.Barrier()

    def gather(self, obj):
        return self.comm.gather(obj, root=0)


class _TorchCoordinator:
    """The same over torch.distributed: DDP runs never initialise MPI (mpirun only starts them),
    since MPI and Gloo tearing down in one process crashed at exit."""

    def __init__(self):
        self.rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))
        self.size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))

    def barrier(self):
        import torch.distributed as dist

        dist.barrier()

    def gather(self, obj):
        import torch.distributed as dist

        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out if self.rank == 0 else None


def main():
    args = parse_args()
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    if args.system == "hybridsync-ps":
        os.environ["HYBRIDSYNC_AUTO"] = "off"  # what defines this system; before hybridsync reads its settings
    elif args.system == "hybridsync-default":
        os.environ.pop("HYBRIDSYNC_AUTO", None)  # the default, whatever the caller's environment says
    if args.timeline:
        os.environ["HYBRIDSYNC_TIMELINE"] = args.timeline  # read once, at hybridsync's first settings()
    if args.system.startswith("hybridsync"):
        import hybridsync

        hybridsync.init()  # first, as in a user's script: its MPI settings apply before MPI starts
    comm = _TorchCoordinator() if args.system == "ddp-gloo" else _MPICoordinator()
    rank, size = comm.rank, comm.size
    ranks = args.global_ranks or size
    share = args.batch * ranks if args.global_ranks else args.batch
    batches, ids_all = global_batches(args, ranks, rank, share)
    model, opt, engine = build(args, rank, size)
    wrap_peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # building + wrapping the model

    losses = []
    # Where a step's time goes, the same cut for every system: forward (a PS pull happens here),
    # backward (Horovod starts its all-reduces from here), step (waits, sparse exchange, update).
    phases = np.zeros(3)
    clock = time.perf_counter

    def step(dense, sparse, label):
        t0 = clock()
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), label)
        t1 = clock()
        loss.backward()
        t2 = clock()
        opt.step()
        losses.append(loss.item())
        phases[:] += (t1 - t0, t2 - t1, clock() - t2)

    for b in batches[:args.warmup]:
        step(*b)
    if engine is not None:
        engine.flush()
        engine.reset_traffic()
    comm.barrier()
    if args.start_together:
        start_together(args.start_together)
    phases[:] = 0
    wire_start = wire_bytes(args.wire_iface)
    cpu_start, process_cpu_start = thread_cpu_ticks(), time.process_time()
    start = time.perf_counter()
    for b in batches[args.warmup:]:
        step(*b)
    if engine is not None:
        engine.flush()
    comm.barrier()
    elapsed = time.perf_counter() - start
    process_cpu = time.process_time() - process_cpu_start
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    cpu_end = thread_cpu_ticks()
    thread_cpu_ms = {name: (cpu_end[name] - cpu_start.get(name, 0)) * tick_ms / args.steps for name in cpu_end}
    wire_end = wire_bytes(args.wire_iface)
    local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
    local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1))
    # The host's bytes, shared out to its ranks; counted once per host (by its local rank 0).
    wire = ([(e - b) / local_size / args.steps for b, e in zip(wire_start, wire_end)]
            if wire_start and local_rank == 0 else None)

    traffic = engine.traffic() if engine is not None else None
    eval_loss = held_out_loss(args, model, ranks, rank, share) if args.eval_batches else None
    row_bytes = engine.row_store_bytes() if engine is not None else None  # (this rank's shards: rows as stored)
    training_peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before any checkpoint
    checkpoint = None
    if args.checkpoint_dir and args.system.startswith("hybridsync"):
        checkpoint = measure_checkpoint(f"{args.checkpoint_dir}/ckpt", model, opt, comm)
    mine = {
        "checkpoint": checkpoint,
        "rss": training_peak_rss,
        "wrap_rss": wrap_peak_rss,
        "phases_ms": (phases / args.steps * 1e3).tolist(),
        "cpu_ms_per_step": process_cpu / args.steps * 1e3,
        "thread_cpu_ms_per_step": {k: v for k, v in thread_cpu_ms.items() if v > 0},
        "wire": wire,
        "loss": float(np.mean(losses[-20:])),
        "eval_loss": eval_loss,
        "row_store_bytes": row_bytes,
        "sent": traffic["bytes_sent"] / args.steps if traffic else None,
        "received": traffic["bytes_received"] / args.steps if traffic else None,
    }
    everyone = comm.gather(mine)
    if rank == 0:
        sample = list(range(args.warmup, args.warmup + args.steps, max(1, args.steps // 20)))
        result = {
            "system": args.system, "ranks": size, "global_ranks": ranks, "batch": args.batch,
            "steps": args.steps, "elapsed_s": elapsed,
            "samples_per_s": args.steps * share * size / elapsed,
            "ms_per_step": elapsed / args.steps * 1e3,
            "rss_per_rank": [e["rss"] for e in everyone],
            "wrap_peak_rss_per_rank": [e["wrap_rss"] for e in everyone],
            "loss": float(np.mean([e["loss"] for e in everyone])),
            "eval_loss": float(np.mean([e["eval_loss"] for e in everyone])) if args.eval_batches else None,
            "row_store_bytes": sum(e["row_store_bytes"] for e in everyone) if engine is not None else None,
            "row_dtype": args.row_dtype, "rounding": args.rounding,
            "ps_bytes_sent_per_rank_step": (float(np.mean([e["sent"] for e in everyone]))
                                            if traffic else None),
            "ps_bytes_received_per_rank_step": (float(np.mean([e["received"] for e in everyone]))
                                                if traffic else None),
            "unique_row_min_bytes_per_rank_step": (unique_row_minimum(ids_all, args, size, sample)
                                                   if traffic and not args.global_ranks else None),
            "table_bytes": args.tables * args.rows * args.dim * 4,
            "cpu_ms_per_step_per_rank": [e["cpu_ms_per_step"] for e in everyone],
            "thread_cpu_ms_per_step_per_rank": [e["thread_cpu_ms_per_step"] for e in everyone],
            "phases_ms": dict(zip(("forward", "backward", "step"),
                                  np.mean([e["phases_ms"] for e in everyone], axis=0).tolist())),
        }
        wires = [e["wire"] for e in everyone if e["wire"]]
        if wires:
            result["wire_tx_bytes_per_rank_step"] = float(np.mean([w[0] for w in wires]))
            result["wire_rx_bytes_per_rank_step"] = float(np.mean([w[1] for w in wires]))
        if args.print_routes and args.system.startswith("hybridsync"):
            result["routes"], result["auto"] = final_routes()
        if checkpoint:
            result["checkpoint"] = {
                "save_s": max(e["checkpoint"]["save_s"] for e in everyone),
                "load_s": max(e["checkpoint"]["load_s"] for e in everyone),
                "bytes": checkpoint["bytes"],
                "rss_before_save_per_rank": [e["checkpoint"]["rss_before"] for e in everyone],
                "rss_peak_save_per_rank": [e["checkpoint"]["rss_peak"] for e in everyone],
            }
        print("BENCH-RESULT " + json.dumps(result), flush=True)
    if args.system == "ddp-gloo":
        import torch.distributed as dist

        # Tear Gloo down together: a rank that leaves first resets its peers' connections,
        # and Gloo aborts the process on that.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
