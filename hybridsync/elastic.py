"""Elastic training state, framework-neutral: Horovod's elastic API (State, ObjectState,
StateHandler, run) and CheckpointState, which commits to disk so a restarted job resumes.

Horovod's model: a State is committed (kept) every few batches; when a collective fails, every
rank restores the last commit and training goes on; sync() makes every rank take rank 0's state.
Each attribute of an ObjectState has a StateHandler that knows how to save, restore and sync its
kind of value -- plain values by copy and broadcast, a model or optimizer by its state dict
(framework adapters register theirs: hybridsync.torch.elastic), and parameter-server tables per
shard: each rank commits and restores only its own shard, so no rank ever holds a whole table
(TableShardsHandler).

hybridsync jobs have a fixed set of ranks (mpirun, or horovodrun without --min-np): no host
joins or leaves, so run() syncs once and calls the function; on HorovodInternalError the last
commit is restored and the error raised (a fixed job cannot reset itself). To survive a restart
-- at any number of ranks -- use CheckpointState:

    state = hybridsync.elastic.CheckpointState("ckpt/run", model, optimizer, epoch=0, batch=0)

    def train(state):
        for state.epoch in state.remaining_epochs_until(10):
            for batch in range(state.batch, batches_per_epoch):
                ...
                state.batch = batch + 1
                state.commit()               # collective; an atomic checkpoint
            state.batch = 0

    hybridsync.elastic.run(train, state)     # resumes from the last commit, if there is one
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path

from . import comm, runtime
from .checkpoint import MANIFEST, load_checkpoint, save_checkpoint
from .frontend import of as frontend_of
from .ps import dynamic_shard_file, written_rows
from .ps.dynamic import DynamicTable
from .ps.table import PSTable

try:
    from horovod.common.exceptions import HorovodInternalError
except ImportError:  # without Horovod: same name, same meaning
    class HorovodInternalError(RuntimeError):
        """A collective failed; with Horovod's elastic mode this is the recoverable error."""

__all__ = ["State", "ObjectState", "StateHandler", "ObjectHandler", "TableShardsHandler", "FrameworkState", "CheckpointState",
           "run", "ps_tables", "HorovodInternalError"]


def _broadcast(value, name: str):
    if runtime.world().size == 1:
        return value
    return comm.objects().broadcast_object(value, 0, name=f"hybridsync.elastic.{name}")


class _Kept:
    """What States and StateHandlers implement: keep the current state, go back to what was
    kept, take rank 0's."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class State(_Kept):
    """Horovod's elastic State: commit() keeps the state restore() goes back to; sync() makes
    every rank take rank 0's. Subclasses implement save / restore / sync."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions to call after the job was reset (never, in a fixed job; kept for Horovod's API)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keeps the current state; call it every few batches (every rank at the same point)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """No host ever joins or leaves a fixed job: nothing to do."""

    def reset(self) -> None:
        """Called on a reset, before the callbacks."""


class StateHandler(_Kept):
    """How one attribute's value is saved, restored and synced from rank 0."""

    def __init__(self, value, name: str = "value"):
        self.value, self.name = value, name
        self.save()

    def set_value(self, value) -> None:
        """A new object for the attribute (a new optimizer, ...): it is what a restore returns to."""
        self.value = value
        self.save()


class ObjectHandler(StateHandler):
    """A plain value (epoch, batch, a list ...): a copy is kept; sync broadcasts rank 0's."""

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value)

    def restore(self) -> None:
        self.value = copy.deepcopy(self._saved)

    def sync(self) -> None:
        self.value = _broadcast(self.value, self.name)


