"""Horovod as the dense backend: ring all-reduce with tensor fusion, run by Horovod's own
background thread, on the job's MPI communicator (or Gloo under `horovodrun --gloo`)."""
from __future__ import annotations

import importlib.util
import threading

from .. import runtime

_lock = threading.Lock()


def available() -> bool:
    """Whether a Horovod built for PyTorch is installed."""
    try:
        return importlib.util.find_spec("horovod.torch") is not None
    except (ImportError, ValueError):
        return False


def module():
    """horovod.torch, initialised on the job's communicator (once)."""
    import horovod.torch as hvd

    with _lock:
        if not hvd.is_initialized():
            world = runtime.world()
            if world.comm is not None:
                hvd.init(comm=world.comm)
            else:
                hvd.init()
            runtime.on_shutdown(hvd.shutdown)
    return hvd

