"""Collectives as TensorFlow ops (tf.numpy_function), so they run inside tf.function and
model.fit: dense all-reduce (fused) and all-gather over MPI (mpi4py), and the PS push.
They are stateful ops, which tf.function runs in program order, and each caller chains them
with control dependencies too: every rank must issue its collectives in the same order.
XLA cannot compile Python ops (use jit_compile=False; hybridsync says so if it is on).
"""
from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf

from .. import runtime
from ..types import ReduceOp

_mpi = None
_lock = threading.Lock()


def mpi():
    """The MPI collectives of the TF frontend (on their own duplicate of the job's communicator)."""
    global _mpi
    with _lock:
        if _mpi is None:
            from ..comm.mpi import MPICollectives

            _mpi = MPICollectives(runtime.mpi_comm())
            runtime.on_shutdown(_release)
        return _mpi


def _release():
    global _mpi
    _mpi = None


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


def allreduce(tensors, op=ReduceOp.AVERAGE, verified_layout=False, name="hybridsync_allreduce"):
    """All-reduces a list of dense tensors in one fused collective per dtype."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors or runtime.world().size == 1:
        return tensors
    check_not_xla("all-reduce")

    def reduce(*arrays):
        out = []
        by_dtype: dict = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(a.dtype.str, []).append(i)
        results = [None] * len(arrays)
        for indices in by_dtype.values():
            flat = np.concatenate([np.ascontiguousarray(arrays[i]).reshape(-1) for i in indices])
            mpi().allreduce_flat_(flat, op, 1.0, verified_layout, name)
            offset = 0
            for i in indices:
                n = arrays[i].size
                results[i] = flat[offset:offset + n].reshape(arrays[i].shape)
                offset += n
        out.extend(results)
        return out

    outs = tf.numpy_function(reduce, tensors, Tout=[t.dtype for t in tensors], stateful=True, name=name)
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return outs


def allgather(tensor, name="hybridsync_allgather"):
    """Every rank's tensor concatenated along dim 0 (first dims may differ)."""
    tensor = tf.convert_to_tensor(tensor)
    if runtime.world().size == 1:
        return tensor
    check_not_xla("all-gather")
    out = tf.numpy_function(lambda a: mpi().allgather(np.ascontiguousarray(a)), [tensor], Tout=tensor.dtype,
                            stateful=True, name=name)
    out.set_shape([None] + list(tensor.shape[1:]))
    return out


def ps_push(engine, tables, indices, values, scale, lrs, on_bytes=None, name="hybridsync_ps_push"):
    """Pushes (row ids, gradient rows) of replicated PS tables and returns, per table, the rows
    any shard changed as (ids, rows): the caller writes them into its replica. on_bytes(j, n)
    hears the payload bytes of table j each step."""
    check_not_xla("parameter-server push")
    k = len(tables)

    def push(*arrays):
        ids = [np.asarray(a, dtype=np.int64) for a in arrays[:k]]
        grads = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays[k:2 * k]]
        rates = [float(x) for x in arrays[2 * k:]]
        updates = engine.push(list(tables), ids, grads, float(scale), True, rates)
        if on_bytes is not None:
            for j, (i, g, (changed, rows)) in enumerate(zip(ids, grads, updates)):
                on_bytes(j, i.nbytes + g.nbytes + changed.nbytes + rows.nbytes)
        return [x for pair in updates for x in pair]

    inputs = [tf.cast(i, tf.int64) for i in indices] + [tf.cast(v, tf.float32) for v in values]
    inputs += [tf.cast(lr, tf.float64) for lr in lrs]
    outs = tf.numpy_function(push, inputs, Tout=[tf.int64, tf.float32] * k, stateful=True, name=name)
    pairs = []
    for j in range(k):
        ids, rows = outs[2 * j], outs[2 * j + 1]
        ids.set_shape([None])
        rows.set_shape([None, values[j].shape[-1]])
        pairs.append((ids, rows))
    return pairs


def ps_push_deferred(engine, tables, indices, values, scale, lrs, on_bytes=None, name="hybridsync_ps_push_sharded"):
    """Pushes (row ids, gradient rows) of sharded PS tables; the shards apply them before the
    next pull. Returns a dummy tensor to chain control dependencies on. on_bytes(j, n) hears
    table j's payload per step (rows pulled + gradients pushed, about twice the push)."""
    check_not_xla("parameter-server push")
    k = len(tables)

    def push(*arrays):
        ids = [np.asarray(a, dtype=np.int64) for a in arrays[:k]]
        grads = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays[k:2 * k]]
        engine.push(list(tables), ids, grads, float(scale), False, [float(x) for x in arrays[2 * k:]])
        if on_bytes is not None:
            for j, (i, g) in enumerate(zip(ids, grads)):
                on_bytes(j, 2 * (len(np.unique(i)) * (8 + 4 * g.shape[-1])))
        return np.int64(0)

    inputs = [tf.cast(i, tf.int64) for i in indices] + [tf.cast(v, tf.float32) for v in values]
    inputs += [tf.cast(lr, tf.float64) for lr in lrs]
    return tf.numpy_function(push, inputs, Tout=tf.int64, stateful=True, name=name)
