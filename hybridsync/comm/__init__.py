"""Dense collective backends, one module each: horovod.py (torch tensors, Horovod's ring
all-reduce and tensor fusion) and mpi.py (any CPU buffer, mpi4py). choose() picks one."""
from __future__ import annotations

import sys

from .. import runtime
from ..settings import BACKENDS, settings


class BackendError(ValueError):
    """An unknown or unusable dense backend was asked for."""


_warned = False


def choose(requested: str | None = None) -> str:
    """The dense backend to use: `requested` (code or YAML), else hybridsync.init(backend=...),
    else HYBRIDSYNC_BACKEND, else Horovod when installed, else MPI (with a one-line warning)."""
    global _warned
    from . import horovod

    name = requested or runtime.default_backend() or settings().backend
    if name is not None and name not in BACKENDS:
        raise BackendError(f"unknown dense backend {name!r} (known: {', '.join(BACKENDS)})")
    if name == "horovod" and not horovod.available():
        raise BackendError("dense backend 'horovod' was requested, but Horovod with PyTorch support is not installed")
    if name == "mpi" and runtime.launched_by_gloo():
        raise BackendError("dense backend 'mpi' needs an MPI launch, but this job was started with `horovodrun --gloo`")
    if name is None:
        name = "horovod" if horovod.available() else "mpi"
        if name == "mpi" and not _warned:
            _warned = True
            print("hybridsync: Horovod is not installed; dense all-reduce uses MPI (mpi4py)", file=sys.stderr)
    return name
