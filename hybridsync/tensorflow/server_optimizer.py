"""The server-side rule that applies a Keras optimizer's update to a table on the PS.

SGD (no momentum) -> sgd; Adagrad -> adagrad with Keras's epsilon inside the square root
(var -= lr * g / sqrt(acc + eps)); Adam (no amsgrad) -> lazy adam (only rows with a gradient
move, as torch's SparseAdam; Keras's own Adam decays every row's moments on a sparse
gradient). No weight decay, no gradient clipping, accumulation or EMA: those would not reach
the rows the server updates. Anything else is an error naming the optimizer and variable.
"""
from __future__ import annotations


class UnsupportedSparseOptimizer(ValueError):
    pass


def _reject(name, optimizer, reason):
    raise UnsupportedSparseOptimizer(
        f"variable '{name}': {type(optimizer).__name__} {reason}, which the parameter server cannot apply to a table "
        "row by row; use SGD (no momentum), Adagrad or Adam for it, or give it a server optimizer in the config "
        "(variables: - match: ... optimizer: {name: adagrad, lr: ...})")


def _lr(optimizer) -> float:
    """The current learning rate, read eagerly (also while tf.function traces the step)."""
    import tensorflow as tf

    with tf.init_scope():
        value = optimizer.learning_rate
        return float(value.numpy() if hasattr(value, "numpy") else value)


def server_rule(optimizer, name: str) -> dict:
    import keras

    for attr, label in (("weight_decay", "weight_decay"), ("clipnorm", "clipnorm"), ("clipvalue", "clipvalue"),
                        ("global_clipnorm", "global_clipnorm"), ("gradient_accumulation_steps", "gradient_accumulation_steps")):
        value = getattr(optimizer, attr, None)
        if value:
            _reject(name, optimizer, f"with {label}={value}")
    if getattr(optimizer, "use_ema", False):
        _reject(name, optimizer, "with use_ema=True")
    if isinstance(optimizer, keras.optimizers.SGD):
        if float(optimizer.momentum):
            _reject(name, optimizer, f"with momentum={optimizer.momentum}")
        return {"name": "sgd", "lr": _lr(optimizer)}
    if isinstance(optimizer, keras.optimizers.Adagrad):
        return {"name": "adagrad", "lr": _lr(optimizer), "initial_accumulator_value": float(optimizer.initial_accumulator_value),
                "eps": float(optimizer.epsilon), "eps_in_sqrt": 1.0}
    if isinstance(optimizer, keras.optimizers.Adam) and type(optimizer).__name__ in ("Adam",):
        if optimizer.amsgrad:
            _reject(name, optimizer, "with amsgrad=True")
        return {"name": "adam", "lr": _lr(optimizer), "beta1": float(optimizer.beta_1), "beta2": float(optimizer.beta_2),
                "eps": float(optimizer.epsilon)}
    _reject(name, optimizer, "is not supported")


def applies_sparse(optimizer) -> bool:
    """Keras optimizers apply IndexedSlices themselves (Adagrad squares each duplicate row)."""
    import keras

    return isinstance(optimizer, (keras.optimizers.SGD, keras.optimizers.Adagrad, keras.optimizers.Adam))
