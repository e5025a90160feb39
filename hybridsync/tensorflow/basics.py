"""Horovod's basic queries for the TensorFlow frontend: the job's layout, and what hybridsync's
TensorFlow collectives were built with. They run over MPI (mpi4py) in host memory, whatever
Horovod is installed for, so Gloo, NCCL, DDL, oneCCL, CUDA and ROCm are all 'not built' here
and a GPU tensor is copied to the host and back."""
from __future__ import annotations

from .. import local_rank, local_size, rank, shutdown, size  # noqa: F401
from ..basics import (gloo_enabled, init, is_homogeneous, is_initialized, mpi_built, mpi_cross_rank,  # noqa: F401
                      mpi_cross_size, mpi_enabled, mpi_threads_supported, start_hybridsync_timeline,
                      stop_hybridsync_timeline)

cross_size = mpi_cross_size
cross_rank = mpi_cross_rank


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    """NCCL's version code when built with it: 0, never."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def start_timeline(file_path, mark_cycles=False) -> None:
    """Starts hybridsync's Chrome trace of each step's phases (see HYBRIDSYNC_TIMELINE)."""
    start_hybridsync_timeline(file_path)


def stop_timeline() -> None:
    stop_hybridsync_timeline()
