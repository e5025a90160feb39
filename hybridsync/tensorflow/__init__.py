"""TensorFlow 2 / Keras 3 frontend, Horovod-compatible: `import hybridsync.tensorflow as hvd`
runs a script written for horovod.tensorflow unchanged apart from that import (Horovod 0.28.1
itself does not run on Keras 3). Every public name of horovod.tensorflow 0.28.1 is here with
Horovod's meaning; its collectives are TensorFlow ops with Horovod's gradients, over MPI.
Besides: hybridsync's DistributedOptimizer features (parameter-server tables, YAML routes,
explain(), adaptive batch size) through the same optimizer, and PS-backed Embedding layers.
horovod.tensorflow.keras is hybridsync.tensorflow.keras (also importable as hybridsync.keras).

    import hybridsync.tensorflow.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size())), loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])
"""
from __future__ import annotations

from . import keras2_idioms

keras2_idioms.install()

from . import keras_embeddings  # noqa: E402

keras_embeddings.install()  # plain Keras Embeddings' variables know their layer (moved to the PS shards)

from ..planning import explain  # noqa: E402
from ..types import ReduceOp  # noqa: E402
from . import compression, elastic, functions, mpi_ops, util  # noqa: E402
from .adaptive import AdaptiveDataset  # noqa: E402
from .basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,  # noqa: E402
                     init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                     mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size, start_timeline,
                     stop_timeline)
from .callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback  # noqa: E402
from .compression import Compression  # noqa: E402
from .dynamic_embedding import DynamicEmbedding  # noqa: E402
from .embedding import Embedding  # noqa: E402
from .functions import (BroadcastGlobalVariablesHook, allgather_object, broadcast_global_variables,  # noqa: E402
                        broadcast_object, broadcast_object_fn, broadcast_variables)
from .gradient_aggregation import LocalGradientAggregationHelper  # noqa: E402
from .mpi_ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum, _allreduce, _grouped_allreduce,  # noqa: E402
                      _grouped_reducescatter, _reducescatter, add_process_set, allgather, alltoall, barrier,
                      broadcast, broadcast_, check_num_rank_power_of_2, global_process_set, grouped_allgather,
                      handle_average_backwards_compatibility, join, local_rank_op, local_size_op,
                      process_set_included_op, rank_op, remove_process_set, size_op)
from .optimizer_api import DistributedOptimizer  # noqa: E402
from .reductions import allreduce, grouped_allreduce, grouped_reducescatter, reducescatter  # noqa: E402
from .sync_batch_norm import SyncBatchNormalization  # noqa: E402
from .tape import DistributedGradientTape, PartialDistributedGradientTape  # noqa: E402
from .util import _cache, _executing_eagerly, _make_subgraph, refs_to_vars, vars_to_refs  # noqa: E402,F401

__all__ = [
    # the job
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size",
    "rank", "local_rank", "cross_rank", "is_homogeneous", "rank_op", "local_rank_op", "size_op", "local_size_op",
    "process_set_included_op", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    # collectives
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp", "Compression",
    "handle_average_backwards_compatibility", "check_num_rank_power_of_2",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall",
    "reducescatter", "grouped_reducescatter", "join", "barrier",
    "broadcast_variables", "broadcast_global_variables", "BroadcastGlobalVariablesHook", "broadcast_object",
    "broadcast_object_fn", "allgather_object",
    # training
    "DistributedOptimizer", "DistributedGradientTape", "PartialDistributedGradientTape", "SyncBatchNormalization",
    "LocalGradientAggregationHelper", "elastic",
    # hybridsync's own
    "Embedding", "DynamicEmbedding", "explain", "AdaptiveDataset", "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    # modules, as in horovod.tensorflow
    "compression", "functions", "mpi_ops", "util",
]
