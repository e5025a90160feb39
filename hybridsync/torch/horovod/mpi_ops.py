"""Horovod's collectives on torch tensors (the names and arguments of horovod.torch.mpi_ops).

Under either dense backend: Horovod's own ops where Horovod runs the global set, the MPI
collectives otherwise and for every other process set (see hybridsync.torch.ops). Names key
collectives across ranks as in Horovod; a collective whose shape, dtype, root rank or op differs
between ranks raises on every rank, naming it and the ranks that disagree. The non-async,
out-of-place forms are differentiable (hybridsync.torch.autograd).
"""
from __future__ import annotations

import torch

from ...comm.negotiation import horovod_op_name, op_name
from ... import ps
from ...types import Adasum, Max, Min, Product, ReduceOp  # noqa: F401  (Horovod's names)
from . import autograd, ops
from ..adaptive import after_join
from .compression import Compression
from .process_sets import global_process_set, is_global

Average, Sum = ReduceOp.AVERAGE, ReduceOp.SUM


_op = horovod_op_name  # Horovod's rule: `average` (deprecated) or `op`, not both; Average when neither


def _check(tensors, what):
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{what} takes torch tensors")


# -- allreduce --------------------------------------------------------------------------------
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Starts reducing `tensor` over the process set into a new tensor; returns a handle."""
    return ops.route(process_set).allreduce_async_(ops._contiguous_out(tensor), name, _op(op, average),
                                                   prescale_factor, postscale_factor)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Starts reducing `tensor` in place; returns a handle."""
    return ops.route(process_set).allreduce_async_(tensor, name, _op(op, average), prescale_factor, postscale_factor)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """postscale * reduce_over_ranks(prescale * tensor) as a new tensor (Average also divides by
    the set size; Sum, Min, Max, Product); differentiable."""
    compressed, ctx = compression.compress(tensor)
    reduced = autograd.Allreduce.apply(compressed, name, _op(op, average), prescale_factor, postscale_factor,
                                       process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduces `tensor` in place and returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    """allreduce_async of a list, negotiated and reduced together; the handle gives a list."""
    return grouped_allreduce_async_([ops._contiguous_out(t) for t in tensors], average, name, op, prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set):
    _check(tensors, "grouped_allreduce")
    route, opn = ops.route(process_set), _op(op, average)
    return ops.group([route.allreduce_async_(t, autograd._member(name, i), opn, prescale_factor, postscale_factor)
                      for i, t in enumerate(tensors)])


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """allreduce of each tensor of a list, as one group; differentiable."""
    _check(tensors, "grouped_allreduce")
    pairs = [compression.compress(t) for t in tensors]
    reduced = autograd.GroupedAllreduce.apply(name, _op(op, average), prescale_factor, postscale_factor, process_set,
                                              *[p[0] for p in pairs])
    return [compression.decompress(r, p[1]) for r, p in zip(reduced, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Reduces a sparse COO tensor by all-gathering its indices and values (Horovod's way);
    returns a function that waits and gives the combined sparse tensor."""
    opn = _op(op, None)
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(tensor._values(), name=f"{name}.values", process_set=process_set)

    def handle():
        gathered_values, gathered_indices = synchronize(values), synchronize(indices)
        if opn == "average":
            gathered_values = gathered_values / ops.set_size(process_set)
        # Checked: the indices come from every rank's tensor, whose sizes nothing compared.
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values, tensor.size(),
                                       check_invariants=True)
    return handle


# -- allgather --------------------------------------------------------------------------------
def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts concatenating every rank's tensor along dim 0 (dim 0 may differ, the rest not)."""
    return ops.route(process_set).allgather_async(tensor, name)


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's tensor concatenated along dim 0, in rank order; differentiable."""
    return autograd.Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    _check(tensors, "grouped_allgather")
    route = ops.route(process_set)
    return ops.group([route.allgather_async(t, autograd._member(name, i)) for i, t in enumerate(tensors)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    _check(tensors, "grouped_allgather")
    return list(autograd.GroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast --------------------------------------------------------------------------------
def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts copying root_rank's tensor into a new tensor on every rank (root_rank is global)."""
    return ops.route(process_set).broadcast_async_(ops._contiguous_out(tensor), root_rank, name)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    return ops.route(process_set).broadcast_async_(tensor, root_rank, name)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """root_rank's tensor, as a new tensor on every rank; differentiable."""
    return autograd.Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrites `tensor` with root_rank's value and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall / reducescatter -----------------------------------------------------------------
def _splits(splits):
    """Row counts per destination rank as ints; a splits tensor must hold int32 (as in Horovod)."""
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"alltoall: splits must be a tensor of 32-bit integers (torch.int32), not {splits.dtype}")
        splits = splits.tolist()
    return [int(s) for s in splits]


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts sending splits[r] rows of `tensor` to rank r (equal parts when None); the handle
    gives (received rows, received counts)."""
    return ops.route(process_set).alltoall_async(tensor, _splits(splits), name)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """The rows every rank sent to this one, in rank order (and, when splits are given, how
    many came from each rank); differentiable."""
    return autograd.Alltoall.apply(tensor, _splits(splits), name, process_set)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    return ops.route(process_set).reducescatter_async(tensor, name, _op(op, None), prescale_factor, postscale_factor)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduces `tensor` over ranks and gives each rank its share of dim 0 (the first
    dim0 % size ranks get one row more); differentiable."""
    compressed, ctx = compression.compress(tensor)
    out = autograd.Reducescatter.apply(compressed, name, _op(op, None), process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    _check(tensors, "grouped_reducescatter")
    route, opn = ops.route(process_set), _op(op, None)
    return ops.group([route.reducescatter_async(t, autograd._member(name, i), opn, prescale_factor, postscale_factor)
                      for i, t in enumerate(tensors)])


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    _check(tensors, "grouped_reducescatter")
    pairs = [compression.compress(t) for t in tensors]
    out = autograd.GroupedReducescatter.apply(name, _op(op, None), process_set, prescale_factor, postscale_factor,
                                              *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(out, pairs)]


# -- waiting, join, barrier -------------------------------------------------------------------
def poll(handle) -> bool:
    """Whether an async collective has finished (then synchronize() does not block)."""
    return handle.poll()


def synchronize(handle):
    """Waits for an async collective; returns its result (a function handle from
    sparse_allreduce_async is called)."""
    if callable(handle) and not isinstance(handle, ops.Handle):
        return handle()
    return handle.wait()


def join(device=-1) -> int:
    """Blocks until every rank has called join(); meanwhile this rank takes part in the others'
    all-reduces with zeros, and in their parameter-server steps with nothing (its shards keep
    serving them), so ranks with fewer batches can stop early. Returns the rank that joined
    last. (`device` is accepted for Horovod's signature; zeros are made on the CPU.)"""
    last = ps.join(ops.route(None).join)
    after_join(last)  # the adaptive batch's state, taken from the rank that stepped the most
    return last


def barrier(process_set=global_process_set):
    """Returns once every rank of the process set has reached it; over the whole job, also once
    the parameter server has applied every push sent before it (bounded tables' too)."""
    ops.route(process_set).barrier()
    if is_global(process_set):
        ps.settle()
