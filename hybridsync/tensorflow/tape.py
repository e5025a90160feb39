"""DistributedGradientTape: for loops that call a plain optimizer's apply_gradients themselves.
Its gradient() returns the average over ranks: dense gradients all-reduced in one fused
collective, tf.IndexedSlices all-gathered (Horovod's semantics; the parameter server needs the
DistributedOptimizer, which applies the update server-side)."""
from __future__ import annotations

import tensorflow as tf

from .. import runtime
from ..types import ReduceOp, as_reduce_op
from . import collectives


class DistributedGradientTape:
    def __init__(self, tape: tf.GradientTape, op=ReduceOp.AVERAGE, compression="none"):
        if not isinstance(tape, tf.GradientTape):
            raise TypeError(f"expected a tf.GradientTape, got {type(tape).__name__}")
        if compression not in ("none", "fp16"):
            raise ValueError(f"compression must be 'none' or 'fp16', got {compression!r}")
        runtime.init()
        self._tape, self._op, self._compression = tape, as_reduce_op(op), compression

    def __getattr__(self, name):  # watch(), stop_recording(), ... of the wrapped tape
        return getattr(self._tape, name)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads)
        size = runtime.world().size
        if size == 1:
            return grads
        src = tf.nest.flatten(sources)
        dense_at = [i for i, g in enumerate(flat) if not isinstance(g, tf.IndexedSlices)]
        tensors = [tf.zeros_like(src[i]) if flat[i] is None else tf.convert_to_tensor(flat[i]) for i in dense_at]
        dtypes = [t.dtype for t in tensors]
        if self._compression == "fp16":
            tensors = [tf.cast(t, tf.float16) if t.dtype.is_floating else t for t in tensors]
        reduced = collectives.allreduce(tensors, self._op)
        out = list(flat)
        for i, r, dtype in zip(dense_at, reduced, dtypes):
            out[i] = tf.cast(r, dtype)
        for i, g in enumerate(flat):
            if isinstance(g, tf.IndexedSlices):
                with tf.control_dependencies(reduced):
                    indices, values = collectives.allgather_rows(g.indices, g.values)
                if self._op is ReduceOp.AVERAGE:
                    values = values / size
                out[i] = tf.IndexedSlices(values, indices, g.dense_shape)
        return tf.nest.pack_sequence_as(grads, out)
