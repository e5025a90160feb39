"""Horovod's collectives on TensorFlow tensors (the names and arguments of
horovod.tensorflow.mpi_ops), run by hybridsync's MPI backend as TensorFlow ops (see
hybridsync.tensorflow.ops): eagerly, in tf.function and in TF1 graphs.

The ops are differentiable as Horovod's are (it registers their gradients; here they are
tf.custom_gradient): allreduce (Sum, Average), alltoall and reducescatter give the exact
gradient of the sum of every rank's loss; allgather and broadcast average the incoming
gradients over ranks (Horovod's convention). For Min, Max and Product, where Horovod reduces the
gradients with the same op (not a gradient), the exact gradient of the sum of the ranks' losses
is computed instead, as hybridsync.torch does.
"""
from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from .. import process_sets
from ..process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set  # noqa: F401
from ..comm.negotiation import horovod_op_name
from ..types import Adasum, Max, Min, Product, ReduceOp  # noqa: F401
from . import ops
from .basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,  # noqa: F401
                     init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                     mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size, start_timeline,
                     stop_timeline)
from .util import _executing_eagerly  # noqa: F401

Average, Sum = ReduceOp.AVERAGE, ReduceOp.SUM


def handle_average_backwards_compatibility(op, average):
    """Horovod's rule for the deprecated `average`: op and average exclude each other; Average
    when neither is given."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, 2)
        return Average if average else Sum
    return Average


def check_num_rank_power_of_2(num_rank) -> bool:
    """Whether num_rank is a power of two (what Adasum needs)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def _member(name, i):
    return None if name is None else f"{name}.{i}"


# -- the raw collectives (no gradient): one op each, every tensor of a group submitted at once ---
def _reduce_raw(tensors, name, op: str, pre: float, post: float, process_set):
    ops.engine(process_set)  # a set this rank is not in, or not registered: ValueError now
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    labels = [ops.np_label(t.dtype) for t in tensors]

    def run(*arrays):
        engine = ops.engine(process_set)
        handles = [engine.allreduce_async_(ops.writable(a), _member(name, i) if len(arrays) > 1 else name, op,
                                           pre, post, dtype=label)
                   for i, (a, label) in enumerate(zip(arrays, labels))]
        return [engine.synchronize(h) for h in handles]

    outs = ops.host_op(run, tensors, [t.dtype for t in tensors], name or "HorovodAllreduce")
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return outs


def _gather_raw(tensors, name, process_set):
    ops.engine(process_set)  # a set this rank is not in, or not registered: ValueError now
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        if t.shape.rank == 0:
            raise ValueError(f"allgather '{name}': needs a tensor with at least one dimension (it concatenates dim 0)")
    labels = [ops.np_label(t.dtype) for t in tensors]

    def run(*arrays):
        engine = ops.engine(process_set)
        handles = [engine.allgather_async(np.ascontiguousarray(a), _member(name, i) if len(arrays) > 1 else name,
                                          dtype=label) for i, (a, label) in enumerate(zip(arrays, labels))]
        return [engine.synchronize(h) for h in handles]

    outs = ops.host_op(run, tensors, [t.dtype for t in tensors], name or "HorovodAllgather")
    for out, t in zip(outs, tensors):
        out.set_shape([None] + t.shape.as_list()[1:] if t.shape.rank is not None else None)
    return outs


def _broadcast_raw(tensors, root_rank: int, name, process_set):
    ops.engine(process_set)  # a set this rank is not in, or not registered: ValueError now
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    labels = [ops.np_label(t.dtype) for t in tensors]

    def run(*arrays):
        engine = ops.engine(process_set)
        handles = [engine.broadcast_async_(ops.writable(a), root_rank, _member(name, i) if len(arrays) > 1 else name,
                                           dtype=label) for i, (a, label) in enumerate(zip(arrays, labels))]
        return [engine.synchronize(h) for h in handles]

    outs = ops.host_op(run, tensors, [t.dtype for t in tensors], name or "HorovodBroadcast")
    for out, t in zip(outs, tensors):
        out.set_shape(t.shape)
    return outs


def _alltoall_raw(tensor, splits, name, process_set):
    ops.engine(process_set)  # a set this rank is not in, or not registered: ValueError now
    label = ops.np_label(tensor.dtype)

    def run(array, counts):
        counts = None if counts.size == 0 else counts
        out, received = ops.engine(process_set).synchronize(ops.engine(process_set).alltoall_async(
            np.ascontiguousarray(array), counts, name, dtype=label))
        return out, received.astype(np.int32)

    out, received = ops.host_op(run, [tensor, splits], [tensor.dtype, tf.int32], name or "HorovodAlltoall")
    out.set_shape([None] + tensor.shape.as_list()[1:] if tensor.shape.rank is not None else None)
    received.set_shape([None])
    return out, received


