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

from ..elastic import ObjectState, StateHandler, TableShardsHandler, ps_tables, run
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


class KerasState(ObjectState):
    """Horovod's KerasState: a model, its optimizer (default: the model's) and plain attributes,
    committed (kept in memory), restored and synced from rank 0; PS tables per shard."""

    def __init__(self, model, optimizer=None, **kwargs):
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        objects = {k: v for k, v in dict(model=model, optimizer=optimizer).items() if v is not None}
        super().__init__(**objects, **kwargs)
        self.add_handler("_ps_tables", TableShardsHandler(self._ps_tables, "ps_tables"))

    def handler_for(self, name, value):
        if isinstance(value, (keras.Model, keras.optimizers.Optimizer)):
            return VariablesStateHandler(value, name)
        return super().handler_for(name, value)

    def _ps_tables(self) -> list:
        """The tables of every model's layers and every DistributedOptimizer in this state, now."""
        values = [getattr(self, name) for name in self.attributes]
        return ps_tables([layer for v in values if isinstance(v, keras.Model) for layer in v._flatten_layers()]
                         + [v for v in values if isinstance(v, keras.optimizers.Optimizer)])
