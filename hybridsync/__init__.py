"""hybridsync: hybrid synchronization for distributed training.

Dense gradients go through all-reduce (Horovod, or MPI via mpi4py); sparse embedding
gradients go to a C++ parameter server whose shards live on the ranks.
"""
import sys

from . import runtime
from .runtime import is_initialized, shutdown

__version__ = "0.1.0"


def init(comm=None) -> None:
    """Joins the job: MPI through mpi4py (`comm` replaces COMM_WORLD), and Horovod on the same
    communicator when torch is already imported and Horovod is installed (otherwise Horovod
    starts when the PyTorch frontend first needs it). Idempotent."""
    runtime.init(comm)
    if "torch" in sys.modules:
        from .comm import horovod

        if horovod.available():
            horovod.module()


def rank() -> int:
    """This process's rank in the job (joins the job on first use)."""
    from .runtime import world

    return world().rank


def size() -> int:
    """Number of processes in the job."""
    from .runtime import world

    return world().size


def local_rank() -> int:
    """Rank among the processes on this host."""
    from .runtime import world

    return world().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    from .runtime import world

    return world().local_size


__all__ = ["init", "is_initialized", "shutdown", "rank", "size", "local_rank", "local_size"]
