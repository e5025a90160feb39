"""Python face of the C++ parameter server (hybridsync._ps): one Engine per process.

The Engine is created on first use, on a duplicate of the job's MPI communicator, and freed
at shutdown. All of its methods except the local ones are collective: every rank calls them
in the same order. Frameworks reach it only through hybridsync.sync.table.
"""
from __future__ import annotations

import threading

from . import runtime
from .settings import settings

try:
    from . import _ps
except ImportError as exc:  # pragma: no cover - a broken install
    raise ImportError(
        "hybridsync's C++ extension (hybridsync._ps) is not built: run `make install` "
        f"(or `pip install -e .` in the repo) ({exc})"
    ) from exc

Shard = _ps.Shard
Partitioner = _ps.Partitioner
RemoteError = _ps.RemoteError
TransportError = _ps.TransportError

_engine = None
_lock = threading.Lock()


def wait_spin_us() -> float:
    """How long a waiting rank polls, yielding its core on every poll, before it sleeps.
    Polling with sched_yield costs nothing a co-located rank needs (it runs first), and it
    notices a peer's answer within microseconds, where a sleep wakes up 50-200 us late: at 4 ranks
    on 2 cores, 20 ms of yielding polls ran the benchmark in ~16.5 ms/step against ~19.8 ms
    with sleeping at once."""
    s = settings()
    return s.spin_us if s.spin_us is not None else 20000.0


def engine():
    """This process's PS engine (collective on first call)."""
    global _engine
    with _lock:
        if _engine is None:
            comm = runtime.mpi_comm()
            s = settings()
            # A peer that is alive but slow is reported after the peer timeout too (stall warning).
            _engine = _ps.Engine(comm, spin_us=wait_spin_us(), max_sleep_us=s.max_sleep_us, timeout_s=s.timeout_s,
                                 peer_timeout_s=s.peer_timeout_s, stall_warning_s=s.peer_timeout_s or 60.0)
            runtime.on_shutdown(_release)
            if s.timeline:
                _engine.set_tracing(True)
        return _engine


def current():
    """The engine if it was created, else None (never creates it: creating is collective)."""
    return _engine


def _release() -> None:
    global _engine
    with _lock:
        if _engine is not None:
            try:
                _engine.flush()
            finally:
                _engine = None
