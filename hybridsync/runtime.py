"""This process's place in the job: the MPI world, rank and size, and a clean shutdown.

MPI comes from mpi4py (initialised with MPI_THREAD_MULTIPLE, which the PS needs because
Horovod's background thread talks MPI at the same time). Horovod, when used, is initialised
on the same communicator by hybridsync.comm.horovod.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import uuid

from .settings import gloo_world, launched_by_gloo
from .settings import settings
from . import lost_hosts


class LaunchError(RuntimeError):
    """hybridsync was started in a way that cannot run what was asked."""


class World:
    """Rank, size and communicators of this job."""

    def __init__(self, comm):
        self.comm = comm  # mpi4py communicator, or None under a Gloo-only launch
        if comm is not None:
            from mpi4py import MPI

            self.rank = comm.Get_rank()
            self.size = comm.Get_size()
            self.local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            self.local_rank = self.local_comm.Get_rank()
            self.local_size = self.local_comm.Get_size()
        else:
            self.rank, self.size, self.local_rank, self.local_size = gloo_world()
            self.local_comm = None


_world: World | None = None
_lock = threading.RLock()
_shutdown_hooks: list = []
_default_backend: str | None = None
_default_config = None


def set_default_config(config) -> None:
    """The config DistributedOptimizers use when given none (hybridsync.init(config=...))."""
    global _default_config
    _default_config = config


def default_config():
    return _default_config


def set_default_backend(name: str | None) -> None:
    """The dense backend used where none is named (set by hybridsync.init(backend=...))."""
    global _default_backend
    _default_backend = name


def default_backend() -> str | None:
    return _default_backend


_init_hooks: list = []


def on_init(hook) -> None:
    """A frontend's hook for hybridsync.init(), once the backend is chosen (e.g. the torch
    frontend starts Horovod when it is the backend)."""
    if hook not in _init_hooks:
        _init_hooks.append(hook)


def run_init_hooks() -> None:
    for hook in list(_init_hooks):
        hook()


_TCP_EAGER_BYTES = 4 << 20


def _mpi_defaults() -> None:
    """OpenMPI settings hybridsync wants, as environment defaults (a user's setting wins). They
    must be set before MPI starts -- importing mpi4py.MPI starts it, and the C++ engine imports
    it -- so this runs when hybridsync is imported."""
    # Waiting MPI calls yield the core (OpenMPI turns this on only when oversubscribed):
    # Horovod's MPI controller thread otherwise spins on a core training needs.
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    # Between hosts (TCP), a message above the eager limit moves only while its sender polls MPI,
    # and a rank that answered a pull goes back to computing: PS answers (~0.1-1 MB) then waited
    # for the server's next MPI call. Sent eagerly, they leave at once.
    for param in ("btl_tcp_eager_limit", "btl_tcp_rndv_eager_limit", "btl_tcp_max_send_size"):
        os.environ.setdefault(f"OMPI_MCA_{param}", str(_TCP_EAGER_BYTES))


_mpi_defaults()


def init(comm=None) -> World:
    """Joins the job (idempotent). `comm`: an mpi4py communicator to use instead of COMM_WORLD."""
    global _world
    with _lock:
        if _world is not None:
            return _world
        if launched_by_gloo():
            _world = World(None)
        else:
            from mpi4py import MPI

            _check_thread_level(MPI)
            _world = World(comm if comm is not None else MPI.COMM_WORLD)
            if _world.size > 1:
                _abort_job_on_uncaught_exception(_world.comm)
                _start_heartbeat(_world.comm)
        atexit.register(shutdown)
        return _world


def _check_thread_level(MPI) -> None:
    """The PS serves its shards from a thread of its own and the heartbeat runs in another, while
    Horovod's background thread and the caller use MPI too: MPI must allow every thread to call
    it. mpi4py asks for that by default; a library (or setting) that initialised MPI first with
    less must be told not to."""
    level = MPI.Query_thread()
    if level != MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                 MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
        raise LaunchError(
            f"MPI was initialised with {names.get(level, level)}, but hybridsync needs MPI_THREAD_MULTIPLE (its "
            "parameter server and heartbeat call MPI from threads of their own). Initialise MPI with it: leave "
            "mpi4py.rc.thread_level at its default 'multiple' (or set it to 'multiple' before importing mpi4py.MPI), "
            "unset HOROVOD_MPI_THREADS_DISABLE, and call hybridsync.init() before any other library initialises MPI")


def world() -> World:
    """The joined world; joins it on first use."""
    return _world if _world is not None else init()


def is_initialized() -> bool:
    return _world is not None


def mpi_comm():
    """The mpi4py communicator of the job; an error under a Gloo-only launch."""
    w = world()
    if w.comm is None:
        raise LaunchError(
            "this needs an MPI launch, but the job was started with `horovodrun --gloo`: "
            "launch with `mpirun -np N python ...` or `horovodrun -np N python ...` (without --gloo)"
        )
    return w.comm


def on_shutdown(hook) -> None:
    """Registers `hook()` to run at shutdown(), newest first (e.g. to free the PS)."""
    _shutdown_hooks.append(hook)


def shutdown() -> None:
    """Releases the PS and Horovod. MPI itself is finalised by mpi4py at exit."""
    global _world
    with _lock:
        while _shutdown_hooks:
            hook = _shutdown_hooks.pop()
            try:
                hook()
            except Exception as exc:  # shutting down: report, keep releasing the rest
                print(f"hybridsync: error during shutdown: {exc}", file=sys.stderr)
        if _world is not None and _world.local_comm is not None:
            try:
                _world.local_comm.Free()
            except Exception:
                pass
        _world = None


def _start_heartbeat(comm) -> None:
    """Collective: a C++ thread that tells every peer this rank is alive, so a peer that
    freezes or becomes unreachable is named within HYBRIDSYNC_PEER_TIMEOUT_S instead of hanging
    the job (hybridsync._liveness: csrc/transport/heartbeat.cc)."""
    from . import _liveness
    timeout = settings().peer_timeout_s
    if timeout > 0:
        # The watchdog's limit leaves the waits that check the heartbeat time to raise their
        # own error first; it ends the job where nothing can raise (inside Horovod's collectives).
        abort_after_s = timeout + max(5.0, timeout / 4)
        _liveness.start_heartbeat(comm, min(1.0, max(0.05, timeout / 10)), abort_after_s=abort_after_s)
        on_shutdown(_liveness.stop_heartbeat)
        # The same on every rank, different for every job (two jobs may share a host): one rank
        # per host claims the lost-host advice under it, whichever aborts first.
        global _job_key
        _job_key = comm.bcast(uuid.uuid4().hex if comm.Get_rank() == 0 else None, root=0)
        # Said by the watchdog itself: the rank it runs in may be blocked where Python never runs
        # again.
        _liveness.set_lost_host_last_words(*lost_hosts.watchdog_last_words(timeout, _job_key,
                                                                      backstop=settings().lost_host_backstop))


def _abort_job_on_uncaught_exception(comm) -> None:
    """A rank that dies must end the job: without this, MPI_Finalize at exit waits for peers
    that wait for us, and the job hangs instead of failing."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        sys.stderr.write(f"hybridsync: rank {comm.Get_rank()} failed; aborting the job\n")
        sys.stderr.flush()
        sys.stdout.flush()
        if "heard from" in str(exc):
            _on_lost_peer(exc)
            # A lost peer is seen by every rank at about the same moment: let the others say so
            # too before the job is torn down.
            time.sleep(1.0)
        comm.Abort(1)

    sys.excepthook = hook


def _on_lost_peer(exc) -> None:
    """The excepthook's error names a silent peer: _prepare_for_abort() if it is on another host."""
    lost = lost_hosts.lost_peer(exc)
    if lost is not None:
        _prepare_for_abort(lost[1])


_job_key = ""  # set with the heartbeat (_start_heartbeat)


def _prepare_for_abort(lost_host: str) -> None:
    """A peer on another host went silent and the excepthook is about to abort the job: mpirun
    may then wait ~15 minutes on that host's daemon. Say what the launcher needs (one rank per
    host) and leave the backstop, in place of the heartbeat watchdog's last words."""
    from mpi4py import MPI

    from . import _liveness, lost_hosts
    try:
        lost_hosts.prepare_for_abort(lost_host, MPI.Get_processor_name(), settings().peer_timeout_s,
                                     first_to_advise=lambda: _liveness.first_on_this_host(lost_hosts.advice_claim(_job_key)),
                                     backstop=settings().lost_host_backstop)
        _liveness.set_lost_host_last_words("", "", [], "")  # said and armed: the watchdog must not do it again
    except Exception as err:  # aborting anyway: the abort must not fail on this
        sys.stderr.write(f"hybridsync: could not arm the lost-host backstop: {err}\n")
