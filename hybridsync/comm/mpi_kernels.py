"""MPI data movement on NumPy buffers for hybridsync.comm.mpi, with Horovod's arithmetic:
reduction ops (float16 carried as uint16 and reduced by NumPy: MPI has no half type), pre/post
scaling (integers truncate toward zero), and waits that never sit in a blocking MPI call.
Each function runs one agreed collective; every rank of `comm` calls it with matching arguments.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
from mpi4py import MPI

from ..settings import settings, wait_spin_us
from .buckets import make_buckets

_MPI_OPS = {"average": MPI.SUM, "sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}
_FP16_UFUNCS = {"average": np.add, "sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}
_fp16_ops: dict = {}


def mpi_op(name: str, dtype):
    if name == "adasum":
        raise ValueError("op=Adasum has no MPI reduction op: it runs as hybridsync.comm.mpi_kernels.adasum")
    if dtype != np.float16:
        return _MPI_OPS[name]
    if name not in _fp16_ops:  # MPI has no half type: uint16 carrier, reduced by NumPy
        ufunc = _FP16_UFUNCS[name]

        def apply(invec, inoutvec, datatype):
            out = np.frombuffer(inoutvec, dtype=np.float16)
            ufunc(np.frombuffer(invec, dtype=np.float16), out, out=out)
        _fp16_ops[name] = MPI.Op.Create(apply, commute=True)
    return _fp16_ops[name]


def buf(array, counts=None):
    """An mpi4py buffer spec; float16 travels as uint16."""
    if array.dtype == np.float16:
        carried = array.view(np.uint16)
        return [carried, MPI.UINT16_T] if counts is None else [carried, counts, MPI.UINT16_T]
    return array if counts is None else [array, counts]


_labels: dict = {}


def label(dtype) -> str:
    """A dtype's name, as descriptors carry it (cached: NumPy builds the name on every call)."""
    name = _labels.get(dtype)
    if name is None:
        name = _labels[dtype] = np.dtype(dtype).name
    return name


def np_dtype(label: str):
    return np.dtype(np.float32 if label == "bfloat16" else label)  # bfloat16 is staged as float32


def scale(array, factor: float) -> None:
    """In place, with Horovod's arithmetic on the CPU: integers are scaled in float64 and truncate
    toward zero, float16 in float32 (the factor is not rounded to half first), other floats in
    their own type."""
    if factor == 1.0:
        return
    if np.issubdtype(array.dtype, np.integer):
        np.multiply(array, factor, out=array, casting="unsafe")
    elif array.dtype == np.float16:
        np.multiply(array, np.float32(factor), out=array, dtype=np.float32, casting="unsafe")
    else:
        array *= array.dtype.type(factor)


_thread_waits = threading.local()


def sleep_while_waiting() -> None:
    """The calling thread's waits sleep at once instead of first polling with sched_yield (a
    background thread: its polls would take the GIL and a core from the thread doing the work)."""
    _thread_waits.no_spin = True


def wait(requests, any_done=False, while_waiting=None, comm=None) -> None:
    """Waits without sitting in a blocking MPI call: OpenMPI's blocking waits spin, stealing the
    core a peer needs to catch up (measured: 4-5 ms of CPU per step on the ranks that arrive
    first, at 4 ranks on 2 cores). Polls, yielding the core, for HYBRIDSYNC_SPIN_US, then sleeps
    with back-off. while_waiting: called at every poll (other work this rank's peers may need).
    comm: the communicator the requests belong to; a member of it that has shut down (its
    script ended, or failed on that rank alone) ends the wait with PeerLostError, as a peer's
    hvd.shutdown() ends Horovod's, instead of leaving this rank waiting forever."""
    def done():
        if while_waiting is not None:
            while_waiting()
        return MPI.Request.Testany(requests)[1] if any_done else MPI.Request.Testall(requests)
    if done():
        return
    spin_us = 0.0 if getattr(_thread_waits, "no_spin", False) else wait_spin_us()
    spin_until = time.perf_counter() + spin_us * 1e-6
    sleep_s, max_sleep_s = 1e-6, settings().max_sleep_us * 1e-6
    next_check = time.perf_counter() + PEER_CHECK_S
    while not done():
        now = time.perf_counter()
        if now < spin_until:
            os.sched_yield()
            continue
        if now > next_check:  # a peer frozen, cut off or gone would leave this wait hanging forever
            raise_if_a_peer_is_lost(comm)
            next_check = now + PEER_CHECK_S
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, max_sleep_s)


