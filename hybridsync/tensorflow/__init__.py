"""TensorFlow 2 / Keras 3 frontend: the same DistributedOptimizer, parameter server and YAML
config as PyTorch, for model.fit and tf.GradientTape loops.

    import hybridsync.tensorflow as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adagrad(0.05)), loss=...,
                  jit_compile=False)
    model.fit(x, y, callbacks=[hvd.BroadcastGlobalVariablesCallback(0), hvd.MetricAverageCallback()])
"""
from __future__ import annotations

from .. import init, local_rank, local_size, rank, shutdown, size
from ..planning import explain
from ..types import Average, ReduceOp, Sum
from . import elastic
from .adaptive import AdaptiveDataset
from .callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback
from .dynamic_embedding import DynamicEmbedding
from .embedding import Embedding
from .functions import allgather, allreduce, broadcast_object, broadcast_variables
from .optimizer import DistributedOptimizer
from .tape import DistributedGradientTape

__all__ = [
    "AdaptiveDataset",
    "init", "shutdown", "rank", "size", "local_rank", "local_size", "DistributedOptimizer", "DistributedGradientTape",
    "broadcast_variables", "allreduce", "allgather", "broadcast_object", "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback", "Average", "Sum", "ReduceOp", "explain", "DynamicEmbedding", "Embedding", "elastic",
]
