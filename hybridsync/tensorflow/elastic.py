"""hvd.elastic for Keras: KerasState (commit / restore / sync of a model, its optimizer and plain
attributes) and the run decorator -- Horovod's horovod.tensorflow.keras.elastic names.

The state machinery is hybridsync.elastic's (framework-neutral); this module adds the handlers
of Keras's objects. A model and an optimizer are kept as their variables' values; tables on the
parameter server (hybridsync.tensorflow.Embedding, and variables the optimizer put there) are
committed per shard by each rank locally (hybridsync.elastic.TableShardsHandler).
"""
from __future__ import annotations

import keras
import numpy as np

from ..elastic import FrameworkState, StateHandler, run
from .functions import broadcast_variables

__all__ = ["KerasState", "run"]


class VariablesStateHandler(StateHandler):
    """A Keras model or optimizer: copies of its variables' values (a PS table is none of them)."""

    def _variables(self) -> list:
        return list(self.value.variables)

    def save(self) -> None:
        self._saved = [np.array(v.numpy(), copy=True) for v in self._variables()]

    def restore(self) -> None:
        variables = self._variables()
        if len(variables) != len(self._saved):  # an optimizer builds its variables at its first step
            raise RuntimeError(f"elastic state: '{self.name}' has {len(variables)} variables, {len(self._saved)} "
                               "at the last commit; commit again before restoring")
        for v, value in zip(variables, self._saved):
            v.assign(value)

    def sync(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)


class KerasState(FrameworkState):
    """Horovod's KerasState: a model, its optimizer (default: the model's) and plain attributes,
    committed (kept in memory), restored and synced from rank 0; PS tables per shard."""

    HANDLERS = ((keras.Model, VariablesStateHandler), (keras.optimizers.Optimizer, VariablesStateHandler))

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer if optimizer is not None else getattr(model, "optimizer", None), **kwargs)

    def parts(self, value) -> list:
        return list(value._flatten_layers()) if isinstance(value, keras.Model) else [value]
