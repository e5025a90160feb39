"""What collective negotiation costs on the MPI backend (medians over many calls, per rank 0):

    mpirun -np 2 python scripts/negotiation_cost.py [--iters 2000]

- a negotiated barrier against a bare Ibarrier: the cost of one negotiation round;
- a negotiated all-reduce (one 16-byte all-gather of a fingerprint, then the data) against a
  bare mpi4py Iallreduce of the same buffer, and hvd.allreduce on a torch tensor (Horovod's
  out-of-place form: a new result tensor, autograd) for context;
- the same for allgather (which used to corrupt memory on mismatched shapes) against Allgatherv;
- a DistributedOptimizer-style fused all-reduce of 12 gradients: negotiated (first steps, and
  TensorFlow) against the verified fast path (no negotiation);
- with the Horovod backend (unless --no-horovod): hybridsync.torch's collectives, which pass the
  gate (hybridsync.comm.horovod_gate: the ranks agree over MPI before Horovod runs them) against
  horovod.torch's own on the same Horovod -- the gate's cost per collective.
"""
import argparse
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import hybridsync.torch as hvd
from hybridsync import comm
from hybridsync.comm import mpi_kernels


def timed(fn, iters):
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--horovod-iters", type=int, default=400)
    parser.add_argument("--no-horovod", action="store_true")
    args = parser.parse_args()
    hvd.init(backend="mpi")
    torch.set_num_threads(1)
    engine = comm.backend("mpi")
    raw = MPI.COMM_WORLD.Dup()
    rows = [("negotiation round alone (barrier)", timed(engine.barrier, args.iters),
             timed(lambda: mpi_kernels.wait([raw.Ibarrier()]), args.iters))]
    for numel in (4, 4096, 262144):
        a, b = np.ones(numel, dtype=np.float32), np.ones(numel, dtype=np.float32)
        ours = timed(lambda: engine.synchronize(engine.allreduce_async_(b, "bench", "sum")), args.iters)
        bare = timed(lambda: mpi_kernels.wait([raw.Iallreduce(MPI.IN_PLACE, a, op=MPI.SUM)]), args.iters)
        rows.append((f"allreduce {numel * 4} B (NumPy, in place)", ours, bare))
        t = torch.ones(numel)
        rows.append((f"  hvd.allreduce {numel * 4} B (torch, new tensor)",
                     timed(lambda: hvd.allreduce(t, op=hvd.Sum, name="bench.t"), args.iters), bare))
        g = np.ones((numel // 4 or 1, 4), dtype=np.float32)
        out = np.empty((g.shape[0] * engine.size, 4), dtype=np.float32)
        counts = [g.size] * engine.size
        ours = timed(lambda: engine.allgather(g, name="bench.g"), args.iters)
        bare = timed(lambda: mpi_kernels.wait([raw.Iallgatherv(g, [out, counts])]), args.iters)
        rows.append((f"allgather {g.size * 4} B (NumPy)", ours, bare))
    grads = [np.ones(n, dtype=np.float32) for n in (100, 10, 4096, 64, 65536, 256) * 2]
    checked = timed(lambda: engine.allreduce_arrays(grads, "average", name="bench.fused"), args.iters)
    fast = timed(lambda: engine.allreduce_arrays(grads, "average", verified_layout=True, name="bench.fused"),
                 args.iters)
    rows.append(("fused 12 grads (negotiated vs verified)", checked, fast))
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, median of {args.iters} calls (microseconds)")
        print(f"{'':48s} {'hybridsync':>10s} {'bare MPI':>10s} {'overhead':>10s}")
        for label, ours, bare in rows:
            print(f"{label:48s} {ours:10.1f} {bare:10.1f} {ours - bare:10.1f}")
    if not args.no_horovod:
        horovod_rows(args.horovod_iters)


def horovod_rows(iters):
    """hybridsync.torch (gated) against horovod.torch on the same Horovod, interleaved in
    blocks so both see the same machine load."""
    import horovod.torch as horovod

    hvd.init(backend="horovod")
    assert comm.choose() == "horovod"
    rows = []

    def compare(label, ours_fn, theirs_fn):
        ours, theirs = [], []
        for _ in range(max(1, iters // 50)):
            ours.append(timed(ours_fn, 50))
            theirs.append(timed(theirs_fn, 50))
        rows.append((label, statistics.median(ours), statistics.median(theirs)))

    for numel in (4, 4096, 262144):
        t = torch.ones(numel)
        compare(f"allreduce {numel * 4} B", lambda: hvd.allreduce(t, op=hvd.Sum, name="bench.gated"),
                lambda: horovod.allreduce(t, op=horovod.Sum, name="bench.direct"))
    t = torch.ones(1024)
    compare("allgather 4096 B", lambda: hvd.allgather(t, name="bench.gated.g"),
            lambda: horovod.allgather(t, name="bench.direct.g"))
    compare("broadcast 4096 B", lambda: hvd.broadcast(t, 0, name="bench.gated.b"),
            lambda: horovod.broadcast(t, 0, name="bench.direct.b"))
    grads = [torch.ones(n) for n in (100, 10, 4096, 64, 65536, 256) * 2]

    def batch(module, prefix):
        handles = [module.allreduce_async(g, op=module.Sum, name=f"{prefix}.{i}") for i, g in enumerate(grads)]
        for h in handles:
            module.synchronize(h)
    compare("12 async allreduces, then wait (one round)", lambda: batch(hvd, "bench.gated.a"),
            lambda: batch(horovod, "bench.direct.a"))
    from hybridsync.comm import horovod as horovod_backend

    gate, raw = horovod_backend.gate(), MPI.COMM_WORLD.Dup()
    compare("gate round alone (vs a bare MPI Ibarrier)", gate.barrier,
            lambda: mpi_kernels.wait([raw.Ibarrier()]))
    if hvd.rank() == 0:
        print(f"\nHorovod backend, {hvd.size()} ranks, median of {iters} calls (microseconds); Horovod's own "
              "latency is its cycle time (HOROVOD_CYCLE_TIME, 1 ms by default): the gate's round mostly hides in it")
        print(f"{'':48s} {'hybridsync':>10s} {'horovod':>10s} {'gate cost':>10s}   (last row: vs bare MPI)")
        for label, ours, theirs in rows:
            print(f"{label:48s} {ours:10.1f} {theirs:10.1f} {ours - theirs:10.1f}")


if __name__ == "__main__":
    main()
