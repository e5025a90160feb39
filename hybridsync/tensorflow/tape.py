"""Horovod's DistributedGradientTape and PartialDistributedGradientTape, for loops that call a
plain optimizer's apply_gradients themselves. gradient() returns the reduction over the ranks of
the process set (Average by default): dense gradients in one fused collective,
tf.IndexedSlices all-gathered (or densified and all-reduced with sparse_as_dense=True).
Gradients of local sources (register_local_source, or a partial tape's local layers) stay this
rank's own, divided by the set size when scale_local_gradients (Horovod's convention). The tape
is still a tf.GradientTape: its class derives from the wrapped tape's.

Tables on the parameter server (hybridsync.tensorflow.Embedding, DynamicEmbedding) are updated
server-side by the DistributedOptimizer; a tape cannot reduce them, and says so.
"""
from __future__ import annotations

import warnings

import tensorflow as tf

from .. import process_sets
from ..process_sets import global_process_set
from . import mpi_ops, ops, reductions
from .compression import Compression


def _variable(v):
    """The tf.Variable behind a Keras variable."""
    inner = getattr(v, "value", None)
    return inner if isinstance(inner, tf.Variable) else v


def _ref(v):
    return _variable(v).ref()


def check_groups(num_groups, groups):
    """Horovod's explicit grouping of gradient all-reduces, validated as Horovod does. It only
    decides which all-reduces are launched together, never a result; hybridsync reduces every
    dense gradient of a call in one fused collective, so it is accepted and otherwise unused."""
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, 3)
        if groups is None:
            groups = num_groups
    if groups is not None and (isinstance(groups, bool) or not (isinstance(groups, list) or groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    return groups


def scales(op, gradient_predivide_factor: float) -> tuple[float, float]:
    """(prescale, postscale) of the gradient reduction: Average split around the sum."""
    if gradient_predivide_factor != 1.0:
        if mpi_ops.horovod_op_name(op) != "average":
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor
    return 1.0, 1.0


class GradientReducer:
    """Reduces a list of gradients as a distributed tape or optimizer does (None stays None)."""

    def __init__(self, what: str, device_dense, device_sparse, compression, sparse_as_dense, op,
                 gradient_predivide_factor, process_set):
        self.what, self.device_dense, self.device_sparse = what, device_dense, device_sparse
        self.compression, self.sparse_as_dense, self.op = compression, sparse_as_dense, op
        self.prescale, self.postscale = scales(op, gradient_predivide_factor)
        self.process_set = process_set

    def size(self) -> int:
        return ops.set_size(self.process_set)

    def active(self) -> bool:
        """Whether this rank reduces at all (a member of a set of more than one rank)."""
        included = self.process_set.included() if not process_sets.is_global(self.process_set) else True
        return bool(included) and self.size() > 1

    def __call__(self, grads, use_generic_names: bool = False) -> list:
        grads = [tf.convert_to_tensor(g) if self.sparse_as_dense and isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present or not self.active():
            return list(grads)
        reduced = reductions.grouped_allreduce(
            [grads[i] for i in present], device_dense=self.device_dense, device_sparse=self.device_sparse,
            compression=self.compression, op=self.op, prescale_factor=self.prescale, postscale_factor=self.postscale,
            process_set=self.process_set, name=f"{self.what}_Allreduce" if use_generic_names else None)
        out = list(grads)
        for i, r in zip(present, reduced):
            out[i] = r
        return out

    def scale_local(self, grad):
        """A local source's gradient divided by the set size (Horovod's scale_local_gradients)."""
        size = self.size()
        if grad is None or size == 1:
            return grad
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values / tf.cast(size, grad.values.dtype), grad.indices, grad.dense_shape)
        return grad / tf.cast(size, grad.dtype)


def _check_not_ps(sources) -> None:
    for s in sources:
        layer = getattr(s, "_hybridsync_table", None) or getattr(_variable(s), "_hybridsync_table", None)
        if layer is not None:
            raise ValueError(f"variable '{getattr(s, 'path', s.name)}' is the anchor of parameter-server table "
                             f"'{layer.name}', whose rows are updated server-side: train it with "
                             "hybridsync.tensorflow.DistributedOptimizer (model.fit, or optimizer.apply(grads)), not "
                             "with a DistributedGradientTape and a plain optimizer")


class _DistributedGradientTape:
    """The methods a distributed tape's class puts in front of the wrapped tape's class."""

    def _hs_setup(self, reducer: GradientReducer, scale_local_gradients: bool):
        self._hs_reducer = reducer
        self.process_set = reducer.process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources = set()

    def register_local_source(self, source):
        """Registers a variable as this worker's own: its gradient is not reduced (only scaled
        by 1 / size when scale_local_gradients)."""
        self._local_sources.add(_ref(source))

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads)
        _check_not_ps(flat_sources)
        shared = [i for i, s in enumerate(flat_sources) if _ref(s) not in self._local_sources]
        reduced = self._hs_reducer([flat_grads[i] for i in shared], use_generic_names)
        out = list(flat_grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        if self.scale_local_gradients and self._local_sources:
            for i, s in enumerate(flat_sources):
                if _ref(s) in self._local_sources:
                    out[i] = self._hs_reducer.scale_local(out[i])
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """([(local source, gradient)], [(other source, gradient)]), gradients as gradient() gives."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if _ref(s) in self._local_sources else shared).append((s, g))
        return local, shared


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=mpi_ops.Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Horovod's DistributedGradientTape: `gradtape` (a recorded tf.GradientTape, or one to
    record with) whose gradient() reduces over the ranks. op: Average (default), Sum or Adasum;
    gradient_predivide_factor: with Average, gradients are scaled by 1/f before the sum and f/size
    after it; compression: Compression.none / fp16; groups / num_groups: accepted (hybridsync
    fuses every dense gradient of a call into one collective)."""
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
    check_groups(num_groups, groups)
    reducer = GradientReducer("DistributedGradientTape", device_dense, device_sparse, compression, sparse_as_dense,
                              op, gradient_predivide_factor, process_set)
    base = type(gradtape)
    cls = type(base.__name__, (_DistributedGradientTape, base), {"__module__": __name__})
    tape = cls(persistent=gradtape._persistent, watch_accessed_variables=gradtape._watch_accessed_variables)
    tape._tape = gradtape._tape  # what the wrapped tape recorded (None if it has not recorded yet)
    tape._hs_setup(reducer, scale_local_gradients)
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=mpi_ops.Average, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """A DistributedGradientTape whose `local_layers` (Keras layers) keep their own gradients."""
    local_vars = [v for layer in _layers(local_layers) for v in layer.trainable_weights]
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for v in local_vars:
        tape.register_local_source(v)
    return tape


def _layers(local_layers) -> list:
    import keras

    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        return [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    return local_layers