class PeerLostError(RuntimeError):
    """A peer has not been heard from (heartbeat) for HYBRIDSYNC_PEER_TIMEOUT_S, or has shut
    down while this rank waits for a collective it belongs to."""


PEER_CHECK_S = 0.5  # how often a wait checks that its peers are still there


def raise_if_a_peer_is_lost(comm) -> None:
    """PeerLostError when a member of comm is silent (frozen, dead, cut off) or has shut down."""
    _raise_if_a_peer_is_silent()
    _raise_if_a_peer_has_left(comm)


def _raise_if_a_peer_is_silent() -> None:
    from .. import _liveness

    timeout = settings().peer_timeout_s
    silent = _liveness.silent_peers(timeout) if timeout > 0 else []
    if silent:
        rank, host, seconds = silent[0]
        raise PeerLostError(f"hybridsync: rank {rank} on host {host} has not been heard from for {seconds:.0f} s "
                            f"(frozen, dead or unreachable; HYBRIDSYNC_PEER_TIMEOUT_S={timeout:g}) while waiting "
                            "for a dense collective")


# A peer's goodbye can overtake the last bytes of a collective it finished: it must have been
# gone this long before a wait that still has not completed gives up on it.
_GONE_GRACE_S = 2.0


def _raise_if_a_peer_has_left(comm) -> None:
    from .. import _liveness

    gone = _liveness.departed_peers(_GONE_GRACE_S)
    if not gone:
        return
    members = set(_world_ranks(comm if comm is not None else MPI.COMM_WORLD))
    for rank, host, _ in gone:
        if rank in members:
            raise PeerLostError(f"hybridsync: rank {rank} (host {host}) has shut down (its script ended or failed "
                                "there) while this rank waits for a collective it takes part in; every rank must "
                                "run the same collectives (uneven data? call hvd.join() when a rank runs out)")


def _world_ranks(comm) -> list:
    """The MPI_COMM_WORLD ranks of comm's members (the heartbeat names peers by them)."""
    group, world_group = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world_group)]
    finally:
        group.Free()
        world_group.Free()


def wait_all(requests) -> None:
    wait(requests)




def _rows(array) -> int:
    return int(np.prod(array.shape[1:], dtype=np.int64))


def reduce_buckets(comm, size: int, arrays, keys, while_waiting=None) -> None:
    """All-reduces arrays in place, fused into buckets per (key, dtype); key = (op, (pre, post))."""
    buckets, requests = start_buckets(comm, size, arrays, keys)
    wait(requests, while_waiting=while_waiting, comm=comm)
    finish_buckets(size, buckets)


def start_buckets(comm, size: int, arrays, keys):
    """The first half of reduce_buckets: (buckets, requests in flight)."""
    buckets = make_buckets(arrays, keys, settings().fusion_bytes)
    requests = []
    for b in buckets:
        (op, (pre, _)), _ = b.key
        scale(b.flat, pre)  # in place: the result overwrites the caller's arrays anyway
        if size > 1:
            requests.append(comm.Iallreduce(MPI.IN_PLACE, buf(b.flat), op=mpi_op(op, b.flat.dtype)))
    return buckets, requests


def finish_buckets(size: int, buckets) -> None:
    """The second half, once the requests are done: post-scaling, results into the arrays."""
    for b in buckets:
        (op, (_, post)), _ = b.key
        scale(b.flat, post / size if op == "average" else post)
        b.scatter_back()


ADASUM_DTYPES = ("float16", "float32", "float64")  # Horovod's Adasum rejects every other type


def check_adasum(name: str, dtype, size: int) -> None:
    """Horovod's limits on Adasum, raised at submit on every rank alike (size is the set's)."""
    label = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if label not in ADASUM_DTYPES:
        raise TypeError(f"allreduce '{name}': op=Adasum reduces float16, float32 or float64 tensors "
                        f"(as in Horovod), not {label}")
    if size & (size - 1):
        raise NotImplementedError(f"allreduce '{name}': op=Adasum needs a power-of-two number of ranks "
                                  f"(as in Horovod), not {size}")


