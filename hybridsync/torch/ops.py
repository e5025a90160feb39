"""Collectives on torch tensors through the chosen dense backend (Horovod or MPI).

The MPI backend reduces CPU memory in place; tensors it cannot view that way (CUDA,
non-contiguous, bfloat16) are staged through a contiguous CPU copy and copied back.
"""
from __future__ import annotations

import threading

import torch

from .. import comm
from ..types import ReduceOp
from .access import host_array

_backends: dict = {}
_lock = threading.Lock()


class _TorchOverMPI:
    """MPICollectives with torch tensors in and out."""

    name = "mpi"

    def __init__(self):
        self.mpi = comm.backend("mpi")
        self.size, self.rank = self.mpi.size, self.mpi.rank

    @staticmethod
    def _stage(tensor):
        return torch.from_numpy(host_array(tensor))

    def allreduce_async_(self, tensor, name=None, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                         verified_layout=False):
        staged = self._stage(tensor)
        handle = self.mpi.allreduce_async_(staged.numpy(), name=name, op=op, prescale_factor=prescale_factor,
                                           postscale_factor=postscale_factor, verified_layout=verified_layout)
        return handle, tensor, staged

    def poll(self, handle) -> bool:
        return self.mpi.poll(handle[0])

    def synchronize(self, handle):
        inner, tensor, staged = handle
        self.mpi.synchronize(inner)
        if staged.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(staged)
        return tensor

    def allreduce(self, tensor, name=None, op=ReduceOp.AVERAGE):
        out = tensor.detach().clone()
        return self.synchronize(self.allreduce_async_(out, name=name, op=op))

    def broadcast_(self, tensor, root_rank, name=None):
        staged = self._stage(tensor)
        self.mpi.broadcast_(staged.numpy(), root_rank)
        if staged.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(staged)
        return tensor

    def allgather(self, tensor, name=None):
        gathered = self.mpi.allgather(self._stage(tensor).numpy())
        return torch.from_numpy(gathered).to(device=tensor.device, dtype=tensor.dtype)

    def broadcast_object(self, obj, root_rank=0, name=None):
        return self.mpi.broadcast_object(obj, root_rank)

    def allgather_object(self, obj, name=None):
        return self.mpi.allgather_object(obj)

    def barrier(self):
        self.mpi.barrier()


def backend(name: str | None = None):
    """The dense backend for torch tensors: Horovod's takes them as they are; MPI's gets
    NumPy views (or staged copies) through _TorchOverMPI. Made once per kind."""
    chosen = comm.choose(name)
    if chosen == "horovod":
        return comm.backend(chosen)
    with _lock:
        if chosen not in _backends:
            _backends[chosen] = _TorchOverMPI()
        return _backends[chosen]
