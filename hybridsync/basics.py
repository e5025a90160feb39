"""Horovod's basic queries that mean the same in every frontend: joining the job (with its
communicator or ranks, and process sets to register), whether MPI allows threads, how the job
was launched, the host layout seen from MPI, and hybridsync's own timeline. The frontends add
what depends on their framework (hybridsync.torch.basics: Horovod's answers when Horovod runs;
hybridsync.tensorflow.basics: what hybridsync's TensorFlow collectives were built with)."""
from __future__ import annotations

from . import process_sets as _sets
from . import runtime
from . import comm, timeline
from . import init as _init
from .settings import launched_by_gloo


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


def mpi_cross_size() -> int:
    """Number of hosts with a rank of this local rank, ranks filling hosts in order as mpirun
    places them (size / local_size)."""
    w = runtime.world()
    return max(1, w.size // w.local_size)


def mpi_cross_rank() -> int:
    """Index of this host among those (see mpi_cross_size)."""
    w = runtime.world()
    return w.rank // w.local_size


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    w = runtime.world()
    if w.size == 1 or w.comm is None:
        return True
    return len(set(comm.objects().allgather_object(w.local_size, name="hybridsync.is_homogeneous"))) == 1


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


def start_hybridsync_timeline(file_path) -> None:
    """hybridsync's Chrome trace of each step's phases (see HYBRIDSYNC_TIMELINE), from now on."""
    if not runtime.is_initialized():
        raise ValueError("hybridsync has not been initialized; use hvd.init().")
    with timeline._lock:  # the same state HYBRIDSYNC_TIMELINE sets at first use
        timeline._close()
        w = runtime.world()
        timeline._timeline, timeline._checked = timeline.Timeline(str(file_path), w.rank, w.size), True
        runtime.on_shutdown(timeline._close)


def stop_hybridsync_timeline() -> None:
    timeline._close()
