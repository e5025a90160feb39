"""Collectives as TensorFlow ops (tf.numpy_function), so they run inside tf.function and
model.fit: dense all-reduce (fused) and the all-gather of row-sparse gradients over the MPI
backend. They are stateful ops, which tf.function runs in program order, and callers chain them
with control dependencies too: every rank must issue its collectives in the same order. XLA
cannot compile Python ops (use jit_compile=False; hybridsync says so if it is on).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from .. import comm, runtime
from ..sync.allgather import allgather_rows as _allgather_rows
from ..types import ReduceOp


def mpi():
    """The MPI collectives the TF frontend uses (mpi4py: Horovod here has no TensorFlow ops)."""
    return comm.backend("mpi")


def check_not_xla(what: str) -> None:
    """XLA cannot compile tf.numpy_function: fail with the fix instead of an XLA error."""
    try:
        from tensorflow.python.ops import control_flow_util

        in_xla = control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except Exception:  # internal API moved: let TF report it
        return
    if in_xla:
        raise RuntimeError(f"hybridsync {what} runs Python collectives, which XLA cannot compile: "
                           "use model.compile(..., jit_compile=False) (or tf.function(jit_compile=False))")


def allreduce(tensors, op=ReduceOp.AVERAGE, name="hybridsync_allreduce"):
    """All-reduces a list of dense tensors, fused into one collective per dtype."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors or runtime.world().size == 1:
        return tensors
    check_not_xla("all-reduce")

    def reduce(*arrays):
        return mpi().allreduce_arrays([np.array(a, copy=True, order="C") for a in arrays], op, name=name)

    outs = tf.numpy_function(reduce, tensors, Tout=[t.dtype for t in tensors], stateful=True, name=name)
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return outs


def allgather_rows(indices, values, name="hybridsync_allgather_rows"):
    """Every rank's rows of a row-sparse gradient: (ids, values) concatenated in rank order."""
    indices, values = tf.cast(indices, tf.int64), tf.convert_to_tensor(values)
    if runtime.world().size == 1:
        return indices, values
    check_not_xla("all-gather")
    ids, rows = tf.numpy_function(lambda i, v: _allgather_rows(mpi(), i, v, name), [indices, values],
                                  Tout=[tf.int64, values.dtype], stateful=True, name=name)
    ids.set_shape([None])
    rows.set_shape([None] + list(values.shape[1:]))
    return ids, rows
