"""Horovod as the dense backend: ring all-reduce with tensor fusion, run by Horovod's own
background thread, on the job's MPI communicator (or Gloo under `horovodrun --gloo`).
Buffers are torch tensors or NumPy arrays (seen as tensors without a copy, so in-place results
land in the array)."""
from __future__ import annotations

import importlib.util
import threading

import numpy as np

from .. import runtime
from ..types import ReduceOp

_lock = threading.Lock()


def available() -> bool:
    """Whether a Horovod built for PyTorch is installed."""
    try:
        return importlib.util.find_spec("horovod.torch") is not None
    except (ImportError, ValueError):
        return False


def module():
    """horovod.torch, initialised on the job's communicator (once)."""
    import horovod.torch as hvd

    with _lock:
        if not hvd.is_initialized():
            world = runtime.world()
            if world.comm is not None:
                hvd.init(comm=world.comm)
            else:
                hvd.init()
            runtime.on_shutdown(hvd.shutdown)
    return hvd



def _tensor(buf):
    import torch

    return torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf


class HorovodCollectives:
    """Dense collectives through Horovod (async; fused by Horovod's thread)."""

    name = "horovod"

    def __init__(self):
        self.hvd = module()
        self.size = self.hvd.size()
        self.rank = self.hvd.rank()

    def _op(self, op):
        return self.hvd.Average if op is ReduceOp.AVERAGE else self.hvd.Sum

    def allreduce_async_(self, buf, name=None, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                         verified_layout=False):
        # Horovod negotiates every tensor by name anyway; verified_layout changes nothing here.
        handle = self.hvd.allreduce_async_(_tensor(buf), name=name, op=self._op(op),
                                           prescale_factor=prescale_factor, postscale_factor=postscale_factor)
        return handle, buf

    def poll(self, handle) -> bool:
        return self.hvd.poll(handle[0])

    def synchronize(self, handle):
        self.hvd.synchronize(handle[0])
        return handle[1]

    def allreduce(self, tensor, name=None, op=ReduceOp.AVERAGE):
        return self.hvd.allreduce(tensor, name=name, op=self._op(op))

    def broadcast_(self, buf, root_rank, name=None):
        self.hvd.broadcast_(_tensor(buf), root_rank, name=name)
        return buf

    def allgather(self, buf, name=None):
        out = self.hvd.allgather(_tensor(buf), name=name)
        return out.numpy() if isinstance(buf, np.ndarray) else out

    def broadcast_object(self, obj, root_rank=0, name=None):
        return self.hvd.broadcast_object(obj, root_rank, name=name)

    def allgather_object(self, obj, name=None):
        return self.hvd.allgather_object(obj, name=name)

    def barrier(self):
        self.hvd.barrier()