def _reducescatter_raw(tensors, name, op: str, pre: float, post: float, process_set):
    ops.engine(process_set)  # a set this rank is not in, or not registered: ValueError now
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        if t.shape.rank == 0:
            raise ValueError(f"reducescatter '{name}': needs a tensor with at least one dimension")
    labels = [ops.np_label(t.dtype) for t in tensors]

    def run(*arrays):
        engine = ops.engine(process_set)
        handles = [engine.reducescatter_async(a, _member(name, i) if len(arrays) > 1 else name, op, pre, post,
                                              dtype=label) for i, (a, label) in enumerate(zip(arrays, labels))]
        return [engine.synchronize(h) for h in handles]

    outs = ops.host_op(run, tensors, [t.dtype for t in tensors], name or "HorovodReducescatter")
    for out, t in zip(outs, tensors):
        out.set_shape([None] + t.shape.as_list()[1:] if t.shape.rank is not None else None)
    return outs


def _grad_name(prefix, grads):
    """A backward collective's name, from its incoming gradients (None eagerly: numbered)."""
    present = [g for g in grads if g is not None]
    return ops.collective_name(prefix, present, None) if present else None


def _zeros_for(grads, tensors):
    return [tf.zeros_like(t) if g is None else g for g, t in zip(grads, tensors)]


def _differentiable(tensors) -> bool:
    return all(t.dtype.is_floating or t.dtype.is_complex for t in tensors)


# -- allreduce ----------------------------------------------------------------------------------
def _allreduce(tensor, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0, ignore_name_scope=False,
               process_set=global_process_set):
    """postscale * reduce_over_ranks(prescale * tensor) (Average also divides by the set size);
    differentiable. The op's default is Sum here, as in Horovod's mpi_ops."""
    tensor = tf.convert_to_tensor(tensor)
    opn = horovod_op_name(op)
    name = ops.collective_name("HorovodAllreduce", [tensor], name)
    pre, post = float(prescale_factor), float(postscale_factor)
    if not _differentiable([tensor]):
        return _reduce_raw([tensor], name, opn, pre, post, process_set)[0]
    if opn in ("sum", "average", "adasum"):
        @tf.custom_gradient
        def allreduce(x):
            def grad(dy):
                return _reduce_raw([dy], _grad_name("HorovodAllreduceGrad", [dy]), opn, pre, post, process_set)[0]
            return _reduce_raw([x], name, opn, pre, post, process_set)[0], grad
        return allreduce(tensor)

    @tf.custom_gradient
    def extremum(x):
        # Keep the pre-scaled inputs and the reduction to differentiate them (decided by dtype,
        # not by whether a gradient is wanted, so every rank submits the same collectives).
        scaled = x * tf.cast(pre, x.dtype)
        reduced = _reduce_raw([scaled], name, opn, 1.0, 1.0, process_set)[0]

        def grad(dy):
            total = _reduce_raw([dy], _grad_name("HorovodAllreduceGrad", [dy]), "sum", 1.0, 1.0, process_set)[0]
            total = total * tf.cast(pre * post, dy.dtype)
            if opn == "product":
                everyone = _gather_raw([tf.expand_dims(scaled, 0)], _grad_name("HorovodAllgatherGrad", [scaled]),
                                       process_set)[0]
                mine = ops.set_rank(process_set)
                others = tf.reduce_prod(tf.concat([everyone[:mine], everyone[mine + 1:]], 0), axis=0)
                return total * others
            hit = tf.cast(tf.equal(scaled, reduced), dy.dtype)  # this rank holds the min/max; ties share it
            ties = _reduce_raw([hit], _grad_name("HorovodAllreduceTies", [hit]), "sum", 1.0, 1.0, process_set)[0]
            return total * hit / tf.maximum(ties, tf.ones_like(ties))

        return reduced * tf.cast(post, x.dtype), grad

    return extremum(tensor)


