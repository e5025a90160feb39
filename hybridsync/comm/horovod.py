"""Horovod as the dense backend: ring all-reduce with tensor fusion, run by Horovod's own
background thread, on the job's MPI communicator (or Gloo under `horovodrun --gloo`).
Buffers are torch tensors or NumPy arrays (seen as tensors without a copy, so in-place results
land in the array).

Collectives users call (hybridsync.torch's allreduce, allgather, broadcast, alltoall,
reducescatter, barrier, join, objects) pass a `HorovodGate` first: the ranks agree on what they
submitted over MPI (hybridsync.comm.negotiation, as the MPI backend does: one 16-byte
all-gather per round) and each collective goes to Horovod once every rank has submitted it with
the same name, kind, shape, dtype, root, op and scales. What Horovod cannot tell (names that
differ between ranks, a name submitted twice: Horovod waits forever, or until its stall
shutdown) is then an error on every rank naming the collective and the ranks, as is any other
mismatch. A DistributedOptimizer's own all-reduces (names made identically on every rank) go
to Horovod directly. Without an MPI communicator (`horovodrun --gloo`) there is no gate:
Horovod negotiates alone, and `failure()` adds the tensor and the ranks to its mismatch errors
by one bounded exchange of descriptors on the error path only.
"""
from __future__ import annotations

import importlib.util
import pickle
import threading
import time

import numpy as np

from .. import runtime
from .negotiation import CollectiveMismatchError, Desc, _disagreement, op_name

_lock = threading.Lock()
_DIAG_BYTES = 1024
_DIAG_TIMEOUT_S = 10.0
_diag_comm = None  # MPI channel for mismatch diagnosis; dropped if an exchange ever times out
_gate = None  # the HorovodGate of the running Horovod (None under `horovodrun --gloo`)


def available() -> bool:
    """Whether a Horovod built for PyTorch is installed."""
    try:
        return importlib.util.find_spec("horovod.torch") is not None
    except (ImportError, ValueError):
        return False


def module():
    """horovod.torch, initialised on the job's communicator (once)."""
    global _diag_comm, _gate
    import horovod.torch as hvd

    with _lock:
        if not hvd.is_initialized():
            world = runtime.world()
            if world.comm is not None:
                hvd.init(comm=world.comm)
                _diag_comm = world.comm.Dup()
                from .horovod_gate import HorovodGate

                _gate = HorovodGate(world.comm, hvd, mismatch_error_class)
            else:
                hvd.init()
            runtime.on_shutdown(hvd.shutdown)
            runtime.on_shutdown(_free_gate)  # (newest first: before Horovod's shutdown)
    return hvd


def gate():
    """The HorovodGate user-called collectives pass before Horovod, or None (no MPI channel)."""
    return _gate


def _free_gate() -> None:
    global _gate
    if _gate is not None:
        _gate.free()
        _gate = None


_ops: dict = {}


def reduce_op(op):
    """Horovod's constant for a reduction op (ReduceOp, or 'average', 'sum', 'min', ...)."""
    found = _ops.get(op)
    if found is None:
        import horovod.torch as hvd
        found = _ops[op] = {"average": hvd.Average, "sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max,
                            "product": hvd.Product, "adasum": hvd.Adasum}[op_name(op)]
    return found


def mismatch_error_class():
    """CollectiveMismatchError that is also Horovod's HorovodInternalError (what Horovod
    scripts catch), made once."""
    global _MismatchError
    if _MismatchError is None:
        from horovod.common.exceptions import HorovodInternalError

        _MismatchError = type("HorovodCollectiveMismatchError", (CollectiveMismatchError, HorovodInternalError),
                              {"__module__": __name__, "__doc__": "Horovod refused mismatched collectives."})
    return _MismatchError


_MismatchError = None


def failure(exc: Exception, desc: Desc) -> Exception:
    """The exception to raise for Horovod's error `exc` on collective `desc`: a mismatch names
    the collective and the ranks that disagree; anything else is returned unchanged."""
    text = str(exc)
    if "Mismatched" not in text:
        return exc
    detail = _diagnose(desc) or f"{desc.label()}: {text}"
    return mismatch_error_class()(detail)


def _diagnose(desc: Desc) -> str | None:
    """Every rank got Horovod's error for this collective; each exchanges what it submitted.
    Bounded: a rank that never synchronizes its failed handle only costs the detail."""
    global _diag_comm
    if _diag_comm is None:
        return None

    comm = _diag_comm
    mine = np.zeros(_DIAG_BYTES, dtype=np.uint8)
    blob = pickle.dumps(Desc(desc.kind, desc.name[:200], desc.dtype, desc.shape[:16], desc.root, desc.op, desc.scales))
    mine[:len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    everyone = np.empty((comm.Get_size(), _DIAG_BYTES), dtype=np.uint8)
    request = comm.Iallgather(mine, everyone)
    deadline = time.monotonic() + _DIAG_TIMEOUT_S
    while not request.Test():
        if time.monotonic() > deadline:
            _diag_comm = None  # the pending exchange can never be matched reliably now
            return None
        time.sleep(0.001)
    by_rank = {r: pickle.loads(everyone[r].tobytes()) for r in range(comm.Get_size())}
    return _disagreement(desc.label(), by_rank)


def _tensor(buf):
    import torch

    return torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf


class HorovodCollectives:
    """Dense collectives through Horovod (async; fused by Horovod's thread), on buffers."""

    name = "horovod"

    def __init__(self):
        self.hvd = module()
        self.size = self.hvd.size()
        self.rank = self.hvd.rank()

    def allreduce_async_(self, buf, name=None, op="average", prescale_factor=1.0, postscale_factor=1.0,
                         verified_layout=False):
        # Horovod negotiates every tensor by name anyway; verified_layout changes nothing here.
        handle = self.hvd.allreduce_async_(_tensor(buf), name=name, op=reduce_op(op),
                                           prescale_factor=prescale_factor, postscale_factor=postscale_factor)
        return handle, buf

    def poll(self, handle) -> bool:
        return self.hvd.poll(handle[0])

    def _wait(self, inner):
        if _gate is not None:  # (a no-op unless user-called collectives wait in the gate)
            _gate.progress_until(lambda: self.hvd.poll(inner))
        return self.hvd.synchronize(inner)

    def synchronize(self, handle):
        self._wait(handle[0])
        return handle[1]

    def allreduce(self, tensor, name=None, op="average"):
        return self._wait(self.hvd.allreduce_async(tensor, name=name, op=reduce_op(op)))

    def broadcast_(self, buf, root_rank, name=None):
        self._wait(self.hvd.broadcast_async_(_tensor(buf), root_rank, name=name))
        return buf

    def allgather(self, buf, name=None):
        out = self._wait(self.hvd.allgather_async(_tensor(buf), name=name))
        return out.numpy() if isinstance(buf, np.ndarray) else out

    # Objects, barriers and join go through the gate (with the user's collectives) where there
    # is one: a peer may wait in the gate for a collective this rank has submitted but not waited
    # for, and Horovod's own forms block without letting the gate move.
    def broadcast_object(self, obj, root_rank=0, name=None):
        if _gate is not None:
            return _gate.broadcast_object(obj, root_rank, name=name)
        return self.hvd.broadcast_object(obj, root_rank, name=name)

    def allgather_object(self, obj, name=None):
        if _gate is not None:
            return _gate.allgather_object(obj, name=name)
        return self.hvd.allgather_object(obj, name=name)

    def barrier(self):
        if _gate is not None:
            _gate.barrier()
        else:
            self.hvd.barrier()

    def join(self) -> int:
        return _gate.join() if _gate is not None else self.hvd.join()
