"""Keras callbacks for hybridsync jobs."""
from __future__ import annotations

import keras

from .. import runtime
from . import functions


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Starts every rank from root_rank's model weights (at train begin) and optimizer state
    (after the first batch, when the optimizer has created it)."""

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self._optimizer_done = False

    def on_train_begin(self, logs=None):
        functions.broadcast_variables(self.model.variables, self.root_rank)

    def on_train_batch_end(self, batch, logs=None):
        if not self._optimizer_done:
            functions.broadcast_variables(self.model.optimizer.variables, self.root_rank)
            self._optimizer_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's metrics (loss included) by their average over ranks, so every rank
    logs (and early-stops on) the same numbers."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or runtime.world().size == 1:
            return
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float)))
        values = functions.allreduce([float(logs[k]) for k in keys]).numpy()
        logs.update({k: float(v) for k, v in zip(keys, values)})
