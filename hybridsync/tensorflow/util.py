"""The helpers of horovod.tensorflow.util that scripts and Horovod's tests import."""
from __future__ import annotations

import tensorflow as tf


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (False inside tf.function and TF1 graphs)."""
    return tf.executing_eagerly()


def _make_subgraph(f):
    return tf.function(f)


def _cache(f):
    """Memoises f by its (hashable) arguments and by whether it runs eagerly."""
    cache: dict = {}

    def wrapper(*args):
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


def vars_to_refs(variables):
    """Variables (nested lists) as hashable references."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs):
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
