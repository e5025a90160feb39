"""Collectives on torch tensors through the chosen dense backend (Horovod or MPI).

The MPI backend reduces CPU memory in place; tensors it cannot view that way (CUDA,
non-contiguous, bfloat16) are staged through a contiguous CPU copy and copied back.
"""
from __future__ import annotations

import threading

import torch

from .. import comm
from ..runtime import mpi_comm
from ..types import ReduceOp

_backends: dict = {}
_lock = threading.Lock()


class _TorchOverMPI:
    """MPICollectives with torch tensors in and out."""

    name = "mpi"

    def __init__(self):
        from ..comm.mpi import MPICollectives

        self.mpi = MPICollectives(mpi_comm())
        self.size, self.rank = self.mpi.size, self.mpi.rank

    @staticmethod
    def _stage(tensor):
        t = tensor.detach()
        if t.device.type == "cpu" and t.is_contiguous() and t.dtype != torch.bfloat16:
            return t
        staged = t.to("cpu", copy=True).contiguous()
        return staged.float() if staged.dtype == torch.bfloat16 else staged

    def allreduce_async_(self, tensor, name=None, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                         verified_layout=False):
        staged = self._stage(tensor)
        handle = self.mpi.allreduce_async_(staged.numpy(), name=name, op=op, prescale_factor=prescale_factor,
                                           postscale_factor=postscale_factor, verified_layout=verified_layout)
        return handle, tensor, staged

    def allreduce_many_(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                        verified_layout=False, name="fused"):
        """In-place all-reduce of same-dtype tensors fused into one buffer: one torch.cat, one
        collective, views back (no per-tensor Python work)."""
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        staged = self._stage(flat)
        if prescale_factor != 1.0:
            staged.mul_(prescale_factor)
        self.mpi.allreduce_flat_(staged.numpy(), op, postscale_factor, verified_layout, name)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.detach().copy_(staged[offset:offset + n].view_as(t))
            offset += n
        return tensors

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
    """The dense backend object for torch tensors (created once per kind)."""
    chosen = comm.choose(name)
    with _lock:
        if chosen not in _backends:
            if chosen == "horovod":
                from ..comm.horovod import HorovodCollectives

                _backends[chosen] = HorovodCollectives()
            else:
                _backends[chosen] = _TorchOverMPI()
        return _backends[chosen]


def reset() -> None:
    """Forgets the backend objects (after shutdown)."""
    with _lock:
        _backends.clear()
