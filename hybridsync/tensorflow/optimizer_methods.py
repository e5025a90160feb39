"""What Horovod's Keras DistributedOptimizer offers beyond Keras's optimizer API, for the
hybridsync optimizer (mixed in front of it): local variables (register_local_var), gradients
computed and reduced before apply_gradients (_compute_gradients, compute_gradients,
get_gradients), Keras 2's apply_gradients keywords, and a config that rebuilds the wrapped
optimizer with its hybridsync settings -- also when Keras loads a saved model: the class is
registered for Keras serialization as 'hybridsync>DistributedOptimizer'.
"""
from __future__ import annotations

import keras
import tensorflow as tf

from .names import variable_name

PACKAGE, NAME = "hybridsync", "DistributedOptimizer"


def _ref(v):
    inner = getattr(v, "value", None)
    return (inner if isinstance(inner, tf.Variable) else v).ref()


class HorovodMethods:
    """Mixed in front of the wrapped optimizer's class, after hybridsync's own methods."""

    # -- local variables ------------------------------------------------------------------------
    def register_local_var(self, var):
        """Registers a variable as this worker's own: its gradient is not exchanged (only divided
        by the number of ranks when scale_local_gradients, Horovod's default). Register local
        variables before the first step."""
        if self._hs_plan is not None and any(v.access.variable is var for v in self._hs_vars):
            raise ValueError(f"register_local_var('{getattr(var, 'path', var.name)}'): the optimizer already "
                             "synchronizes it (its plan was made at the first step); register local variables "
                             "before training")
        self._hs_local[_ref(var)] = var

    # -- gradients reduced before apply_gradients ------------------------------------------------
    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """[(gradient, variable)] of `loss` (a tensor recorded by `tape`, or a callable), reduced
        over the ranks as Horovod's optimizer reduces them: dense gradients averaged (op,
        compression, gradient_predivide_factor), tf.IndexedSlices all-gathered or, with
        sparse_as_dense, densified; local variables' own, scaled. apply_gradients() then applies
        them as they are. With backward_passes_per_step > 1 they come back unreduced: the
        optimizer's apply() holds and exchanges them every backward_passes_per_step calls."""
        tape = tf.GradientTape() if tape is None else tape
        if callable(loss):
            with tape:
                if not callable(var_list):
                    tape.watch(var_list)
                loss = loss()
        if callable(var_list):
            var_list = var_list()
        var_list = list(var_list)
        grads = tape.gradient(loss, var_list, grad_loss)
        return list(zip(self._hs_reduce_now(list(grads), var_list), var_list))

    def compute_gradients(self, loss, var_list, tape=None):
        return self._compute_gradients(loss, var_list, None, tape)

    def get_gradients(self, loss, params):
        """Keras 1's API: the reduced gradients of a loss recorded with `loss` callable."""
        return [g for g, _ in self._compute_gradients(loss, params)]

    def _hs_reduce_now(self, grads, variables):
        from .tape import GradientReducer, _check_not_ps

        _check_not_ps(variables)
        if self._hs_passes > 1 or self._hs_adaptive is not None:
            return grads
        s = self._hs_settings
        reducer = GradientReducer(s.name or f"Distributed{type(self).__name__}", s.device_dense, s.device_sparse,
                                  s.compressor(), s.sparse_as_dense, s.op, s.gradient_predivide_factor,
                                  s.process_set)
        local = [self._hs_is_local(v) for v in variables]
        reduced = reducer([g for g, is_local in zip(grads, local) if not is_local]) if self._hs_scope is not False \
            else [g for g, is_local in zip(grads, local) if not is_local]
        reduced = iter(reduced)
        scale = self._hs_local_scale()
        out = [(_scale(g, scale) if is_local else next(reduced)) for g, is_local in zip(grads, local)]
        self._hs_reduced = out
        return out

    def _hs_take_reduced(self, grads) -> bool:
        """Whether apply() was given the gradients _compute_gradients() reduced (then forgotten)."""
        reduced, self._hs_reduced = self._hs_reduced, None
        return reduced is not None and len(reduced) == len(grads) and all(a is b for a, b in zip(grads, reduced))

    # -- Keras 2's keywords ------------------------------------------------------------------------
    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True, **kwargs):
        """Keras's apply_gradients; `name` and `experimental_aggregate_gradients` (Keras 2's
        keywords, which Horovod's examples pass) are accepted and have nothing left to do."""
        if kwargs:
            raise TypeError(f"apply_gradients() got unexpected keyword arguments {sorted(kwargs)}")
        return super().apply_gradients(list(grads_and_vars))

    # -- config and Keras serialization ------------------------------------------------------------
    def build(self, variables):
        """Keras's build; after from_config (a loaded model), only for the variables the saved
        optimizer had slots for, in their order -- those not on the parameter server -- so that
        its saved state loads into the same slots."""
        wanted = getattr(self, "_hs_build_for", None)
        if wanted is not None:
            variables = [v for v in variables if _name(v) in wanted]
        return super().build(variables)

    def get_config(self):
        """The wrapped optimizer's config, and under 'hybridsync' its class and the settings
        that from_config() (and keras.models.load_model) wrap it with again."""
        config = super().get_config()
        base_cls = type(self).__bases__[-1]  # hybridsync.tensorflow.optimizer.wrap: (its methods, the class)
        identity = keras.saving.serialize_keras_object(base_cls.from_config(config))
        identity = {k: identity.get(k) for k in ("module", "class_name", "registered_name")}
        built_for = [_name(v) for v in self._trainable_variables] if self.built else None
        return {**config, "hybridsync": {"optimizer": identity, "built_for": built_for,
                                         **self._hs_settings.to_config()}}


def _name(v) -> str:
    return variable_name(v)


def _scale(grad, factor: float):
    if grad is None or factor == 1.0:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)
