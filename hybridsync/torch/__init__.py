"""PyTorch frontend, Horovod-compatible: `import hybridsync.torch as hvd` runs a Horovod PyTorch
script unchanged apart from that import. Every public name of horovod.torch 0.28.1 is here with
Horovod's meaning (except its build internals mpi_lib_v2 and check_extension), plus hybridsync's
own: the hybrid DistributedOptimizer, PS-backed Embedding/EmbeddingBag, explain()."""
from __future__ import annotations

import sys as _sys

from .. import local_rank, local_size, rank, shutdown, size
from ..planning import explain
from ..types import ReduceOp
from .horovod import basics, compression, elastic, functions, mpi_ops, process_sets, sync_batch_norm
from . import optimizer
from .horovod.basics import (HorovodInternalError, ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                     gloo_enabled, init, is_initialized, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                     rocm_built, start_timeline, stop_timeline)
from .horovod.compression import Compression
from .dynamic_embedding import DynamicEmbedding
from .embedding import Embedding, EmbeddingBag
from .horovod.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .horovod.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allreduce, allreduce_,
                      allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_,
                      broadcast_async, broadcast_async_, grouped_allgather, grouped_allgather_async, grouped_allreduce,
                      grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                      grouped_reducescatter_async, join, poll, reducescatter, reducescatter_async,
                      sparse_allreduce_async, synchronize)
from .adaptive import AdaptiveDataLoader
from .optimizer import DistributedOptimizer
from .horovod.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .horovod.sync_batch_norm import SyncBatchNorm

# Horovod's module paths (`from horovod.torch.mpi_ops import ...` with the import switched).
for _module in (basics, compression, elastic, functions, mpi_ops, sync_batch_norm, process_sets):
    _sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module

__all__ = [
    # the job
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "HorovodInternalError",
    # collectives
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp", "Compression",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "sparse_allreduce_async", "allgather", "allgather_async",
    "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "join", "barrier", "poll", "synchronize",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    # training
    "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "allgather_object", "SyncBatchNorm", "elastic", "DynamicEmbedding", "Embedding", "EmbeddingBag", "explain",
    "AdaptiveDataLoader",
    # modules, as in horovod.torch
    "compression", "functions", "mpi_ops", "optimizer", "sync_batch_norm",
]