def adasum(comm, size: int, rank: int, arrays, scales, while_waiting=None) -> None:
    """Horovod's Adasum, in place, per tensor: ranks combine pairwise, neighbours at distance 1,
    then 2, 4, ... (the lower-ranked side first), each pair (a, b) becoming
        (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b
    (a coefficient is 1 where its vector's squared norm is below 1e-8): orthogonal gradients
    add, parallel ones average. Horovod splits the vectors across a pair's group (vector halving);
    here both ranks of a pair exchange whole tensors and compute the same combination, in the same
    order, so every rank ends with identical bits. Products and norms are taken in float64;
    `scales` = (prescale, postscale), applied before and after as Horovod does."""
    for a in arrays:
        scale(a, scales[0])
    distance = 1
    while distance < size:
        peer = rank ^ distance
        received = [np.empty_like(a) for a in arrays]
        requests = []
        for mine, theirs in zip(arrays, received):
            requests.append(comm.Irecv(buf(theirs), source=peer, tag=distance))
            requests.append(comm.Isend(buf(mine), dest=peer, tag=distance))
        wait(requests, while_waiting=while_waiting, comm=comm)
        for mine, theirs in zip(arrays, received):
            left, right = (mine, theirs) if rank & distance == 0 else (theirs, mine)
            _combine(left, right, out=mine)
        distance <<= 1
    for a in arrays:
        scale(a, scales[1])


def _combine(a, b, out) -> None:
    a64, b64 = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    dot, a_sq, b_sq = float(a64 @ b64), float(a64 @ a64), float(b64 @ b64)
    a_coeff = 1.0 - dot / a_sq * 0.5 if a_sq >= 1e-8 else 1.0
    b_coeff = 1.0 - dot / b_sq * 0.5 if b_sq >= 1e-8 else 1.0
    out.reshape(-1)[...] = a_coeff * a64 + b_coeff * b64


def post_zero_buckets(comm, shapes, key):
    """A joined rank's part in a fused all-reduce it does not take part in: zeros in the same
    buckets. Returns (requests, buffers to keep alive)."""
    zeros = [np.zeros(shape, np.dtype(dt)) for dt, shape in shapes]
    buckets = make_buckets(zeros, [key] * len(zeros), settings().fusion_bytes)
    return [comm.Iallreduce(MPI.IN_PLACE, buf(b.flat), op=mpi_op(key[0], b.flat.dtype)) for b in buckets], buckets


def allgather_many(comm, size: int, arrays) -> list:
    """Each array concatenated over ranks along dim 0 (one exchange of every dim 0 first)."""
    counts = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    everyone = np.empty((size, len(arrays)), dtype=np.int64)
    wait([comm.Iallgather(counts, everyone)], comm=comm)
    outs, requests = [], []
    for i, a in enumerate(arrays):
        out = np.empty((int(everyone[:, i].sum()), *a.shape[1:]), dtype=a.dtype)
        requests.append(comm.Iallgatherv(buf(a), buf(out, everyone[:, i] * _rows(a))))
        outs.append(out)
    wait(requests, comm=comm)
    return outs


def broadcast(comm, array, root: int):
    wait([comm.Ibcast(buf(array), root=root)], comm=comm)
    return array


def alltoall(comm, size: int, array, splits):
    """splits[r] rows to rank r; returns (rows received, counts received)."""
    received = np.empty(size, dtype=np.int64)
    wait([comm.Ialltoall(splits, received)], comm=comm)
    out = np.empty((int(received.sum()), *array.shape[1:]), dtype=array.dtype)
    wait([comm.Ialltoallv(buf(array, splits * _rows(array)), buf(out, received * _rows(array)))], comm=comm)
    return out, received


def reducescatter(comm, size: int, rank: int, array, op: str, scales):
    """This rank's rows of the reduction (the first dim0 % size ranks get one row more)."""
    rows = array.shape[0]
    counts = np.array([rows // size + (r < rows % size) for r in range(size)], dtype=np.int64)
    out = np.empty((int(counts[rank]), *array.shape[1:]), dtype=array.dtype)
    scale(array, scales[0])
    wait([comm.Ireduce_scatter(buf(array), buf(out), counts * _rows(array), op=mpi_op(op, array.dtype))],
         comm=comm)
    scale(out, scales[1] / size if op == "average" else scales[1])
    return out
