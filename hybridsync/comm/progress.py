"""A background thread that moves a backend's asynchronous collectives along while the caller
computes, as Horovod's own background thread does: poll() then only reports, and an op submitted
on a rank that lags its peers is not finished by the time that rank polls it.

The thread sleeps on a condition variable while the backend has nothing in flight (it costs
nothing between steps, and a DistributedOptimizer's verified fused all-reduce never wakes it);
once work is submitted it waits one cycle (Horovod's 1 ms), then calls the backend's non-blocking
`step()`, with a sleep back-off (capped at a cycle) between calls that moved nothing. It is a
daemon thread, and runtime.shutdown() stops it before MPI is finalised.
"""
from __future__ import annotations

import threading
import time

from .. import runtime
from . import mpi_kernels as k

CYCLE_S = 1e-3  # Horovod's default cycle time
_FIRST_PAUSE_S = 20e-6
_STOP_WAIT_S = 5.0  # a step stuck in an agreed collective whose peer is gone ends in ~2.5 s (mpi_kernels)


class ProgressThread:
    """Calls `step()` (-> whether it moved anything; False when the backend was busy on another
    thread) while `has_work()`; started by the first wake()."""

    def __init__(self, name: str, step, has_work):
        self._name, self._step, self._has_work = name, step, has_work
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def wake(self) -> None:
        """Work was submitted (or is awaited): make sure the thread is on it."""
        with self._cond:
            if self._stopped:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
                runtime.on_shutdown(self.stop)
            self._cond.notify()

    def stop(self) -> None:
        """Ends the thread (idempotent); waits for a step under way, a few seconds at most."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_STOP_WAIT_S)

    def _loop(self) -> None:
        k.sleep_while_waiting()  # spinning here would take the GIL and a core from the caller
        pause, fresh = _FIRST_PAUSE_S, True  # (started by a submission)
        while True:
            with self._cond:
                while not self._stopped and not self._has_work():
                    self._cond.wait()
                    pause, fresh = _FIRST_PAUSE_S, True
                if self._stopped:
                    return
            if fresh:
                # One cycle before the first round, as Horovod negotiates what was enqueued
                # during a cycle: what is submitted right behind it (a synchronize(), the rest
                # of a batch, a duplicate name) is negotiated with it, by the caller's own thread.
                time.sleep(CYCLE_S)
                fresh = False
            if self._step():
                pause = _FIRST_PAUSE_S
            else:
                time.sleep(pause)
                pause = min(pause * 2, CYCLE_S)
