"""A Keras optimizer described for hybridsync.ps.rules (which decides the server rule
and words the errors): SGD -> sgd; Adagrad -> adagrad with Keras's epsilon inside the square
root; Adam -> lazy adam (only rows with a gradient move, as torch's SparseAdam; Keras's own Adam
decays every row's moments on a sparse gradient). Weight decay, clipping, accumulation and EMA
would not reach the rows the server updates: they are blockers."""
from __future__ import annotations

import keras
import tensorflow as tf

from ..ps.rules import OptimizerSpec

_BLOCKING_ATTRIBUTES = ("weight_decay", "clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps")


def _eager(read) -> float:
    """A hyper-parameter (a number or a variable) read eagerly, also while tf.function traces."""
    with tf.init_scope():
        value = read()
        return float(value.numpy() if hasattr(value, "numpy") else value)


def _lr(optimizer) -> float:
    """The current learning rate."""
    return _eager(lambda: optimizer.learning_rate)


def describe(optimizer) -> OptimizerSpec:
    blockers = [(a, getattr(optimizer, a)) for a in _BLOCKING_ATTRIBUTES if getattr(optimizer, a, None)]
    if getattr(optimizer, "use_ema", False):
        blockers.append(("use_ema", True))
    family, hparams = None, {}
    if isinstance(optimizer, keras.optimizers.SGD):
        family, hparams = "sgd", {"lr": _lr(optimizer)}
        momentum = _eager(lambda: optimizer.momentum)  # (a variable while a LR callback corrects it)
        if momentum:
            blockers.append(("momentum", momentum))
    elif isinstance(optimizer, keras.optimizers.Adagrad):
        family, hparams = "adagrad", {"lr": _lr(optimizer), "eps": optimizer.epsilon, "eps_in_sqrt": 1.0,
                                      "initial_accumulator_value": optimizer.initial_accumulator_value}
    elif isinstance(optimizer, keras.optimizers.Adam) and type(optimizer).__name__ == "Adam":
        family = "adam"
        hparams = {"lr": _lr(optimizer), "beta1": optimizer.beta_1, "beta2": optimizer.beta_2, "eps": optimizer.epsilon}
        if optimizer.amsgrad:
            blockers.append(("amsgrad", True))
    sparse_capable = isinstance(optimizer, (keras.optimizers.SGD, keras.optimizers.Adagrad, keras.optimizers.Adam))
    # Applied rows equal the server's update only for SGD: Keras's Adagrad squares duplicate rows
    # separately (the server sums them first), Keras's Adam decays every row's moments.
    return OptimizerSpec(type(optimizer).__name__, family, hparams, blockers, applies_sparse=sparse_capable,
                         sparse_exact=family == "sgd")


def slots(optimizer, variable) -> dict:
    """The Keras optimizer's state variables for `variable`, by the server rule's slot names
    (Adagrad's accumulator is the server's "sum"); built optimizers only."""
    if isinstance(optimizer, keras.optimizers.Adagrad):
        return {"sum": optimizer._accumulators[optimizer._get_variable_index(variable)]}
    return {}
