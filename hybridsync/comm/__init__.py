"""Dense collective backends, one module each: horovod.py (torch tensors, Horovod's ring
all-reduce and tensor fusion) and mpi.py (any CPU buffer, mpi4py). choose() picks one."""
from __future__ import annotations

import sys

from .. import runtime
from ..settings import BACKENDS, settings


class BackendError(ValueError):
    """An unknown or unusable dense backend was asked for."""


_warned = False
_why: dict[str, str] = {}


def why(name: str) -> str:
    """Why `name` was chosen the last time choose() picked it."""
    return _why.get(name, "")


def horovod_has_spare_cores() -> bool:
    """Horovod's MPI controller thread busy-waits on every rank but the root; it only costs
    nothing when each local rank has a second core for it."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return 2 * runtime.world().local_size <= cores


def choose(requested: str | None = None) -> str:
    """The dense backend to use: `requested` (code or YAML), else hybridsync.init(backend=...),
    else HYBRIDSYNC_BACKEND, else Horovod when installed and each local rank has a spare core
    for its controller thread, else MPI (a one-line warning when Horovod is missing)."""
    global _warned
    from . import horovod

    name = requested or runtime.default_backend() or settings().backend
    if name is not None:
        _why[name] = "requested"
    if name is not None and name not in BACKENDS:
        raise BackendError(f"unknown dense backend {name!r} (known: {', '.join(BACKENDS)})")
    if name == "horovod" and not horovod.available():
        raise BackendError("dense backend 'horovod' was requested, but Horovod with PyTorch support is not installed")
    if name == "mpi" and runtime.launched_by_gloo():
        raise BackendError("dense backend 'mpi' needs an MPI launch, but this job was started with `horovodrun --gloo`")
    if name is None:
        if not horovod.available():
            name, _why["mpi"] = "mpi", "Horovod is not installed"
            if not _warned:
                _warned = True
                print("hybridsync: Horovod is not installed; dense all-reduce uses MPI (mpi4py)", file=sys.stderr)
        elif runtime.launched_by_gloo() or horovod_has_spare_cores():
            name, _why["horovod"] = "horovod", "default"
        else:
            name, _why["mpi"] = "mpi", ("auto: Horovod's MPI controller busy-waits and this host has no spare "
                                        "core per rank (HYBRIDSYNC_BACKEND=horovod forces it)")
    return name
