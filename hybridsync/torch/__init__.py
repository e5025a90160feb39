"""PyTorch frontend, Horovod-compatible: `import hybridsync.torch as hvd` runs a Horovod
training script unchanged apart from that import."""
from __future__ import annotations

from .. import local_rank, local_size, rank, shutdown, size
from .. import init as _init
from ..plan import explain
from ..types import Average, ReduceOp, Sum
from .compression import Compression
from .embedding import Embedding, EmbeddingBag
from .functions import (allgather, allgather_object, allreduce, allreduce_, allreduce_async_, barrier, broadcast,
                        broadcast_, broadcast_object, broadcast_optimizer_state, broadcast_parameters, poll,
                        synchronize)
from .optimizer import DistributedOptimizer


def init(comm=None, backend: str | None = None) -> None:
    """Joins the job and starts the dense backend (Horovod when installed; see hybridsync.init)."""
    _init(comm, backend)


def is_initialized() -> bool:
    from .. import runtime

    return runtime.is_initialized()


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "DistributedOptimizer", "Compression", "Average", "Sum", "ReduceOp", "Embedding", "EmbeddingBag",
    "allreduce", "allreduce_", "allreduce_async_", "synchronize", "poll", "broadcast", "broadcast_",
    "allgather", "broadcast_object", "allgather_object", "barrier",
    "broadcast_parameters", "broadcast_optimizer_state", "explain",
]
