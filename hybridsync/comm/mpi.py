"""Dense collectives over MPI (mpi4py) on any CPU buffer: NumPy arrays, or CPU torch tensors
(np.asarray gives a view, so in-place results land in the tensor).

All-reduces are queued by allreduce_async_() and run, fused into buckets, at the first
synchronize(): sorted by name so every rank issues the same collectives in the same order
whatever order its gradients became ready in, and checked by a fingerprint so ranks that
submitted different tensors get an error instead of a hang or garbage.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import time

import numpy as np
from mpi4py import MPI

from ..settings import settings
from ..sync.buckets import check_buffer, make_buckets
from ..types import ReduceOp


def _fp16_sum(invec, inoutvec, datatype):
    a = np.frombuffer(invec, dtype=np.float16)
    b = np.frombuffer(inoutvec, dtype=np.float16)
    b += a


_FP16_SUM = None


def _fp16_sum_op():
    # MPI has no half-precision type: carry float16 as uint16 with our own sum.
    global _FP16_SUM
    if _FP16_SUM is None:
        _FP16_SUM = MPI.Op.Create(_fp16_sum, commute=True)
    return _FP16_SUM


def wait_all(requests) -> None:
    """Waits for MPI requests without sitting in a blocking MPI call: OpenMPI's blocking waits
    spin, stealing the core a peer needs to catch up (measured: 4-5 ms of CPU per step on the
    ranks that arrive first, at 4 ranks on 2 cores). Polls, yielding the core on each poll, for
    HYBRIDSYNC_SPIN_US, then sleeps with back-off."""
    from ..ps import wait_spin_us

    if MPI.Request.Testall(requests):
        return
    spin_until = time.perf_counter() + wait_spin_us() * 1e-6
    sleep_s, max_sleep_s = 1e-6, settings().max_sleep_us * 1e-6
    while not MPI.Request.Testall(requests):
        if time.perf_counter() < spin_until:
            os.sched_yield()
        else:
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, max_sleep_s)


class CollectiveMismatchError(RuntimeError):
    """Ranks submitted different tensors to one synchronize()."""


class Handle:
    __slots__ = ("array", "name", "op", "prescale", "postscale", "verified", "done")

    def __init__(self, array, name, op, prescale, postscale, verified):
        self.array, self.name, self.op = array, name, op
        self.prescale, self.postscale = prescale, postscale
        self.verified = verified
        self.done = False


class MPICollectives:
    name = "mpi"

    def __init__(self, comm):
        self.comm = comm.Dup()  # our own channel: never matches the user's or the PS's messages
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self._pending: list[Handle] = []
        self._unnamed = itertools.count()

    # -- all-reduce -------------------------------------------------------------------------
    def allreduce_async_(self, buf, name=None, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                         verified_layout=False):
        """verified_layout: the caller guarantees every rank submits the same tensors (a
        DistributedOptimizer whose plan was checked across ranks); when all pending tensors say
        so, the per-step fingerprint collective is skipped."""
        array = check_buffer(buf, name or "a tensor")
        handle = Handle(array, name or f"allreduce.noname.{next(self._unnamed)}", op,
                        float(prescale_factor), float(postscale_factor), bool(verified_layout))
        self._pending.append(handle)
        return handle

    def poll(self, handle) -> bool:
        return handle.done

    def synchronize(self, handle):
        if not handle.done:
            self._flush()
        return handle.array

    def allreduce(self, buf, name=None, op=ReduceOp.AVERAGE):
        out = np.array(np.asarray(buf), copy=True, order="C")
        return self.synchronize(self.allreduce_async_(out, name=name, op=op))

    def _flush(self):
        pending = sorted(self._pending, key=lambda h: h.name)
        self._pending = []
        if not all(h.verified for h in pending):
            self._check_same_everywhere(pending)
        self._reduce([h.array for h in pending], [(h.op, h.prescale, h.postscale) for h in pending])
        for h in pending:
            h.done = True

    def allreduce_arrays(self, arrays, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                         verified_layout=False, name="fused"):
        """All-reduces arrays in place, fused into as few collectives as their dtypes allow, and
        waits. Every rank must pass the same arrays (names, dtypes, sizes) in the same order;
        unless verified_layout, that is checked first."""
        arrays = [check_buffer(a, name) for a in arrays]
        if not verified_layout:
            self._check_same_everywhere([Handle(a, f"{name}.{i}", op, prescale_factor, postscale_factor, False)
                                         for i, a in enumerate(arrays)])
        self._reduce(arrays, [(op, float(prescale_factor), float(postscale_factor))] * len(arrays))
        return arrays

    def _reduce(self, arrays, keys):
        buckets = make_buckets(arrays, keys, settings().fusion_bytes)
        for b in buckets:
            prescale = b.key[0][1]
            if prescale != 1.0:  # in place: the result overwrites the caller's arrays anyway
                b.flat *= b.flat.dtype.type(prescale)
        wait_all([self._start(b.flat) for b in buckets])
        for b in buckets:
            (op, _, postscale), _ = b.key
            self._finish(b.flat, op, postscale)
            b.scatter_back()

    def _start(self, flat):
        if flat.dtype == np.float16:  # MPI has no half type: uint16 carrier, our own sum
            return self.comm.Iallreduce(MPI.IN_PLACE, [flat.view(np.uint16), MPI.UINT16_T], op=_fp16_sum_op())
        return self.comm.Iallreduce(MPI.IN_PLACE, flat, op=MPI.SUM)

    def _finish(self, flat, op, postscale):
        if np.issubdtype(flat.dtype, np.integer):
            if op is ReduceOp.AVERAGE:
                flat //= self.size  # integer average rounds down, as Horovod's does
            return
        scale = postscale / self.size if op is ReduceOp.AVERAGE else postscale
        if scale != 1.0:
            flat *= flat.dtype.type(scale)

    def _check_same_everywhere(self, pending):
        text = ";".join(f"{h.name}:{h.array.dtype.str}:{h.array.size}:{h.op.value}" for h in pending)
        digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")
        both = np.array([digest, -digest], dtype=np.int64)
        self.comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MAX)
        if both[0] != -both[1]:
            raise CollectiveMismatchError(
                "ranks submitted different tensors to all-reduce in one step (names, dtypes or sizes "
                f"differ); this rank submitted: {', '.join(h.name for h in pending[:10])}"
                f"{' ...' if len(pending) > 10 else ''}")

    # -- the rest ---------------------------------------------------------------------------
    def broadcast_(self, buf, root_rank, name=None):
        array = np.asarray(buf)
        if array.dtype == np.float16:
            self.comm.Bcast([array.view(np.uint16), MPI.UINT16_T], root=root_rank)
        else:
            self.comm.Bcast(array, root=root_rank)
        return buf

    def allgather(self, buf, name=None):
        """Concatenates every rank's array along dim 0 (first dims may differ)."""
        array = np.ascontiguousarray(np.asarray(buf))
        counts = self.comm.allgather(array.shape[0] if array.ndim else 1)
        row = int(np.prod(array.shape[1:])) if array.ndim > 1 else 1
        out = np.empty((sum(counts), *array.shape[1:]), dtype=array.dtype)
        sizes = [c * row for c in counts]
        if array.dtype == np.float16:
            self.comm.Allgatherv([array.view(np.uint16), MPI.UINT16_T], [out.view(np.uint16), sizes, MPI.UINT16_T])
        else:
            self.comm.Allgatherv(array, [out, sizes])
        return out

    def broadcast_object(self, obj, root_rank=0, name=None):
        return self.comm.bcast(obj, root=root_rank)

    def allgather_object(self, obj, name=None):
        return self.comm.allgather(obj)

    def barrier(self):
        self.comm.Barrier()
