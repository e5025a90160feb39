"""Dense collectives over MPI (mpi4py) on NumPy buffers, with Horovod's semantics.

Collectives are submitted (allreduce with Sum/Average/Min/Max/Product and pre/post scaling,
allgather, broadcast, alltoall, reducescatter, barrier, objects) and run in the background, as
Horovod's are: a progress thread (hybridsync.comm.progress) negotiates and runs them while the
caller computes, and synchronize() drives them itself on the calling thread. poll() only reports.
One lock serialises everything that advances the negotiation (rounds, agreed collectives, join),
so this communicator's MPI calls keep the same order on every rank whichever thread issues them.
Before data moves the ranks negotiate, as Horovod's
coordinator does (hybridsync.comm.negotiation): one small all-gather of a fingerprint of every
rank's in-flight list, and only when fingerprints differ (or a rank joined) a second exchange of
the full descriptors. Agreed collectives run in name order, so every rank issues the same MPI
calls whatever order it submitted them in; a mismatch raises on every rank instead of hanging or
corrupting memory. All-reduces that run together are fused into buckets.

The one exception is a DistributedOptimizer's own fused all-reduce once its plan was verified
across ranks (verified_layout=True): it skips the negotiation (the measured fast path) and runs
on a communicator of its own per layout, where a rank that called join() contributes zeros.
"""
from __future__ import annotations

import collections
import hashlib
import threading
import time

import numpy as np
from mpi4py import MPI

from .buckets import check_buffer
from . import mpi_kernels as k
from .mpi_kernels import wait_all
from .negotiation import DUPLICATE, CollectiveMismatchError, Desc, analyze, digest, op_name
from .progress import CYCLE_S, ProgressThread

__all__ = ["MPICollectives", "CollectiveMismatchError", "DuplicateNameError", "wait_all", "op_name"]


class DuplicateNameError(CollectiveMismatchError, ValueError):
    """A collective was submitted under the name of one still in flight (Horovod: ValueError)."""


def _layout_digest(layout) -> int:
    return int.from_bytes(hashlib.blake2b(repr(layout).encode(), digest_size=8).digest(), "little") >> 1


class Handle:
    """One submitted collective: `result` once `done`, or `error` to raise."""

    __slots__ = ("desc", "payload", "result", "done", "error")

    def __init__(self, desc, payload):
        self.desc, self.payload, self.result, self.done, self.error = desc, payload, None, False, None

    @property
    def array(self):
        return self.result


class _Round:
    """One negotiation exchange as this rank posted it. Everything it tells the others is read
    together, at post time: `entries`, whether this rank had joined, and `waiting`, the collective
    a caller on this rank is blocked on when it is one of `entries` (a wait that began later is
    for the next round to report, with that op among its entries)."""

    __slots__ = ("request", "entries", "joined", "waiting", "everyone", "mine", "next_check")


_MAX_FAST_LAYOUTS = 32  # communicators kept for verified layouts; further layouts are negotiated


