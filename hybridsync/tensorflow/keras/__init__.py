"""Horovod's Keras API for Keras 3: `import hybridsync.tensorflow.keras as hvd` (or `import
hybridsync.keras as hvd`) runs a script written for horovod.tensorflow.keras / horovod.keras
with only that import switched (Horovod 0.28.1 itself does not run on Keras 3).

DistributedOptimizer takes horovod.tensorflow.keras's arguments, in its order, and hybridsync's
own as keywords after them (config=: routes per variable and the parameter server; adaptive=).
Every public name of horovod.tensorflow.keras 0.28.1 is here, and PartialDistributedOptimizer
of horovod.keras; hybridsync's PS-backed Embedding / DynamicEmbedding and explain() too.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from ...planning import explain  # noqa: F401
from ...process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set  # noqa: F401
from ..basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,  # noqa: F401
                      init, is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                      nccl_built, rank, rocm_built, shutdown, size, start_timeline, stop_timeline)
from ..compression import Compression, codec_name
from ..dynamic_embedding import DynamicEmbedding  # noqa: F401
from ..embedding import Embedding  # noqa: F401
from .. import functions as _functions, reductions as _reductions, optimizer_api as _api
from .. import mpi_ops
from ..mpi_ops import Adasum, Average, Sum  # noqa: F401
# Not in Horovod's Keras module: a Keras user saving on rank 0 needs it with bounded staleness
# (it also lands the parameter server's pushes in flight: docs/staleness.md).
from ..mpi_ops import barrier  # noqa: F401
from ..tape import _layers
from . import callbacks, elastic  # noqa: F401


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True, *, config=None, adaptive=None,
                         backend=None, model=None, named_parameters=None):
    """horovod.tensorflow.keras.DistributedOptimizer: `optimizer` (a Keras 3 optimizer; the same
    object is returned) averages its gradients over the ranks before applying them -- dense ones
    in one fused all-reduce per step, sparse ones all-gathered or, as the config says, on
    hybridsync's parameter server. See hybridsync.tensorflow.DistributedOptimizer for each
    argument; op is Average or Sum."""
    return _api.distributed(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                            compression=compression, sparse_as_dense=sparse_as_dense,
                            gradient_predivide_factor=gradient_predivide_factor, op=op,
                            backward_passes_per_step=backward_passes_per_step,
                            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
                            groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
                            config=config, adaptive=adaptive, backend=backend, model=model,
                            named_parameters=named_parameters)


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=Average, groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True, *, config=None, backend=None):
    """horovod.keras.PartialDistributedOptimizer: a DistributedOptimizer whose `local_layers`
    (Keras layers) keep their own gradients (divided by the number of ranks when
    scale_local_gradients)."""
    local_vars = [v for layer in _layers(local_layers) for v in layer.trainable_weights]
    opt = DistributedOptimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                               compression=compression, sparse_as_dense=sparse_as_dense,
                               gradient_predivide_factor=gradient_predivide_factor, op=op, groups=groups,
                               process_set=process_set, scale_local_gradients=scale_local_gradients, config=config,
                               backend=backend)
    for v in local_vars:
        opt.register_local_var(v)
    return opt


def broadcast_global_variables(root_rank):
    """TensorFlow 1's global variables from root_rank; eagerly (Keras 3) a RuntimeError saying
    what to broadcast instead (hvd.callbacks.BroadcastGlobalVariablesCallback, or
    hybridsync.tensorflow.broadcast_variables(model.variables, root_rank))."""
    return _functions.broadcast_global_variables(root_rank)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """The reduction over the ranks of a tensor-compatible value (Average unless op / average
    say otherwise), as a tensor. `name` names the constant made of `value`."""
    return _reductions.allreduce(tf.constant(value, name=name), average=average, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, op=op, compression=compression)


def allgather(value, name=None):
    """Every rank's value concatenated along dim 0, in rank order."""
    return mpi_ops.allgather(tf.constant(value, name=name))


def broadcast(value, root_rank, name=None):
    """root_rank's value on every rank."""
    return mpi_ops.broadcast(tf.constant(value, name=name), root_rank)


def reducescatter(value, name=None, op=Average):
    """The reduction over the ranks of a value, of which each rank gets its share of dim 0."""
    return _reductions.reducescatter(tf.constant(value, name=name), op=op)


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """Loads a model saved with model.save() and gives it a DistributedOptimizer: the saved one
    (a hybridsync optimizer keeps its saved settings; `compression` replaces its compression) or
    the saved Keras optimizer wrapped, its state kept. Call it on every rank: a model with
    hybridsync.tensorflow.Embedding layers registers their tables on the parameter server (the
    rows come back from the file to the shards). custom_optimizers: optimizer classes the file
    names besides Keras's own; custom_objects: as in keras.models.load_model."""
    if legacy_opts:
        raise NotImplementedError("legacy_opts=True loads keras.optimizers.legacy optimizers, which Keras 3 does not "
                                  "have: load the model with legacy_opts=False")
    objects = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return model
    if hasattr(optimizer, "_hs_settings"):
        optimizer._hs_settings.compression = optimizer._hs_compression = codec_name(compression)
        optimizer._hs_adopt_model(model)  # (its plain Keras Embeddings move to the PS shards, if not yet)
    else:
        DistributedOptimizer(optimizer, compression=compression, model=model)
    return model


__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size",
    "rank", "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
    "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Compression",
    "DistributedOptimizer", "PartialDistributedOptimizer", "broadcast_global_variables", "allreduce", "allgather",
    "broadcast", "reducescatter", "load_model", "callbacks", "elastic",
    "Embedding", "DynamicEmbedding", "explain", "barrier",
]
