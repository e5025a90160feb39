"""Dense collective backends, one module each: horovod.py (Horovod's ring all-reduce and tensor
fusion) and mpi.py (mpi4py, its tensor fusion in buckets.py). Both take NumPy arrays (Horovod also torch tensors); choose()
picks one, backend() makes it once per process, objects() is the one that carries small
Python objects (plan agreement, shared seeds)."""
from __future__ import annotations

import sys
import os
import threading

from .. import runtime
from ..settings import BACKENDS, launched_by_gloo, settings


class BackendError(ValueError):
    """An unknown or unusable dense backend was asked for."""


_warned = False
_why: dict[str, str] = {}


def why(name: str) -> str:
    """Why `name` was chosen the last time choose() picked it."""
    return _why.get(name, "")


def horovod_has_spare_cores(local_size: int | None = None) -> bool:
    """Horovod's MPI controller thread busy-waits on every rank but the root; it only costs
    nothing when each local rank (`local_size` of them, default this job's) has a second core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return 2 * (local_size or runtime.world().local_size) <= cores


def choose(requested: str | None = None, world_size: int | None = None) -> str:
    """The dense backend to use: `requested` (code or YAML), else hybridsync.init(backend=...),
    else HYBRIDSYNC_BACKEND, else Horovod when installed, the job has more than one rank, and
    each local rank has a spare core for its controller thread, else MPI (a one-line warning
    when Horovod is missing). world_size: choose for a job of that many ranks on this host
    instead of this one (an offline plan, `python -m hybridsync explain --world-size N`)."""
    global _warned
    from . import horovod

    size, local_size = (world_size, world_size) if world_size else (runtime.world().size, None)
    name = requested or runtime.default_backend() or settings().backend
    if name is not None:
        _why[name] = "requested"
    if name is not None and name not in BACKENDS:
        raise BackendError(f"unknown dense backend {name!r} (known: {', '.join(BACKENDS)})")
    if name == "horovod" and not horovod.available():
        raise BackendError("dense backend 'horovod' was requested, but Horovod with PyTorch support is not installed")
    if name == "mpi" and launched_by_gloo():
        raise BackendError("dense backend 'mpi' needs an MPI launch, but this job was started with `horovodrun --gloo`")
    if name is None:
        if not horovod.available():
            name, _why["mpi"] = "mpi", "Horovod is not installed"
            if not _warned:
                _warned = True
                print("hybridsync: Horovod is not installed; dense all-reduce uses MPI (mpi4py)", file=sys.stderr)
        elif size == 1 and not launched_by_gloo():
            # Nothing to all-reduce; Horovod's background thread would still cost a single
            # process ~10% of its step (measured: benchmarks/bench.py at 1 rank).
            name, _why["mpi"] = "mpi", "one rank: no all-reduce to run (HYBRIDSYNC_BACKEND=horovod forces Horovod)"
        elif launched_by_gloo() or horovod_has_spare_cores(local_size):
            name, _why["horovod"] = "horovod", "default"
        else:
            name, _why["mpi"] = "mpi", ("auto: Horovod's MPI controller busy-waits and this host has no spare "
                                        "core per rank (HYBRIDSYNC_BACKEND=horovod forces it)")
    return name


_backends: dict = {}
_lock = threading.Lock()


def backend(name: str | None = None):
    """The dense collectives object of backend `name` (chosen by choose()), made once."""
    chosen = choose(name)
    with _lock:
        if chosen not in _backends:
            if chosen == "horovod":
                from .horovod import HorovodCollectives

                _backends[chosen] = HorovodCollectives()
            else:
                from .mpi import MPICollectives

                _backends[chosen] = MPICollectives(runtime.mpi_comm())
                runtime.on_shutdown(lambda: _backends.pop("mpi", None))
        return _backends[chosen]


def objects():
    """The collectives for small Python objects: MPI when the job is an MPI job, else
    Horovod (a `horovodrun --gloo` launch)."""
    return backend("horovod" if runtime.world().comm is None else "mpi")