class _FastPath:
    """Verified fused all-reduces (a DistributedOptimizer's, once its plan was agreed): no
    negotiation, and one communicator per layout, so a rank that called join() can stand ready
    with zeros for every optimizer's next step at once."""

    def __init__(self, comm, size):
        self.parent, self.size = comm.Dup(), size
        # The hook thread starts rounds (start()) while the progress thread reads the counts
        # (counts()): _lock guards layouts and rounds; no MPI call is made under it.
        self._lock = threading.Lock()
        self.layouts: dict = {}  # digest -> (communicator, shapes, key)
        self.rounds = collections.Counter()  # digest -> rounds this rank took part in (run or posted)
        self.posted: dict = {}  # digest -> [(requests, buffers)]: this joined rank's zeros in flight

    def reduce(self, arrays, keys, while_waiting=None) -> bool:
        started = self.start(arrays, keys)
        if started is None:
            return False
        k.wait(started[1], while_waiting=while_waiting, comm=self.parent)
        k.finish_buckets(self.size, started[0])
        return True

    def start(self, arrays, keys):
        """Posts one fused round; (buckets, requests), or None when no layout is left."""
        shapes = tuple((a.dtype.str, a.shape) for a in arrays)
        digest_ = _layout_digest((shapes, keys[0]))
        with self._lock:
            entry = self.layouts.get(digest_)
            if entry is None and len(self.layouts) >= _MAX_FAST_LAYOUTS:
                return None
        if entry is None:
            # Collective, and safe here: every rank reaches an optimizer's first verified step
            # together, right after agreeing on its plan (which a joined rank refuses).
            entry = (self.parent.Dup(), shapes, keys[0])
            with self._lock:
                self.layouts[digest_] = entry
        with self._lock:
            self.rounds[digest_] += 1
        return k.start_buckets(entry[0], self.size, arrays, keys)

    def counts(self) -> dict:
        """digest -> rounds this rank took part in so far (a copy, safe from any thread)."""
        with self._lock:
            return dict(self.rounds)

    def _post(self, digest_) -> None:
        with self._lock:
            comm, shapes, key = self.layouts[digest_]
        self.posted.setdefault(digest_, []).append(k.post_zero_buckets(comm, shapes, key))
        with self._lock:
            self.rounds[digest_] += 1

    def requests(self) -> list:
        return [r for groups in self.posted.values() for requests, _ in groups for r in requests]

    def stand_ready(self) -> None:
        """One zero round in flight for every layout: done ones mean the others ran a step."""
        with self._lock:
            digests = list(self.layouts)
        for digest_ in digests:
            groups = [g for g in self.posted.get(digest_, []) if not MPI.Request.Testall(g[0])]
            self.posted[digest_] = groups
            if not groups:
                self._post(digest_)

    def finish(self, targets: dict) -> None:
        """Every rank has joined: each brings its rounds of every layout up to the most any rank
        took part in (the k-th rounds pair up on each layout's communicator), then waits."""
        for digest_, target in targets.items():
            with self._lock:
                known, done = digest_ in self.layouts, self.rounds[digest_]
            if not known:
                raise RuntimeError("join: another rank ran a fused all-reduce this rank never saw")
            for _ in range(target - done):
                self._post(digest_)
        k.wait(self.requests(), comm=self.parent)
        self.posted.clear()

    def free(self) -> None:
        for comm, _, _ in self.layouts.values():
            comm.Free()
        self.parent.Free()


