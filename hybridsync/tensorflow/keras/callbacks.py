"""Horovod's Keras callbacks (horovod.tensorflow.keras.callbacks) for Keras 3.

- BroadcastGlobalVariablesCallback: every rank starts from root_rank's weights (at train begin,
  and again after the first batch for variables that batch created) and optimizer state (after
  the first batch, when the optimizer has made it), except the local variables given. At train
  begin it hands the model to a hybridsync DistributedOptimizer, whose plain Keras Embeddings then
  move to the PS shards (from root_rank 0's rows) before Keras traces the step.
- MetricAverageCallback: each epoch's metrics (loss included) averaged over the ranks, so every
  rank logs, checkpoints and stops early on the same numbers. Put it before callbacks that read
  metrics.
- LearningRateScheduleCallback / LearningRateWarmupCallback: the learning rate as
  initial_lr * multiplier(epoch), per epoch or per batch, with Horovod's momentum correction.
- BestModelCheckpoint: Keras's ModelCheckpoint keeping the best model; filepath may be set later.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from ... import runtime
from .. import functions, ops


def _ref(v):
    inner = getattr(v, "value", None)
    return (inner if isinstance(inner, tf.Variable) else v).ref()


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Starts every rank from root_rank's model weights and optimizer state. local_variables:
    variables each rank keeps as they are. `device` is accepted for Horovod's signature."""

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank, self.device = root_rank, device
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, (tf.Variable, keras.Variable)):
            local_variables = [local_variables]
        elif not all(isinstance(v, (tf.Variable, keras.Variable)) for v in local_variables):
            raise ValueError("All local variables must be of tf.Variable type.")
        self._local_vars = {_ref(v) for v in local_variables}
        self._sent: set = set()
        self.broadcast_done = False

    def register_local_var(self, var):
        """A variable each rank keeps as it is (never broadcast)."""
        self._local_vars.add(_ref(var))

    def _broadcast(self, variables) -> None:
        wanted = [v for v in variables if _ref(v) not in self._local_vars and _ref(v) not in self._sent]
        functions.broadcast_variables(wanted, self.root_rank)
        self._sent.update(_ref(v) for v in wanted)

    def on_train_begin(self, logs=None):
        adopt = getattr(self.model.optimizer, "_hs_adopt_model", None)
        if adopt is not None:  # a hybridsync DistributedOptimizer: plain Keras Embeddings move to the PS shards
            adopt(self.model)
        if not self.broadcast_done:
            self._broadcast(self.model.variables)  # (a model built at its first batch has none yet)

    def on_train_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        self._broadcast(self.model.variables)  # those the first batch created
        if self.model.optimizer is not None:
            self._broadcast(self.model.optimizer.variables)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's metrics by their average over the ranks (in one collective; every
    rank must log the same metric names). `device` is accepted for Horovod's signature."""

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or runtime.world().size == 1:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = ops.engine(None).allreduce(values, name="MetricAverageCallback", op="average")
        logs.update({k: float(v) for k, v in zip(keys, averaged)})


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to initial_lr * multiplier(epoch) from start_epoch until end_epoch
    (exclusive): at each epoch's first batch (staircase=True, integer epochs) or at every batch
    (epoch + batch / steps_per_epoch). multiplier: a function of the epoch, or a constant c
    meaning c ** (epoch - start_epoch). momentum_correction: an optimizer with momentum has its
    velocity scaled by new_lr / old_lr where the rate changes (Goyal et al.)."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.momentum_correction, self.steps_per_epoch = staircase, momentum_correction, steps_per_epoch
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))
        self.current_epoch = None

    # -- the optimizer's learning rate and momentum ----------------------------------------------
    def _optimizer(self):
        return self.model.optimizer

    def _get_lr(self) -> float:
        value = self._optimizer().learning_rate
        return float(value.numpy() if hasattr(value, "numpy") else value)

    def _set_lr(self, lr: float) -> None:
        optimizer = self._optimizer()
        if isinstance(optimizer._learning_rate, keras.optimizers.schedules.LearningRateSchedule):
            raise ValueError(f"{type(self).__name__} sets the learning rate, but the optimizer's is a "
                             f"{type(optimizer._learning_rate).__name__}: give the optimizer a number instead")
        optimizer.learning_rate = lr

    def _velocities(self) -> list:
        """The optimizer's momentum slots (SGD's momentums, RMSprop's), where it has momentum and
        has made them (at its first step: before it they are zero)."""
        optimizer = self._optimizer()
        if not float(getattr(optimizer, "momentum", 0.0) or 0.0):
            return []
        return list(getattr(optimizer, "momentums", None) or getattr(optimizer, "_momentums", None) or [])

    def _adjust_learning_rate(self, epoch) -> None:
        old_lr = self._get_lr()
        new_lr = self.initial_lr * self.multiplier(epoch)
        self._set_lr(new_lr)
        if self.momentum_correction and old_lr and new_lr != old_lr:
            # Goyal et al.'s correction: the velocity follows the rate. Horovod scales the momentum
            # by new_lr / old_lr for this batch; Keras 3 reads its momentum (a number) once, when it
            # compiles the step, so the velocity itself is scaled: the same update.
            for velocity in self._velocities():
                velocity.assign(velocity * (new_lr / old_lr))

    def _autodetect_steps_per_epoch(self) -> int:
        if self.params.get("steps"):
            return self.params["steps"]
        raise ValueError(f"Could not autodetect the number of steps per epoch. Please specify the steps_per_epoch "
                         f"parameter to the {type(self).__name__}()")

    # -- Keras's hooks ---------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = self._get_lr()


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warmup (Goyal et al.): the rate grows from initial_lr / size to initial_lr over
    warmup_epochs, batch by batch."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            size = runtime.world().size
            epoch += 1.0 / self.steps_per_epoch  # round numbers at each epoch's end
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and runtime.world().rank == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self._get_lr():g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras's ModelCheckpoint with save_best_only=True; its filepath may be set after
    construction (callback.filepath = ...), before training."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch"):
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"  # (Keras checks the suffix here)
        super().__init__(filepath=placeholder, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = None

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint: set its filepath (callback.filepath = '...') before training")
        super().on_train_begin(logs)
