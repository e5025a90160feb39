"""Horovod's basic queries: joining the job, the job's layout, what the library was built with,
and the timeline. Horovod's own answers where Horovod is installed (what it was built with is
a fact about it); hybridsync's MPI world otherwise."""
from __future__ import annotations

from ... import comm, runtime
from ...basics import (gloo_enabled, init, is_initialized, mpi_built, mpi_cross_rank, mpi_cross_size,  # noqa: F401
                      mpi_enabled, mpi_threads_supported, start_hybridsync_timeline, stop_hybridsync_timeline)
from ...comm import horovod as hvd_backend
from ...elastic import HorovodInternalError  # noqa: F401  (Horovod's own class where it is installed)


def _horovod_running():
    """horovod.torch when Horovod runs the global set, else None."""
    if comm.choose() == "horovod":
        return hvd_backend.module()
    return None


def _horovod_installed():
    if not hvd_backend.available():
        return None
    import horovod.torch as hvd

    return hvd


def cross_size() -> int:
    """Number of hosts with a rank of this local rank (Horovod's; else size / local_size,
    ranks filling hosts in order as mpirun places them)."""
    hvd = _horovod_running()
    return hvd.cross_size() if hvd else mpi_cross_size()


def cross_rank() -> int:
    """Index of this host among those (see cross_size)."""
    hvd = _horovod_running()
    return hvd.cross_rank() if hvd else mpi_cross_rank()


def _built(flag: str, default):
    hvd = _horovod_installed()
    return getattr(hvd, flag)() if hvd is not None else default


def gloo_built() -> bool:
    return _built("gloo_built", False)


def nccl_built() -> int:
    """NCCL's version code if Horovod was built with it, else 0."""
    return _built("nccl_built", 0)


def ddl_built() -> bool:
    return _built("ddl_built", False)


def ccl_built() -> bool:
    return _built("ccl_built", False)


def cuda_built() -> bool:
    return _built("cuda_built", False)


def rocm_built() -> bool:
    return _built("rocm_built", False)


def start_timeline(file_path, mark_cycles=False) -> None:
    """Starts recording a timeline: Horovod's (it needs HOROVOD_TIMELINE=DYNAMIC) when Horovod
    runs, else hybridsync's Chrome trace of each step's phases (see HYBRIDSYNC_TIMELINE)."""
    hvd = _horovod_running()
    if hvd is not None:
        return hvd.start_timeline(file_path, mark_cycles)
    start_hybridsync_timeline(file_path)


def stop_timeline() -> None:
    hvd = _horovod_running()
    if hvd is not None:
        return hvd.stop_timeline()
    stop_hybridsync_timeline()


def _start_horovod_when_chosen() -> None:
    # (hybridsync.init() with torch's frontend imported: Horovod joins the job at once, as
    # horovod.torch's init would, rather than at its first collective)
    if comm.choose() == "horovod":
        hvd_backend.module()


runtime.on_init(_start_horovod_when_chosen)