def _grouped_allreduce(tensors, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
                       ignore_name_scope=False, process_set=global_process_set):
    """_allreduce of each tensor of a list, submitted together (fused by the backend);
    differentiable for Sum and Average."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    opn = horovod_op_name(op)
    name = ops.collective_name("HorovodGroupedAllreduce", tensors, name)
    pre, post = float(prescale_factor), float(postscale_factor)
    if not _differentiable(tensors):
        return _reduce_raw(tensors, name, opn, pre, post, process_set)

    @tf.custom_gradient
    def grouped(*xs):
        def grad(*dys):
            if opn not in ("sum", "average", "adasum"):
                raise NotImplementedError(f"grouped_allreduce with op={opn} is not differentiable; use allreduce "
                                          "per tensor")
            dys = _zeros_for(dys, xs)
            return _reduce_raw(dys, _grad_name("HorovodGroupedAllreduceGrad", dys), opn, pre, post, process_set)
        return _reduce_raw(list(xs), name, opn, pre, post, process_set), grad

    return list(grouped(*tensors))


# -- allgather ----------------------------------------------------------------------------------
def _slice_of_mine(grad, x, process_set):
    """This rank's rows of an all-gathered gradient (offsets from every rank's dim 0)."""
    dim0 = tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1])
    dims = _gather_raw([dim0], _grad_name("HorovodAllgatherSizes", [dim0]), process_set)[0]
    mine = ops.set_rank(process_set)
    start = tf.reduce_sum(dims[:mine])
    return grad[start:start + dim0[0]]


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's tensor concatenated along dim 0, in rank order (dim 0 may differ between
    ranks, the other dims not); differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    name = ops.collective_name("HorovodAllgather", [tensor], name)
    if not _differentiable([tensor]):
        return _gather_raw([tensor], name, process_set)[0]

    @tf.custom_gradient
    def gather(x):
        def grad(dy):
            reduced = _reduce_raw([dy], _grad_name("HorovodAllgatherGrad", [dy]), "average", 1.0, 1.0, process_set)[0]
            return _slice_of_mine(reduced, x, process_set)
        return _gather_raw([x], name, process_set)[0], grad

    return gather(tensor)


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """allgather of each tensor of a list, submitted together; differentiable."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    name = ops.collective_name("HorovodGroupedAllgather", tensors, name)
    if not _differentiable(tensors):
        return _gather_raw(tensors, name, process_set)

    @tf.custom_gradient
    def gather(*xs):
        def grad(*dys):
            dys = [tf.zeros([0] + x.shape.as_list()[1:], x.dtype) if d is None else d for d, x in zip(dys, xs)]
            reduced = _reduce_raw(dys, _grad_name("HorovodGroupedAllgatherGrad", dys), "average", 1.0, 1.0,
                                  process_set)
            return [_slice_of_mine(r, x, process_set) for r, x in zip(reduced, xs)]
        return _gather_raw(list(xs), name, process_set), grad

    return list(gather(*tensors))


# -- broadcast ----------------------------------------------------------------------------------
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """root_rank's tensor on every rank (root_rank is a global rank); differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    name = ops.collective_name("HorovodBroadcast", [tensor], name)
    root_rank = int(root_rank)
    if not _differentiable([tensor]):
        return _broadcast_raw([tensor], root_rank, name, process_set)[0]

    @tf.custom_gradient
    def bcast(x):
        def grad(dy):
            reduced = _reduce_raw([dy], _grad_name("HorovodBroadcastGrad", [dy]), "average", 1.0, 1.0, process_set)[0]
            return reduced if rank() == root_rank else reduced * 0
        return _broadcast_raw([x], root_rank, name, process_set)[0], grad

    return bcast(tensor)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrites `variables` with root_rank's values, in one collective; returns their values
    after the broadcast."""
    variables = list(variables)
    if not variables:
        return []
    values = [v.read_value() if hasattr(v, "read_value") else tf.convert_to_tensor(v) for v in variables]
    name = name if name is not None else (None if tf.executing_eagerly() else ops.collective_name(
        "HorovodBroadcastInplace", values, None))
    received = _broadcast_raw(values, int(root_rank), name, process_set)
    assigns = [v.assign(r) for v, r in zip(variables, received)]
    if tf.executing_eagerly():
        return [v.read_value() if hasattr(v, "read_value") else tf.convert_to_tensor(v) for v in variables]
    with tf.control_dependencies([a.op if hasattr(a, "op") else a for a in assigns]):
        return [tf.identity(v.read_value()) if hasattr(v, "read_value") else tf.identity(v) for v in variables]


# -- alltoall -----------------------------------------------------------------------------------
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Sends splits[r] rows of `tensor` to rank r (equal parts of dim 0 when splits is None);
    returns the rows every rank sent to this one, in rank order, and, when splits were given,
    how many came from each rank. Differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    given = splits is not None
    splits_t = tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int64) if given else tf.zeros([0], tf.int64)
    if given and tf.convert_to_tensor(splits).dtype not in (tf.int32, tf.int64):
        raise ValueError(f"alltoall: splits must hold integers, not {tf.convert_to_tensor(splits).dtype.name}")
    name = ops.collective_name("HorovodAlltoall", [tensor], name)
    if not _differentiable([tensor]):
        out, received = _alltoall_raw(tensor, splits_t, name, process_set)
        return (out, received) if given else out

    @tf.custom_gradient
    def exchange(x):
        out, received = _alltoall_raw(x, splits_t, name, process_set)

        def grad(dy, *unused):
            back, _ = _alltoall_raw(dy, tf.cast(received, tf.int64), _grad_name("HorovodAlltoallGrad", [dy]),
                                    process_set)
            return back
        return (out, received), grad

    out, received = exchange(tensor)
    return (out, received) if given else out


