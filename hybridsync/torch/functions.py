"""Horovod-style collective functions on torch tensors, and the broadcasts that start
training from rank 0's model and optimizer state."""
from __future__ import annotations

import torch

from ..types import ReduceOp, as_reduce_op
from . import ops
from .compression import Compression


def _op(op, average):
    if op is not None:
        return as_reduce_op(op)
    if average is not None:
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    return ReduceOp.AVERAGE


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    """Starts an in-place all-reduce; returns a handle for synchronize()/poll()."""
    return ops.backend().allreduce_async_(tensor, name=name, op=_op(op, average),
                                          prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def synchronize(handle):
    """Waits for an async operation; returns its result tensor."""
    return ops.backend().synchronize(handle)


def poll(handle) -> bool:
    return ops.backend().poll(handle)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor))


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0):
    """The all-reduced value of `tensor` across ranks (a new tensor; `tensor` is unchanged)."""
    compressed, ctx = compression.compress(tensor.detach().clone())
    reduced = allreduce_(compressed, average, name, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def broadcast_(tensor, root_rank, name=None):
    """Overwrites `tensor` with rank root_rank's value."""
    return ops.backend().broadcast_(tensor, root_rank, name=name)


def broadcast(tensor, root_rank, name=None):
    return broadcast_(tensor.detach().clone(), root_rank, name)


def allgather(tensor, name=None):
    """Every rank's tensor concatenated along dim 0 (sizes of dim 0 may differ)."""
    return ops.backend().allgather(tensor, name=name)


def broadcast_object(obj, root_rank=0, name=None):
    return ops.backend().broadcast_object(obj, root_rank, name=name)


def allgather_object(obj, name=None):
    return ops.backend().allgather_object(obj, name=name)


def barrier():
    ops.backend().barrier()


def _is_ps_backed(tensor) -> bool:
    # Tables that live on the parameter server are already consistent across ranks.
    return getattr(tensor, "_hybridsync_ps_table", False)


def broadcast_parameters(params, root_rank=0):
    """Makes every rank's parameters equal to root_rank's.

    params: model.state_dict(), or (name, tensor) pairs such as model.named_parameters().
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = list(params)
        if any(not (isinstance(x, tuple) and len(x) == 2) for x in items):
            raise ValueError("broadcast_parameters takes a state_dict or (name, tensor) pairs, e.g. model.named_parameters()")
    backend = ops.backend()
    if backend.size == 1:
        return
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters: '{name}' is a {type(tensor).__name__}, not a tensor")
        if _is_ps_backed(tensor):
            continue
        backend.broadcast_(tensor.detach(), root_rank, name=f"broadcast.{name}")


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Makes every rank's optimizer state and hyper-parameters equal to root_rank's.
    (Server-side state of parameter-server tables lives on the shards and is not copied.)"""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state does not support LBFGS")
    backend = ops.backend()
    if backend.size == 1:
        return
    state = torch.optim.Optimizer.state_dict(optimizer) if backend.rank == root_rank else None
    state = backend.broadcast_object(state, root_rank, name="broadcast.optimizer_state")
    if backend.rank != root_rank:
        torch.optim.Optimizer.load_state_dict(optimizer, state)
