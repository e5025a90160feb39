"""Horovod's basic queries: joining the job, the job's layout, what the library was built with,
and the timeline. Horovod's own answers where Horovod is installed (what it was built with is
a fact about it); hybridsync's MPI world otherwise."""
from __future__ import annotations

from ... import comm, runtime
from ... import init as _init
from ... import timeline
from ...comm import horovod as hvd_backend
from ...elastic import HorovodInternalError  # noqa: F401  (Horovod's own class where it is installed)
from ...settings import launched_by_gloo
from . import process_sets as _sets


def init(comm=None, process_sets=None, backend: str | None = None) -> None:
    """Joins the job and starts the dense backend (see hybridsync.init).

    comm: an mpi4py communicator, or (as in Horovod) a list of ranks of MPI_COMM_WORLD that
    form the job. process_sets: ProcessSet objects to register now (all ranks, same order), or
    'dynamic' (accepted: sets can always be added later with add_process_set)."""
    _init(_as_comm(comm), backend)
    runtime.on_shutdown(_sets.reset)  # registered sets die with their communicators
    if process_sets is not None and not (isinstance(process_sets, str) and process_sets.lower() == "dynamic"):
        for process_set in process_sets:
            _sets.add_process_set(process_set, _from_init=True)


def _as_comm(value):
    if value is None or not isinstance(value, (list, tuple, range)):
        return value
    from mpi4py import MPI

    ranks = sorted(int(r) for r in value)
    if MPI.COMM_WORLD.Get_rank() not in ranks:
        raise ValueError(f"init(comm={ranks}): this process (MPI_COMM_WORLD rank {MPI.COMM_WORLD.Get_rank()}) "
                         "is not in the given ranks")
    return MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl(ranks))


def is_initialized() -> bool:
    return runtime.is_initialized()


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
    w = runtime.world()
    return hvd.cross_size() if hvd else max(1, w.size // w.local_size)


def cross_rank() -> int:
    """Index of this host among those (see cross_size)."""
    hvd = _horovod_running()
    w = runtime.world()
    return hvd.cross_rank() if hvd else w.rank // w.local_size


def mpi_threads_supported() -> bool:
    if launched_by_gloo():
        return False
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """Whether collectives run over MPI in this job (an MPI launch; not `horovodrun --gloo`)."""
    return runtime.world().comm is not None


def mpi_built() -> bool:
    return True  # mpi4py is a requirement


def gloo_enabled() -> bool:
    return launched_by_gloo()


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
    if not runtime.is_initialized():
        raise ValueError("hybridsync has not been initialized; use hvd.init().")
    with timeline._lock:  # the same state HYBRIDSYNC_TIMELINE sets at first use
        timeline._close()
        w = runtime.world()
        timeline._timeline, timeline._checked = timeline.Timeline(str(file_path), w.rank, w.size), True
        runtime.on_shutdown(timeline._close)


def stop_timeline() -> None:
    hvd = _horovod_running()
    if hvd is not None:
        return hvd.stop_timeline()
    timeline._close()


def _start_horovod_when_chosen() -> None:
    # (hybridsync.init() with torch's frontend imported: Horovod joins the job at once, as
    # horovod.torch's init would, rather than at its first collective)
    if comm.choose() == "horovod":
        hvd_backend.module()


runtime.on_init(_start_horovod_when_chosen)
