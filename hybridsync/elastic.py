"""Elastic restarts in the spirit of Horovod elastic and AdaptDL: training state that is
committed to a checkpoint and resumed from it -- data position included -- when the job is
started again, at any number of ranks.

    state = hybridsync.elastic.State("ckpt/run", model, optimizer, epoch=0, batch=0)

    def train(state):
        for state.epoch in state.remaining_epochs_until(10):
            for state.batch, (x, y) in enumerate(loader, start=...):  # skip state.batch on resume
                ...
                if state.batch % 100 == 0:
                    state.commit()
            state.batch = 0
        state.commit()

    hybridsync.elastic.run(train, state)

commit() saves a checkpoint (collective; atomic, see hybridsync.checkpoint); run() first loads
the latest committed checkpoint if there is one, restoring the model, the optimizer, the server
state and every field given to State (epoch, batch, ...), whatever -np the job has now.
"""
from __future__ import annotations

import functools
from pathlib import Path

from .checkpoint import MANIFEST, load_checkpoint, save_checkpoint


class State:
    """Model, optimizer and plain fields (JSON values: epoch, batch, ...) committed together."""

    def __init__(self, path, model, optimizer, **fields):
        object.__setattr__(self, "_path", Path(path))
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_fields", dict(fields))
        object.__setattr__(self, "commits", 0)
        object.__setattr__(self, "resumed", False)

    def __getattr__(self, name):
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        raise AttributeError(f"elastic State has no field '{name}' (fields: {', '.join(fields) or 'none'})")

    def __setattr__(self, name, value):
        if name in ("commits", "resumed"):
            object.__setattr__(self, name, value)
        else:
            self._fields[name] = value

    @property
    def fields(self) -> dict:
        return dict(self._fields)

    def commit(self) -> None:
        """Collective: saves model, optimizer, server state and the fields atomically."""
        save_checkpoint(self._path, self._model, self._optimizer, extra={"fields": self._fields})
        self.commits += 1

    def restore(self) -> bool:
        """Collective: loads the latest commit if there is one; True if it did."""
        if not (self._path / MANIFEST).exists():
            return False
        extra = load_checkpoint(self._path, self._model, self._optimizer)
        self._fields.update(extra["fields"])
        self.resumed = True
        return True

    def remaining_epochs_until(self, epochs: int) -> range:
        """The epochs still to run: from the committed epoch (field 'epoch') up to `epochs`."""
        return range(int(self._fields.get("epoch", 0)), epochs)


def run(train_fn, state: State | None = None, *args, **kwargs):
    """run(train_fn, state): restores the latest commit of `state`, then calls train_fn(state).
    run(train_fn) alone returns train_fn wrapped that way (a decorator)."""
    if state is None:
        @functools.wraps(train_fn)
        def wrapper(state: State, *args, **kwargs):
            return run(train_fn, state, *args, **kwargs)
        return wrapper
    state.restore()
    return train_fn(state, *args, **kwargs)
