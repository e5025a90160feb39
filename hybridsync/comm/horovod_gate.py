"""The gate user-called collectives pass before Horovod runs them (see hybridsync.comm.horovod).

Horovod's coordinator matches collectives by name only: a name one rank never submits, or one a
rank submits twice, leaves the others waiting forever (or until HOROVOD_STALL_SHUTDOWN_TIME_SECONDS
shuts Horovod down, whole seconds later, with a message that names neither). The gate is the MPI
backend's negotiation (hybridsync.comm.mpi.MPICollectives, on a communicator of its own) with
Horovod doing the data movement: a collective is submitted here, the ranks agree on every rank's
in-flight list at the next wait or poll (one 16-byte all-gather when they agree), and only what
every rank submitted identically is handed to Horovod -- in name order, with the same name on
every rank. A mismatch of any kind raises on every rank, naming the collective and the ranks.

An async collective starts (negotiates, then goes to Horovod) at the first wait or poll of any
collective, not at submission (the MPI backend's progress thread is not used here: Horovod's ops
would then be started from a thread of ours).
"""
from __future__ import annotations

import time

from .mpi import DuplicateNameError, MPICollectives
from .negotiation import DUPLICATE, CollectiveMismatchError

_OBJECT_KINDS = ("broadcast_object", "allgather_object")  # pickled objects: moved by the gate itself


def _start_join(hvd):
    """Horovod's join(), started without waiting (horovod.torch.join blocks): its handle."""
    import torch
    from horovod.torch import mpi_ops

    output = torch.tensor(-1, dtype=torch.int)
    handle = mpi_ops.mpi_lib.horovod_torch_join(output, -1)
    mpi_ops._handle_map[handle] = (None, output)
    return handle


class HorovodGate(MPICollectives):
    """Negotiates collectives over MPI, then starts each agreed one in Horovod.

    submit(kind, name, start, ...) takes `start(name) -> Horovod handle` as the payload (or the
    object for broadcast_object / allgather_object, moved here over MPI, pickled); a handle's
    result, once synchronize() returns it, is the started Horovod handle."""

    background = False  # agreed at the next wait or poll, on the caller's thread (Horovod's own runs them)

    def __init__(self, comm, hvd, error_class):
        super().__init__(comm, fast_path=False)
        self.hvd = hvd
        self._error_class = error_class  # () -> the class mismatches are raised as (Horovod's too)
        self._in_horovod: dict = {}  # name -> Horovod handle the gate started, not waited for yet

    def submit(self, kind, name, payload=None, **kw):
        started = self._in_horovod.get(name) if name is not None else None
        if started is not None and not self.hvd.poll(started):
            # Still running in Horovod, which would refuse it on this rank only: refused on all.
            self._poison[name] = kind
            raise DuplicateNameError(f"{kind} '{name}' was submitted on rank {self.rank} while one with that name "
                                     "is still in flight; names of in-flight collectives must be unique")
        return super().submit(kind, name, payload, **kw)

    def finished(self, name, started) -> None:
        """The Horovod collective `started` under `name` was waited for."""
        if self._in_horovod.get(name) is started:
            del self._in_horovod[name]

    def synchronize(self, handle):
        try:
            return super().synchronize(handle)
        except CollectiveMismatchError as exc:
            cls = self._error_class()
            if isinstance(exc, cls):
                raise
            raise cls(str(exc)) from None

    def _run(self, descs) -> None:
        # The same agreed list, in the same order, on every rank: start each in Horovod.
        for d in descs:
            if d.kind == DUPLICATE:
                continue
            handle = self._pending.pop(d.name, None)
            if handle is None:
                continue  # this rank called join(): Horovod's join contributes its zeros
            try:
                if d.kind in _OBJECT_KINDS:
                    handle.result = getattr(self, f"_run_{d.kind}")(d, handle.payload)
                elif handle.payload is not None:  # (a barrier is complete once agreed)
                    handle.result = handle.payload(d.name)
                    self._in_horovod[d.name] = handle.result
            except Exception as exc:  # Horovod refused it here: raised at this rank's wait
                handle.error = exc
            handle.done = True

    def progress_until(self, done) -> None:
        """While waiting for a collective that bypassed the gate (an optimizer's all-reduce),
        keep negotiating the gate's: a peer may wait for one of them before it submits what
        this rank waits for (Horovod would run both in the background)."""
        sleep_s = 1e-5
        while (self._pending or self._round is not None) and not done():
            self._progress(block=False)
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, 2e-4)

    def join(self) -> int:
        """Horovod's join: what was submitted before runs first; then this rank stands in
        Horovod's join (zeros for the others' all-reduces) and in the gate's (agreeing to them)
        until every rank has joined. Returns the rank that joined last."""
        for handle in list(self._pending.values()):
            self.synchronize(handle)
        started = _start_join(self.hvd)
        last = super().join()
        # The gate's answer, not Horovod's: the gate can tell a rank that the others joined before
        # their joins reach Horovod's coordinator, and two joins arriving there in one cycle can
        # name the earlier one as last (Horovod's test_horovod_join_* failed that way here).
        self.hvd.synchronize(started)
        return last
