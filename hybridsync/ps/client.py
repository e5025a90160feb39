"""The C++ parameter server's engine (hybridsync._ps): one per process.

The Engine is created on first use, on a duplicate of the job's MPI communicator, and freed
at shutdown (after a last barrier: a rank keeps serving its shards until every rank is done).
Its methods are collective (every rank calls them in the same order), one-sided (this rank
alone reads or writes any shard; the owners answer from a serving thread while they compute)
or local. Frameworks reach it only through the tables (hybridsync.ps.table, hybridsync.ps.dynamic).
"""
from __future__ import annotations

import threading

from .. import runtime
from ..settings import settings, wait_spin_us

try:
    from .. import _ps
except ImportError as exc:  # pragma: no cover - a broken install
    raise ImportError(
        "hybridsync's C++ extension (hybridsync._ps) is not built: run `make install` "
        f"(or `pip install -e .` in the repo) ({exc})"
    ) from exc

RemoteError = _ps.RemoteError
TransportError = _ps.TransportError

_engine = None
_lock = threading.Lock()


def engine():
    """This process's PS engine (collective on first call)."""
    global _engine
    with _lock:
        if _engine is None:
            comm = runtime.mpi_comm()
            s = settings()
            # Fragments are cut at this size on both ends of a message: every rank must agree.
            limit = comm.allreduce(s.max_message_bytes, op=_min_op()) if comm.Get_size() > 1 else s.max_message_bytes
            # A peer that is alive but slow is reported after the peer timeout too (stall warning).
            _engine = _ps.Engine(comm, spin_us=wait_spin_us(), max_sleep_us=s.max_sleep_us, timeout_s=s.timeout_s,
                                 peer_timeout_s=s.peer_timeout_s, stall_warning_s=s.peer_timeout_s or 60.0,
                                 max_message_bytes=limit)
            runtime.on_shutdown(_release)
            if s.timeline:
                _engine.set_tracing(True)
        return _engine


_joins = 0


def join(dense_join):
    """hvd.join() with the parameter server: this rank stops taking part in the others' PS calls
    (its shards keep serving them) while `dense_join()` -- the dense backend's own join -- stands
    in for it in their all-reduces; then waits until every rank has joined. Returns what
    dense_join returned."""
    global _joins
    engine = current()
    if engine is None or engine.size == 1:
        return dense_join()
    engine.join_begin()
    last = dense_join()
    engine.join_finish()  # every rank has joined the PS too: all count on from one number
    _joins += 1
    return last


def settle(what: str = "hvd.barrier") -> None:
    """hvd.barrier() with the parameter server (collective, every rank of the job): returns once
    every PS request any rank sent before it is served -- the one-sided pushes of bounded
    tables included, so a read on one rank afterwards (state_dict() on rank 0) holds them all.
    Nothing to do before the engine exists or in a world of one."""
    engine = current()
    if engine is not None and engine.size > 1:
        engine.barrier(what)


def joins() -> int:
    """Joins completed so far (a replica refreshes itself after one: see ReplicatedPS)."""
    return _joins


def _min_op():
    from mpi4py import MPI

    return MPI.MIN


def current():
    """The engine if it was created, else None (never creates it: creating is collective)."""
    return _engine


def _release() -> None:
    global _engine
    with _lock:
        if _engine is not None:
            try:
                if _engine.usable:  # (a failed engine already told its peers)
                    _engine.barrier("shutdown")  # no peer needs this rank's shards any more
            finally:
                _engine.close()  # its serving thread stops before MPI is finalised
                _engine = None