class TableShardsHandler(StateHandler):
    """Parameter-server tables: each rank keeps a copy of its own shard (rows, server-optimizer
    slots, step; a dynamic table's ids, counts, last touches and pending ids too; for a table
    with a disk tier, in a file on its local disk -- a fixed table's written rows only) and restores it locally, so a
    commit costs a rank its shard, never a table, and
    moves nothing over the network. sync() has nothing to do: the shards are the one copy of a
    table every rank reads. `value` is a function returning the tables (a `sync: auto` switch
    may replace them)."""

    @staticmethod
    def _settle(tables: list, what: str) -> None:
        """Collective: a PS barrier, after which every push any rank started is in the shards
        (a sharded push is applied at the next PS operation) and no rank reads a shard early."""
        if tables:
            tables[0].engine.barrier(f"hybridsync.elastic.{what}")

    def save(self) -> None:
        """Collective (every rank commits at the same point): each rank's own shards, with every
        push of the step committed in them."""
        self._saved = {}  # the previous commit goes first: a rank holds one copy of its shard
        tables = self.value()
        self._settle(tables, "commit")
        for table in tables:
            shards, _ = table.layout
            mine = table.engine.rank < shards
            self._saved[table.handle] = (table, table.layout, self._commit(table) if mine else None,
                                       table.engine.step(table.handle) if mine else None)

    @staticmethod
    def _commit(table):
        """This rank's shard: its arrays, or for a table with a disk tier (which may not fit in
        memory) a file on the rank's local disk (a fixed table's written rows, a dynamic one's shard)."""
        if table.tiered and isinstance(table, PSTable):
            return written_rows.Commit(table)
        if table.tiered:
            return dynamic_shard_file.Commit(table)
        return table.local_state()

    def restore(self) -> None:
        """Collective: the pushes still in flight land before the shards are written back (they
        would undo the restore), and no rank pulls before every shard is restored."""
        tables = self.value()
        self._settle(tables, "restore")
        for table in tables:
            saved = self._saved.get(table.handle)
            if saved is None or saved[0] is not table or saved[1] != table.layout:
                raise RuntimeError(f"elastic state: table '{table.name}' is not on the parameter server as it was at "
                                   "the last commit (did sync: auto move it?); commit again before restoring")
            _, layout, arrays, step = saved
            if isinstance(arrays, (written_rows.Commit, dynamic_shard_file.Commit)):
                arrays.restore(table, step)
            elif arrays is not None:
                table.restore_local_state(arrays, step)  # a dynamic table's counters and pending ids too
        self._settle(tables, "restored")

    def sync(self) -> None:
        pass

    def saved_bytes(self) -> int:
        """Bytes this rank holds for the last commit (its shards)."""
        return sum(a.nbytes for _, _, arrays, _ in self._saved.values() if isinstance(arrays, dict)
                   for a in arrays.values())


def ps_tables(objects) -> list:
    """Each PS table among `objects` -- PS-backed modules or layers (their `table`) and hybridsync
    DistributedOptimizers (the tables of their plan) -- once."""
    found = {}
    for obj in objects:
        wrapped = frontend_of(obj)
        variables = (wrapped.variables() or ()) if wrapped is not None else ()
        tables = [var.table for var in variables] or [getattr(obj, "table", None)]
        # (a DynamicTable holds a TableCore as a PSTable does; it is no PSTable)
        found.update((id(t), t) for t in tables if isinstance(t, (PSTable, DynamicTable)))
    return list(found.values())


class ObjectState(State):
    """Horovod's ObjectState: keyword arguments become attributes, each with the StateHandler
    that handler_for() picks (ObjectHandler unless a subclass knows the type better)."""

    def __init__(self, **kwargs):
        object.__setattr__(self, "_handlers", {})
        super().__init__()
        for name, value in kwargs.items():
            self._handlers[name] = self.handler_for(name, value)

    def handler_for(self, name: str, value) -> StateHandler:
        """The handler of attribute `name`; subclasses recognise their frameworks' objects."""
        return ObjectHandler(value, name)

    def add_handler(self, name: str, handler: StateHandler) -> None:
        """State that is no attribute (`_`-prefixed names stay hidden): tables on the PS."""
        self._handlers[name] = handler

    def __getattr__(self, name):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            return handlers[name].value
        raise AttributeError(f"elastic state has no attribute '{name}' (attributes: {', '.join(self.attributes)})")

    def __setattr__(self, name, value):
        handler = self.__dict__.get("_handlers", {}).get(name)
        if handler is None:
            object.__setattr__(self, name, value)
        elif isinstance(handler, ObjectHandler) or value is handler.value:
            handler.value = value  # a plain value (epoch = 3): kept at the next commit
        else:
            handler.set_value(value)  # a new model / optimizer object

    @property
    def attributes(self) -> list:
        return [name for name in self._handlers if not name.startswith("_")]

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()

    def sync(self) -> None:
        """Collective: every rank takes rank 0's state, then keeps it as the commit."""
        for handler in self._handlers.values():
            handler.sync()
        self.save()