# -- reducescatter ------------------------------------------------------------------------------
def _scatter_grad(dys, opn, pre, post, process_set):
    factor = (ops.set_size(process_set) if opn == "sum" else 1.0) * pre * post
    return [d * tf.cast(factor, d.dtype) if factor != 1.0 else d for d in dys]


def _reducescatter(tensor, name=None, op=Sum, ignore_name_scope=False, process_set=global_process_set,
                   prescale_factor=1.0, postscale_factor=1.0):
    """Reduces `tensor` over ranks and gives each rank its share of dim 0 (the first
    dim0 % size ranks get one row more); differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    opn = horovod_op_name(op)
    name = ops.collective_name("HorovodReducescatter", [tensor], name)
    pre, post = float(prescale_factor), float(postscale_factor)
    if not _differentiable([tensor]):
        return _reducescatter_raw([tensor], name, opn, pre, post, process_set)[0]

    @tf.custom_gradient
    def scatter(x):
        def grad(dy):
            g = _scatter_grad([dy], opn, pre, post, process_set)[0]
            return _gather_raw([g], _grad_name("HorovodReducescatterGrad", [g]), process_set)[0]
        return _reducescatter_raw([x], name, opn, pre, post, process_set)[0], grad

    return scatter(tensor)


def _grouped_reducescatter(tensors, name=None, op=Sum, ignore_name_scope=False, process_set=global_process_set,
                           prescale_factor=1.0, postscale_factor=1.0):
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    opn = horovod_op_name(op)
    name = ops.collective_name("HorovodGroupedReducescatter", tensors, name)
    pre, post = float(prescale_factor), float(postscale_factor)
    if not _differentiable(tensors):
        return _reducescatter_raw(tensors, name, opn, pre, post, process_set)

    @tf.custom_gradient
    def scatter(*xs):
        def grad(*dys):
            gs = _scatter_grad(dys, opn, pre, post, process_set)
            return _gather_raw(gs, _grad_name("HorovodGroupedReducescatterGrad", gs), process_set)
        return _reducescatter_raw(list(xs), name, opn, pre, post, process_set), grad

    return list(scatter(*tensors))


# -- join, barrier, the job as ops ----------------------------------------------------------------
def join():
    """Blocks until every rank has called join(); meanwhile this rank takes part in the others'
    all-reduces with zeros (and its parameter-server shards keep serving them), so ranks with
    fewer batches can stop early. Returns (as an int32 scalar tensor) the rank that joined last."""
    from .. import ps
    from .adaptive import after_join

    def run():
        last = ps.join(ops.engine(None).join)
        after_join(last)  # the adaptive batch's state, taken from the rank that stepped the most
        return np.int32(last)

    out = ops.host_op(run, [], [tf.int32], "HorovodJoin")[0]
    out.set_shape([])
    return out


def barrier(process_set=global_process_set):
    """Returns once every rank of the process set has reached it (eagerly; an op in a graph)."""
    from .. import ps

    ops.engine(process_set)
    def run():
        ops.engine(process_set).barrier()
        if process_sets.is_global(process_set):  # (the PS's pushes in flight too: bounded tables')
            ps.settle()
        return np.int32(0)

    return ops.host_op(run, [], [tf.int32], "HorovodBarrier")[0]


def _job_op(value, label: str, name=None):
    """An op giving value() when it runs (not when the graph is built), as Horovod's do."""
    out = ops.host_op(lambda: np.int32(value()), [], [tf.int32], name or label)[0]
    out.set_shape([])
    return out


def _set_by_id(process_set_id):
    found = process_sets.by_id(int(process_set_id))
    if found is None:
        raise ValueError(f"process set {process_set_id} is not registered")
    return found


def size_op(process_set_id=0, name=None):
    """The number of ranks (of the process set), as an op evaluated when it runs."""
    return _job_op(lambda: _set_by_id(process_set_id).size(), "HorovodSize", name)


def local_size_op(name=None):
    return _job_op(local_size, "HorovodLocalSize", name)


def rank_op(name=None):
    return _job_op(rank, "HorovodRank", name)


def local_rank_op(name=None):
    return _job_op(local_rank, "HorovodLocalRank", name)


def process_set_included_op(process_set_id=0, name=None):
    """1 if this rank is in the process set, 0 if not; Horovod's error codes -1 (not
    initialised) and -3 (unknown set) otherwise."""
    def included():
        if not is_initialized():
            return -1
        found = process_sets.by_id(int(process_set_id))
        return -3 if found is None else int(bool(found.included()))

    return _job_op(included, "HorovodProcessSetIncluded", name)
