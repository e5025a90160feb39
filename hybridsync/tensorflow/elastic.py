"""hvd.elastic for TensorFlow and Keras: KerasState / TensorFlowKerasState (commit / restore /
sync of a model, its optimizer and plain attributes), TensorFlowState (a list of variables) and
the run decorator -- Horovod's horovod.tensorflow(.keras).elastic names.

The state machinery is hybridsync.elastic's (framework-neutral); this module adds the handlers
of TensorFlow's objects. A model and an optimizer are kept as their variables' values; tables on
the parameter server (hybridsync.tensorflow.Embedding, and variables the optimizer put there)
are committed per shard by each rank locally (hybridsync.elastic.TableShardsHandler).
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from ..elastic import FrameworkState, ObjectState, StateHandler, run
from .functions import broadcast_variables

__all__ = ["KerasState", "TensorFlowKerasState", "TensorFlowState", "run"]


class VariablesStateHandler(StateHandler):
    """A Keras model or optimizer, or a list of variables: copies of the variables' values (a
    PS table is none of them)."""

    def _variables(self) -> list:
        return list(self.value) if isinstance(self.value, (list, tuple)) else list(self.value.variables)

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
        if not model.built and not model.variables:  # (a subclassed model that has run has its variables)
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        super().__init__(model, optimizer if optimizer is not None else getattr(model, "optimizer", None), **kwargs)

    def parts(self, value) -> list:
        return list(value._flatten_layers()) if isinstance(value, keras.Model) else [value]


class TensorFlowKerasState(KerasState):
    """horovod.tensorflow.elastic's name for KerasState; `backend` (TensorFlow 1's Keras
    session) is accepted and unused."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        super().__init__(model, optimizer, **kwargs)


class TensorFlowState(ObjectState):
    """Horovod's TensorFlowState: a list of variables and plain attributes. `session` is
    TensorFlow 1's, accepted and unused."""

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            if tf.executing_eagerly():
                raise ValueError("TensorFlowState(variables=...): eagerly there are no global variables to default "
                                 "to; pass the variables to keep")
            variables = tf.compat.v1.global_variables()
        super().__init__(variables=list(variables), **kwargs)

    def handler_for(self, name, value):
        if name == "variables":
            return VariablesStateHandler(value, name)
        return super().handler_for(name, value)