class FrameworkState(ObjectState):
    """An ObjectState with a framework's model and optimizer: HANDLERS maps the framework's types
    to their handlers, and the PS tables of its models and optimizers are committed per shard
    (the framework adapters: hybridsync.torch.elastic.TorchState, hybridsync.tensorflow.elastic.KerasState)."""

    HANDLERS: tuple = ()  # ((type, StateHandler subclass), ...)

    def __init__(self, model=None, optimizer=None, **kwargs):
        objects = {k: v for k, v in dict(model=model, optimizer=optimizer).items() if v is not None}
        super().__init__(**objects, **kwargs)
        self.add_handler("_ps_tables", TableShardsHandler(self._ps_tables, "ps_tables"))

    def handler_for(self, name, value):
        for kind, handler in self.HANDLERS:
            if isinstance(value, kind):
                return handler(value, name)
        return super().handler_for(name, value)

    def parts(self, value) -> list:
        """The objects of `value` that may hold PS tables: a model's modules or layers."""
        return [value]

    def _ps_tables(self) -> list:
        """The tables of every model and DistributedOptimizer in this state, now."""
        return ps_tables([part for name in self.attributes for part in self.parts(getattr(self, name))])


class CheckpointState(ObjectState):
    """Model, optimizer and plain attributes (JSON values: epoch, batch, ...) committed to an
    atomic checkpoint at `path` (hybridsync.save_checkpoint: each shard written by its owner):
    a job started again -- at any number of ranks -- resumes from the last commit."""

    def __init__(self, path, model, optimizer, **fields):
        super().__init__(**fields)
        object.__setattr__(self, "_path", Path(path))
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "commits", 0)
        object.__setattr__(self, "resumed", False)

    @property
    def fields(self) -> dict:
        return {name: self._handlers[name].value for name in self.attributes}

    def save(self) -> None:
        """Collective: saves model, optimizer, server state and the fields atomically."""
        super().save()
        save_checkpoint(self._path, self._model, self._optimizer, extra={"fields": self.fields})
        object.__setattr__(self, "commits", self.commits + 1)

    def restore(self) -> bool:
        """Collective: loads the last commit if there is one; True if it did."""
        if not (self._path / MANIFEST).exists():
            return False
        extra = load_checkpoint(self._path, self._model, self._optimizer)
        for name, value in extra["fields"].items():
            if name in self._handlers:
                self._handlers[name].value = value
            else:
                self._handlers[name] = ObjectHandler(value, name)
        object.__setattr__(self, "resumed", True)
        return True

    def sync(self) -> None:
        """Collective: resumes from the last commit, which every rank loads alike."""
        self.restore()

    def remaining_epochs_until(self, epochs: int) -> range:
        """The epochs still to run: from the committed epoch (field 'epoch') up to `epochs`."""
        epoch = self._handlers["epoch"].value if "epoch" in self._handlers else 0
        return range(int(epoch), epochs)


def run(func, state: State | None = None, *args, **kwargs):
    """Horovod's decorator: `@run def train(state, ...)` -- the wrapped function first syncs
    `state` (every rank starts from rank 0's state; a CheckpointState resumes from its last
    commit), then runs; on HorovodInternalError the last commit is restored and the error raised.
    run(func, state, ...) calls it at once."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.sync()
        try:
            return func(state, *args, **kwargs)
        except HorovodInternalError:
            state.restore()
            raise

    return wrapper if state is None else wrapper(state, *args, **kwargs)