class MPICollectives:
    """Collectives of one communicator (the job's, or a process set's: `ranks` are the global
    ranks of its members, which root ranks refer to, as in Horovod)."""

    name = "mpi"
    background = True  # a progress thread runs async collectives (False: at the next wait or poll)

    def __init__(self, comm, ranks=None, fast_path=True):
        self.comm = comm.Dup()  # our own channel: never matches the user's or the PS's messages
        self.size, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        self.ranks = list(ranks) if ranks is not None else list(range(self.size))
        self._fast = _FastPath(self.comm, self.size) if fast_path else None
        self._pending: dict[str, Handle] = {}
        self._poison: dict[str, str] = {}  # names submitted twice (reported at the next round)
        self._unnamed = collections.Counter()
        self._round = None  # an exchange posted and not finished yet
        self._joined_at = None
        self._rounds_joined = 0
        # _progress_lock: held by whichever thread advances the negotiation (it issues MPI calls
        # on self.comm). _table_lock: the in-flight table and the waits on it (_pending,
        # _poison, _blocked_on), so that submitting never waits for a collective the progress
        # thread is running.
        self._progress_lock = threading.RLock()
        self._table_lock = threading.Lock()
        self._blocked_on: list[Handle] = []  # what synchronize() calls on this rank wait for
        self._completed = 0  # ops finished so far (the progress thread backs off while it stays put)
        self._last_submit = 0.0  # when the newest op was submitted
        self._first_unposted = None  # when the oldest op not in any round yet was submitted
        self._thread = (ProgressThread(f"hybridsync-mpi-progress-{id(self):x}", self._background_step,
                                       lambda: bool(self._pending or self._poison)) if self.background else None)

    # -- submitting -----------------------------------------------------------------------------
    def submit(self, kind, name, payload=None, *, dtype="", shape=(), root=-1, op="", scales=(1.0, 1.0)) -> Handle:
        if kind.startswith("broadcast") and root not in self.ranks:
            raise ValueError(f"{kind} '{name}': root rank {root} is not one of the ranks {self.ranks}")
        if name is None:  # numbered after every local check, so the numbers agree across ranks
            name = f"{kind}.noname.{self._unnamed[kind]}"
            self._unnamed[kind] += 1
        desc = Desc(kind, name, dtype, tuple(int(x) for x in shape), int(root), op,
                    (float(scales[0]), float(scales[1])))
        with self._table_lock:
            if name in self._pending:
                self._poison[name] = kind
                raise DuplicateNameError(f"{kind} '{name}' was submitted on rank {self.rank} while one with that "
                                         "name is still in flight; names of in-flight collectives must be unique")
            handle = self._pending[name] = Handle(desc, payload)
            self._last_submit = time.perf_counter()
            if self._first_unposted is None:
                self._first_unposted = self._last_submit
        if self._thread is not None:
            self._thread.wake()
        return handle

    def _complete(self, handle, result=None, error=None) -> None:
        """Out of the in-flight table first: a caller that sees `done` may reuse the name at once."""
        with self._table_lock:
            if self._pending.get(handle.desc.name) is handle:
                del self._pending[handle.desc.name]
        handle.result, handle.error = result, error
        handle.done = True
        self._completed += 1

    def allreduce_async_(self, buf, name=None, op="average", prescale_factor=1.0, postscale_factor=1.0,
                         verified_layout=False, dtype=None):
        """In place. (verified_layout is accepted for the optimizer's interface; every
        collective submitted here is negotiated.)"""
        array = check_buffer(buf, name or "a tensor")
        opn = op_name(op)
        if opn == "adasum":
            k.check_adasum(name or "a tensor", array.dtype, self.size)
        if array.dtype == np.bool_:
            raise TypeError(f"allreduce '{name}': bool tensors cannot be reduced (as in Horovod)")
        return self.submit("allreduce", name, array, dtype=dtype or k.label(array.dtype), shape=array.shape, op=opn,
                           scales=(prescale_factor, postscale_factor))

    def allgather_async(self, buf, name=None, dtype=None):
        array = np.ascontiguousarray(buf)
        if array.ndim == 0:
            raise ValueError(f"allgather '{name}': needs a tensor with at least one dimension (it concatenates dim 0)")
        return self.submit("allgather", name, array, dtype=dtype or k.label(array.dtype), shape=array.shape)

    def broadcast_async_(self, buf, root_rank, name=None, dtype=None):
        array = check_buffer(buf, name or "a tensor")
        return self.submit("broadcast", name, array, dtype=dtype or k.label(array.dtype), shape=array.shape,
                           root=root_rank)

    def alltoall_async(self, buf, splits=None, name=None, dtype=None):
        array = np.ascontiguousarray(buf)
        rows = array.shape[0] if array.ndim else 0
        if splits is None:
            if array.ndim == 0 or rows % self.size:
                raise ValueError(f"alltoall '{name}': dim 0 ({rows}) must divide evenly by {self.size} ranks "
                                 "when no splits are given")
            splits = [rows // self.size] * self.size
        splits = np.asarray(splits, dtype=np.int64).reshape(-1)
        if len(splits) != self.size or (splits < 0).any() or splits.sum() != rows:
            raise ValueError(f"alltoall '{name}': splits {splits.tolist()} must be {self.size} non-negative counts "
                             f"summing to dim 0 ({rows})")
        return self.submit("alltoall", name, (array, splits), dtype=dtype or k.label(array.dtype), shape=array.shape)

    def reducescatter_async(self, buf, name=None, op="average", prescale_factor=1.0, postscale_factor=1.0,
                            dtype=None):
        array = np.array(buf, copy=True, order="C")  # scaled in place below
        opn = op_name(op)
        if opn == "adasum":
            raise NotImplementedError(f"reducescatter '{name}': op=Adasum is an all-reduce only (as in Horovod)")
        if array.ndim == 0:
            raise ValueError(f"reducescatter '{name}': needs a tensor with at least one dimension")
        return self.submit("reducescatter", name, array, dtype=dtype or k.label(array.dtype), shape=array.shape, op=opn,
                           scales=(prescale_factor, postscale_factor))

    # -- waiting --------------------------------------------------------------------------------
    def synchronize(self, handle):
        if not handle.done:
            with self._table_lock:  # the rounds posted from now on say so (deadlock check)
                self._blocked_on.append(handle)
            try:
                while not handle.done:
                    with self._progress_lock:
                        if not handle.done:
                            self._progress(block=True)
            finally:
                with self._table_lock:
                    self._blocked_on.remove(handle)
        if handle.error is not None:
            raise handle.error
        return handle.result

    def poll(self, handle) -> bool:
        """Whether `handle` has finished. Only reports: the progress thread does the work, so a
        rank that lags its peers still finds a just-submitted op unfinished, as under Horovod.
        (Without one, a non-blocking step of progress, then the state.)"""
        if handle.done:
            return True
        if self._thread is None:
            with self._progress_lock:
                self._progress(block=False)
            return handle.done
        self._thread.wake()
        time.sleep(0)  # a loop of polls holds the GIL: let the progress thread have it
        return False

    def _background_step(self) -> bool:
        """The progress thread's non-blocking step: True when an op finished. An error is handed
        to every op in flight, for synchronize() to raise, instead of ending the thread. While a
        synchronize() drives the negotiation itself, the thread stands aside (it would only take
        the GIL from it at the moment its collective completes)."""
        if not self._progress_lock.acquire(blocking=False):
            return False
        try:
            if self._round is None and self._first_unposted is not None:
                # Ops still being submitted (a batch, a duplicate name, a synchronize() right
                # behind): negotiate them together once submissions pause for a cycle.
                now = time.perf_counter()
                if now - self._last_submit < CYCLE_S and now - self._first_unposted < 10 * CYCLE_S:
                    return False
            before = self._completed
            try:
                self._progress(block=False)
                return self._completed != before
            except Exception as err:  # e.g. PeerLostError out of an agreed collective's wait
                self._round = None
                with self._table_lock:
                    failed = list(self._pending.values())
                    self._poison.clear()
                for handle in failed:
                    self._complete(handle, error=err)
                return True
        finally:
            self._progress_lock.release()

    def _progress(self, block: bool) -> bool:
        """One round of negotiation (and the collectives it agrees on); False when not block
        and the round has not completed yet. The caller holds _progress_lock."""
        if self.size == 1:
            with self._table_lock:
                self._poison.clear()
                descs = sorted((h.desc for h in self._pending.values()), key=lambda d: d.name)
            self._run(descs)
            return True
        if self._round is None:
            if not (self._pending or self._poison):
                return False  # finished meanwhile (by the other thread)
            self._round = self._post_round()
        if block:
            k.wait([self._round.request], comm=self.comm)
        elif not self._round.request.Test():
            now = time.perf_counter()
            if now > self._round.next_check:  # (the progress thread's) a lost peer fails the ops, not a hang
                self._round.next_check = now + k.PEER_CHECK_S
                k.raise_if_a_peer_is_lost(self.comm)
            return False
        rnd, self._round = self._round, None
        self._finish_round(rnd)
        return True

    def _post_round(self) -> _Round:
        with self._table_lock:
            entries = [h.desc for h in self._pending.values()] + [Desc(DUPLICATE, n, kind)
                                                                   for n, kind in self._poison.items()]
            poisoned = bool(self._poison)
            self._first_unposted = None
            # Blocked on an op of this very round (still in flight, so among `entries`); the
            # newest wait when several threads wait.
            waits = [h for h in self._blocked_on if self._pending.get(h.desc.name) is h]
        rnd = _Round()
        rnd.entries = sorted(entries, key=lambda d: (d.name, d.kind == DUPLICATE))
        rnd.joined = self._joined_at is not None
        rnd.waiting = "join" if rnd.joined else (waits[-1].desc.label() if waits else None)
        flags = (1 if rnd.joined else 0) | (2 if poisoned else 0)
        rnd.mine = np.array([digest(rnd.entries), flags], dtype=np.int64)
        rnd.everyone = np.empty((self.size, 2), dtype=np.int64)
        rnd.request = self.comm.Iallgather(rnd.mine, rnd.everyone)
        rnd.next_check = time.perf_counter() + k.PEER_CHECK_S
        return rnd

    def _finish_round(self, rnd: _Round):
        """Returns every rank's phase-2 payload when every rank has joined, else None."""
        e = rnd.everyone
        if not e[:, 1].any() and (e[:, 0] == e[0, 0]).all():
            self._run(rnd.entries)  # the same collectives everywhere: nothing more to exchange
            return None
        fast = self._fast.counts() if self._fast is not None else {}
        payloads = self.comm.allgather((rnd.entries, rnd.joined, rnd.waiting, self._rounds_joined, fast,
                                        dict(self._unnamed)))
        verdict = analyze([p[0] for p in payloads], [p[1] for p in payloads], [p[2] for p in payloads])
        if verdict.all_joined:
            return payloads
        for name, message in verdict.failed.items():
            with self._table_lock:
                self._poison.pop(name, None)
                handle = self._pending.get(name)
            if handle is not None:
                self._complete(handle, error=CollectiveMismatchError(message))
        if verdict.runnable:
            reference = {d.name: d for d in payloads[next(r for r, p in enumerate(payloads) if not p[1])][0]}
            self._run([reference[name] for name in verdict.runnable])
        return None

    # -- running agreed collectives -----------------------------------------------------------
    def _run(self, descs) -> None:
        """Runs agreed collectives, in the same order on every rank. A rank without a handle for
        one (it called join()) contributes zeros."""
        with self._table_lock:  # (they stay in the table while they run: their names are in flight)
            items = [(d, self._pending.get(d.name)) for d in descs if d.kind != DUPLICATE]
        adasums = [(d, h) for d, h in items if d.kind == "allreduce" and d.op == "adasum"]
        for d, h in adasums:  # one tensor at a time: each has its own coefficients and scales
            array = h.payload if h else np.zeros(d.shape, k.np_dtype(d.dtype))  # a joined rank adds nothing
            k.adasum(self.comm, self.size, self.rank, [array], d.scales)
            if h is not None:
                self._complete(h, array)
        reduces = [(d, h) for d, h in items if d.kind == "allreduce" and d.op != "adasum"]
        if reduces:
            arrays = [h.payload if h else np.zeros(d.shape, k.np_dtype(d.dtype)) for d, h in reduces]
            k.reduce_buckets(self.comm, self.size, arrays, [(d.op, d.scales) for d, _ in reduces])
            for (_, h), array in zip(reduces, arrays):
                if h is not None:
                    self._complete(h, array)
        gathers = [h for d, h in items if d.kind == "allgather"]  # never with a joined rank
        if gathers:
            for h, out in zip(gathers, k.allgather_many(self.comm, self.size, [h.payload for h in gathers])):
                self._complete(h, out)
        for d, h in items:
            if d.kind not in ("allreduce", "allgather"):
                result = getattr(self, f"_run_{d.kind}")(d, h.payload if h else None)
                if h is not None:
                    self._complete(h, result)

    def _run_broadcast(self, d, array):
        return k.broadcast(self.comm, array, self.ranks.index(d.root))

    def _run_alltoall(self, d, payload):
        return k.alltoall(self.comm, self.size, *payload)

    def _run_reducescatter(self, d, array):
        return k.reducescatter(self.comm, self.size, self.rank, array, d.op, d.scales)

    def _run_barrier(self, d, payload):
        k.wait([self.comm.Ibarrier()], comm=self.comm)

    def _run_broadcast_object(self, d, obj):
        return self.comm.bcast(obj, root=self.ranks.index(d.root))

    def _run_allgather_object(self, d, obj):
        return self.comm.allgather(obj)

    def _run_process_set(self, d, ranks):
        sub = self.comm.Split(0 if self.ranks[self.rank] in ranks else MPI.UNDEFINED, key=self.rank)
        if sub == MPI.COMM_NULL:
            return None
        engine = MPICollectives(sub, ranks=ranks, fast_path=False)
        sub.Free()
        return engine

    def _run_process_set_remove(self, d, engine):
        if engine is not None:
            engine.free()

    # -- the optimizer's fused all-reduce -------------------------------------------------------
    def allreduce_arrays(self, arrays, op="average", prescale_factor=1.0, postscale_factor=1.0,
                         verified_layout=False, name="fused"):
        """All-reduces arrays in place, fused into as few collectives as their dtypes allow, and
        waits. Every rank must pass the same arrays (dtypes, shapes) in the same order; unless
        verified_layout, that is negotiated first (one check for the whole batch)."""
        arrays = [check_buffer(a, name) for a in arrays]
        opn = op_name(op)
        keys = [(opn, (float(prescale_factor), float(postscale_factor)))] * len(arrays)
        if opn == "adasum":
            for i, a in enumerate(arrays):
                k.check_adasum(f"{name}.{i}", a.dtype, self.size)
        if verified_layout and self._fast is not None and opn != "adasum":
            # Collectives still in flight (a peer may wait for one of them before its own step,
            # as Horovod allows) go on in the progress thread while this step's all-reduce waits,
            # on its own communicator: it needs no lock.
            if self._fast.reduce(arrays, keys):
                return arrays
        handles = [self.submit("allreduce", f"{name}.{i}", a, dtype=k.label(a.dtype), shape=a.shape, op=opn,
                               scales=keys[0][1]) for i, a in enumerate(arrays)]
        for h in handles:  # negotiated in one round: the first wait completes them all
            self.synchronize(h)
        return arrays

    def start_allreduce_arrays(self, arrays, op="average", prescale_factor=1.0, postscale_factor=1.0):
        """Posts the optimizer's verified fused all-reduce of `arrays` without waiting (from a
        gradient hook, while backward goes on; any MPI call -- the parameter server's included --
        moves it along). Returns what finish_allreduce_arrays takes, or None where it cannot
        start early (one rank, no fast path, user collectives pending, Adasum): then call
        allreduce_arrays at synchronize as usual."""
        opn = op_name(op)
        if self.size == 1 or self._fast is None or self._pending or opn == "adasum":
            return None
        keys = [(opn, (float(prescale_factor), float(postscale_factor)))] * len(arrays)
        return self._fast.start([check_buffer(a, "hybridsync.fused") for a in arrays], keys)

    def finish_allreduce_arrays(self, started) -> None:
        buckets, requests = started  # (collectives in flight meanwhile: as in allreduce_arrays)
        k.wait(requests, comm=self.comm)
        k.finish_buckets(self.size, buckets)

    # -- join -----------------------------------------------------------------------------------
    def join(self) -> int:
        """Horovod's join: until every rank has called it, this rank takes part in the others'
        all-reduces with zeros (other collectives are then an error on the ranks that submit
        them). Returns the rank that joined last."""
        with self._table_lock:
            in_flight = list(self._pending.values())
        for handle in in_flight:
            self.synchronize(handle)
        if self.size == 1:
            return self.ranks[0]
        with self._progress_lock:
            return self._join_rounds()

    def _join_rounds(self) -> int:
        self._joined_at = time.time()
        self._rounds_joined = 0  # rounds are collective: the rank that joined last has seen the fewest
        try:
            while True:
                if self._fast is not None:
                    self._fast.stand_ready()
                if self._round is None:
                    self._round = self._post_round()
                k.wait([self._round.request] + (self._fast.requests() if self._fast else []), any_done=True,
                       comm=self.comm)
                if self._round.request.Test():
                    rnd, self._round = self._round, None
                    self._rounds_joined += 1
                    payloads = self._finish_round(rnd)
                    if payloads is not None:
                        return self._finish_join(payloads)
        finally:
            self._joined_at = None

    def _finish_join(self, payloads) -> int:
        if self._fast is not None:
            targets = collections.Counter()
            for p in payloads:
                targets |= collections.Counter(p[4])  # the most rounds any rank took part in
            self._fast.finish(dict(targets))
        # Unnamed collectives are numbered per rank; the ranks that went on working numbered
        # theirs: every rank goes on from the highest number, so the next ones match again.
        for p in payloads:
            self._unnamed |= collections.Counter(p[5])
        # Counted in rounds, not wall-clock times, which hosts' clocks would skew; a tie (joined
        # in the same round) goes to the higher rank, the same answer on every rank.
        rounds = [p[3] for p in payloads]
        return self.ranks[min(range(self.size), key=lambda r: (rounds[r], -r))]

    # -- the rest, synchronous ------------------------------------------------------------------
    def allreduce(self, buf, name=None, op="average"):
        out = np.array(np.asarray(buf), copy=True, order="C")
        return self.synchronize(self.allreduce_async_(out, name=name, op=op))

    def broadcast_(self, buf, root_rank, name=None):
        self.synchronize(self.broadcast_async_(buf, root_rank, name))
        return buf

    def allgather(self, buf, name=None):
        """Concatenates every rank's array along dim 0 (dim 0 may differ, the rest may not)."""
        return self.synchronize(self.allgather_async(buf, name))

    def broadcast_object(self, obj, root_rank=0, name=None):
        return self.synchronize(self.submit("broadcast_object", name, obj, root=root_rank))

    def allgather_object(self, obj, name=None):
        return self.synchronize(self.submit("allgather_object", name, obj))

    def barrier(self):
        self.synchronize(self.submit("barrier", None))

    def add_process_set(self, ranks, name=None):
        """Collective over this communicator: the engine of the members of `ranks` (None on the
        other ranks). Every rank must pass the same ranks."""
        ranks = sorted(int(r) for r in ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not set(ranks) <= set(self.ranks):
            raise ValueError(f"a process set needs distinct ranks of this job ({self.ranks}), got {ranks}")
        return self.synchronize(self.submit("process_set", name, ranks, shape=ranks))

    def remove_process_set(self, ranks, engine, name=None) -> None:
        """Collective over this communicator: frees a process set's engine on its members."""
        self.synchronize(self.submit("process_set_remove", name, engine, shape=sorted(ranks)))

    def free(self) -> None:
        if self._thread is not None:
            self._thread.stop()
        if self._fast is not None:
            self._fast.free()
        self.comm.Free()
