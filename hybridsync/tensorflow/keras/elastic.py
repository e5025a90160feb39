"""Horovod's elastic Keras API (horovod.tensorflow.keras.elastic): KerasState, run, and the
callbacks that keep a state's batch and epoch and commit it while model.fit trains."""
from __future__ import annotations

import keras

from ..elastic import KerasState, run  # noqa: F401

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class CommitStateCallback(keras.callbacks.Callback):
    """Commits `state` every batches_per_commit batches, and at each epoch's end."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # the same count on every rank after a sync

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps state.batch at the batch just done (0 at each epoch's end). With a known number of
    steps per epoch, the first epoch after a restore runs only the batches left in it."""

    def __init__(self, state):
        super().__init__()
        self.state, self.steps_per_epoch = state, None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params["steps"]
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps state.epoch counting epochs across restores (Keras counts each fit() from 0)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1  # (+1: a restore after batch 0 does not repeat it)
