"""Horovod's process sets: collectives limited to a subset of the ranks.

A ProcessSet is registered collectively (every rank calls add_process_set with the same ranks,
or passes it to init(process_sets=[...])); its members get an MPI communicator of their own
(hybridsync.comm.mpi.MPICollectives), so its collectives are negotiated among the members only.
They run over MPI whatever the dense backend: Horovod's own process sets must be fixed when
Horovod starts (HOROVOD_DYNAMIC_PROCESS_SETS), and adding them later raced in our tests (a
member saw "Process set does not exist or has not been registered" right after adding it).
As in Horovod, root ranks stay global ranks, and the global set is `global_process_set`.
The registry is shared by every frontend (hybridsync.torch and hybridsync.tensorflow re-export it),
as Horovod's horovod.common.process_sets is.
"""
from __future__ import annotations

import threading

from . import comm, runtime

_lock = threading.Lock()
_registered: dict = {}  # process_set_id -> ProcessSet
_next_id = 1


class ProcessSet:
    """A set of ranks that run collectives together: ProcessSet([0, 2]) (or an mpi4py
    communicator, at init only); pass it as process_set= to the collectives once registered."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            from mpi4py import MPI

            if not isinstance(ranks_or_comm, MPI.Comm):
                raise ValueError("ProcessSet takes a list of ranks or an mpi4py communicator") from None
            self.mpi_comm = ranks_or_comm
        else:
            if any(not isinstance(r, int) for r in ranks):
                raise ValueError("ProcessSet takes a list of integer ranks or an mpi4py communicator")
            self.ranks = ranks
        self._engine = None

    def _invalidate(self):
        self.process_set_id, self._engine = None, None

    def _members(self):
        """The set's ranks (the global set's are the job's, known once it is joined)."""
        if self.process_set_id == 0:
            _ensure_global()
        return self.ranks

    def size(self):
        """Number of ranks in the set (None until registered)."""
        return None if self.process_set_id is None else len(self._members())

    def rank(self):
        """This process's rank within the set (None until registered, -1 if not a member).
        Root ranks of collectives stay global ranks (hvd.rank()), as in Horovod."""
        if self.process_set_id is None:
            return None
        me, ranks = runtime.world().rank, self._members()
        return ranks.index(me) if me in ranks else -1

    def included(self):
        """Whether this process is a member (None if the ranks are not known yet)."""
        return None if self.ranks is None else runtime.world().rank in self._members()

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _ensure_global() -> None:
    if global_process_set.ranks != list(range(runtime.world().size)):
        global_process_set.ranks = list(range(runtime.world().size))


def is_global(process_set) -> bool:
    return process_set is None or process_set is global_process_set or process_set.process_set_id == 0


def engine_of(process_set, what: str = "this collective"):
    """The MPI collectives of a registered, non-global process set this rank belongs to."""
    if process_set.process_set_id is None or _registered.get(process_set.process_set_id) is not process_set:
        raise ValueError(f"{what}: {process_set} was not registered (hvd.add_process_set or "
                         "hvd.init(process_sets=...)), or was removed")
    if process_set._engine is None:
        raise ValueError(f"{what}: this process (rank {runtime.world().rank}) is not part of {process_set}")
    return process_set._engine


def by_id(process_set_id: int):
    """The registered set of this id (the global set for 0), or None."""
    if process_set_id == 0:
        _ensure_global()
        return global_process_set
    return _registered.get(process_set_id)


def by_ranks(ranks):
    """The registered set of exactly these ranks (the global set for every rank), or None."""
    ranks = sorted(int(r) for r in ranks)
    _ensure_global()
    if ranks == global_process_set.ranks:
        return global_process_set
    return next((s for s in _registered.values() if s.ranks == ranks), None)


def _ranks_of_comm(process_set) -> list:
    """Global ranks of a communicator-defined set (collective: members report themselves)."""
    from mpi4py import MPI

    mine = None
    if process_set.mpi_comm is not None and process_set.mpi_comm != MPI.COMM_NULL:
        mine = runtime.world().rank
    return sorted(r for r in comm.backend("mpi").allgather_object(mine, name="process_set.members") if r is not None)


def add_process_set(process_set, _from_init: bool = False):
    """Registers a process set (collective: every rank calls it, in the same order, with the
    same ranks) and returns it, ready for process_set= arguments."""
    global _next_id
    _ensure_global()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        if not _from_init:
            raise NotImplementedError("a process set defined by an MPI communicator can only be given to "
                                      "hvd.init(process_sets=...); build it from a list of ranks instead")
        process_set.ranks = _ranks_of_comm(process_set)
    with _lock:
        if process_set.ranks == global_process_set.ranks or any(
                s.ranks == process_set.ranks for s in _registered.values()):
            raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
        engine = comm.backend("mpi").add_process_set(process_set.ranks)  # negotiated on every rank
        process_set.process_set_id, process_set._engine = _next_id, engine
        _registered[_next_id] = process_set
        _next_id += 1
    return process_set


def remove_process_set(process_set) -> bool:
    """Unregisters a process set (collective, like add_process_set); False for the global set
    or a set that is not registered."""
    if process_set.process_set_id in (None, 0) or _registered.get(process_set.process_set_id) is not process_set:
        return False
    comm.backend("mpi").remove_process_set(process_set.ranks, process_set._engine)
    del _registered[process_set.process_set_id]
    process_set._invalidate()
    return True


def reset() -> None:
    """At shutdown: registered sets become invalid (their communicators are gone)."""
    for process_set in list(_registered.values()):
        process_set._invalidate()
    _registered.clear()
