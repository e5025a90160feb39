"""Horovod's user-facing reductions on TensorFlow values (horovod.tensorflow's allreduce,
grouped_allreduce, reducescatter, grouped_reducescatter): compression around the raw ops of
hybridsync.tensorflow.mpi_ops, and tf.IndexedSlices reduced as Horovod reduces them, by
all-gathering their values and indices (Sum and Average only)."""
from __future__ import annotations

import tensorflow as tf

from ..process_sets import global_process_set, is_global
from ..comm.negotiation import horovod_op_name
from . import mpi_ops, ops
from .compression import Compression


def _op(op, average) -> str:
    return horovod_op_name(mpi_ops.handle_average_backwards_compatibility(op, average))


def _check_sparse(op: str, prescale_factor, postscale_factor) -> None:
    """Horovod's limits on tf.IndexedSlices, raised before any collective (on every rank alike)."""
    if op == "adasum":
        raise NotImplementedError("The Adasum reduction does not currently support sparse tensors. As a workaround "
                                  "please pass sparse_as_dense=True to DistributedOptimizer")
    if op not in ("sum", "average"):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def _check_adasum(op: str, process_set) -> None:
    if op != "adasum":
        return
    if not is_global(process_set):
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    if not mpi_ops.check_num_rank_power_of_2(ops.set_size(process_set)):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")


def _sparse_average(values, op: str, process_set):
    return values / tf.cast(ops.set_size(process_set), values.dtype) if op == "average" else values


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """The reduction of a tf.Tensor / tf.Variable over the ranks of the process set (Average
    unless op says Sum, Min, Max, Product or Adasum), or of a tf.IndexedSlices by all-gathering
    its values and indices (Sum and Average). Differentiable."""
    opn = _op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(opn, prescale_factor, postscale_factor)
        with tf.device(device_sparse):
            values = mpi_ops.allgather(tensor.values, process_set=process_set, ignore_name_scope=ignore_name_scope)
            indices = mpi_ops.allgather(tensor.indices, process_set=process_set, ignore_name_scope=ignore_name_scope)
            return tf.IndexedSlices(_sparse_average(values, opn, process_set), indices, dense_shape=tensor.dense_shape)
    _check_adasum(opn, process_set)
    with tf.device(device_dense):
        compressed, ctx = compression.compress(tensor)
        reduced = mpi_ops._allreduce(compressed, name=name, op=opn, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor, ignore_name_scope=ignore_name_scope,
                                     process_set=process_set)
        return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """allreduce of every value of a list, dense ones submitted together (fused),
    tf.IndexedSlices all-gathered together."""
    if not tensors:
        return tensors
    opn = _op(op, average)
    sparse_at = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense_at = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    out = [None] * len(tensors)
    if sparse_at:
        _check_sparse(opn, prescale_factor, postscale_factor)
    if dense_at:
        _check_adasum(opn, process_set)
    if sparse_at:
        with tf.device(device_sparse):
            slices = [tensors[i] for i in sparse_at]
            values = mpi_ops.grouped_allgather([s.values for s in slices], process_set=process_set,
                                               ignore_name_scope=ignore_name_scope)
            indices = mpi_ops.grouped_allgather([s.indices for s in slices], process_set=process_set,
                                                ignore_name_scope=ignore_name_scope)
            for i, s, v, ix in zip(sparse_at, slices, values, indices):
                out[i] = tf.IndexedSlices(_sparse_average(v, opn, process_set), ix, dense_shape=s.dense_shape)
    if dense_at:
        with tf.device(device_dense):
            pairs = [compression.compress(tensors[i]) for i in dense_at]
            reduced = mpi_ops._grouped_allreduce([p[0] for p in pairs], name=name, op=opn,
                                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                                 ignore_name_scope=ignore_name_scope, process_set=process_set)
            for i, r, (_, ctx) in zip(dense_at, reduced, pairs):
                out[i] = compression.decompress(r, ctx)
    return out


def reducescatter(tensor, device_dense="", compression=Compression.none, op=mpi_ops.Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """The reduction of `tensor` over the ranks, of which each rank gets its share of dim 0 (the
    first dim0 % size ranks one row more). Differentiable."""
    with tf.device(device_dense):
        compressed, ctx = compression.compress(tensor)
        reduced = mpi_ops._reducescatter(compressed, name=name, op=op, ignore_name_scope=ignore_name_scope,
                                         process_set=process_set, prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor)
        return compression.decompress(reduced, ctx)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=mpi_ops.Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """reducescatter of every tensor of a list, submitted together."""
    if not tensors:
        return tensors
    with tf.device(device_dense):
        pairs = [compression.compress(t) for t in tensors]
        reduced = mpi_ops._grouped_reducescatter([p[0] for p in pairs], op=op, process_set=process_set,
                                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor)
        return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]
