"""Three Keras 2 idioms that Horovod's TensorFlow examples and API rely on, restored on Keras 3
when hybridsync.tensorflow is imported, so that a Horovod script runs with only its import
switched. Each is added only where Keras lacks it, and changes nothing else:

- model.compile(..., experimental_run_tf_function=False): Horovod's examples pass it so that
  Keras 2 computes gradients through the DistributedOptimizer. Keras 3 always hands gradients
  to the optimizer's apply(), where hybridsync exchanges them: the keyword is accepted and
  dropped (any other unknown keyword is still an error).
- optimizer.variables(): Keras 3 made `variables` a list property; Horovod's examples call it
  (`hvd.broadcast_variables(opt.variables(), root_rank=0)`). The property now returns a list
  that can also be called, returning itself (as Horovod's own optimizer did on Keras 2.11+).
- variable.ref(): Keras 2 variables were tf.Variables, whose ref() is a hashable key (Horovod
  keys local variables by it). Keras 3 variables get a ref() that keys them the same way
  (deref() gives the variable back).
"""
from __future__ import annotations

import functools

import keras
from tensorflow.python.util import object_identity

_KERAS2_COMPILE_KEYWORDS = ("experimental_run_tf_function",)


class CallableList(list):
    """A list that returns itself when called: `opt.variables` and `opt.variables()` alike."""

    def __call__(self):
        return self


def _compile_accepting_keras2_keywords(compile_fn):
    @functools.wraps(compile_fn)
    def compile(self, *args, **kwargs):
        for keyword in _KERAS2_COMPILE_KEYWORDS:
            kwargs.pop(keyword, None)
        return compile_fn(self, *args, **kwargs)

    compile._hybridsync_keras2 = True
    return compile


def _variable_ref(self):
    return object_identity.Reference(self)


def install() -> None:
    """Idempotent."""
    # Patched where Keras defines it (its Trainer), so Keras still sees a model's compile() as
    # its own (keras.models.load_model compiles a model only then).
    owner = next(c for c in keras.Model.__mro__ if "compile" in c.__dict__)
    if not getattr(owner.compile, "_hybridsync_keras2", False):
        owner.compile = _compile_accepting_keras2_keywords(owner.__dict__["compile"])
    # `variables` is a property of a base class of keras.optimizers.Optimizer (BaseOptimizer).
    prop = next((c.__dict__["variables"] for c in keras.optimizers.Optimizer.__mro__ if "variables" in c.__dict__),
                None)
    if isinstance(prop, property) and not getattr(prop.fget, "_hybridsync_keras2", False):
        getter = prop.fget

        def variables(self):
            return CallableList(getter(self))

        variables._hybridsync_keras2 = True
        owner = next(c for c in keras.optimizers.Optimizer.__mro__ if c.__dict__.get("variables") is prop)
        owner.variables = property(variables, prop.fset, prop.fdel, prop.__doc__)
    if not hasattr(keras.Variable, "ref"):
        keras.Variable.ref = _variable_ref
