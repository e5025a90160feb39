"""Plain `keras.layers.Embedding` tables moved onto the parameter server's shards.

Why: Keras 3's Embedding looks rows up with `ops.take`, which reads its whole variable, and once
a sparse update (a scatter) has touched a TensorFlow variable, every whole read of it copies it
(TensorFlow's copy-on-read mode keeps reads consistent with later scatters): a 250,000 x 32 table
costs a 32 MB copy per lookup, every step -- with or without hybridsync -- and hybridsync's
replicated route keeps a second copy on the shards besides. The sharded layer
(hybridsync.tensorflow.Embedding) has neither: its rows live only on the shards.

So a DistributedOptimizer that sees the model before the step is traced (`model=`; in `fit`,
Horovod's BroadcastGlobalVariablesCallback at train begin; Keras building the optimizer
eagerly) turns each plain Embedding whose variable the plan puts on the
sharded PS into a sharded layer, in place: the layer object stays where the model holds it (its
name, mask and config), its class becomes ShardedKerasEmbedding (the sharded layer's lookup), its
rows move to the shards from rank 0's values (Horovod's broadcast-from-rank-0 start), and its
TensorFlow variable is dropped. A layer whose semantics the shards cannot reproduce exactly
stays as it is, with a warning naming it and why.
"""
from __future__ import annotations

import ctypes
import os
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from .. import runtime
from ..planning import VariablePlan
from ..ps.table import PSTable
from ..types import GradKind, Placement, Route
from .embedding import Embedding as ShardedEmbedding
from .names import variable_name
from .table_weight import TableWeight

_LAYER_OF_VARIABLE = "_hybridsync_embedding_layer"  # on an Embedding's variable: a weakref to its layer
_warned = weakref.WeakSet()  # layers already warned about
_libc = ctypes.CDLL(None)
_MADV_DONTNEED = 4  # (Linux)


def install() -> None:
    """Each keras.layers.Embedding built from now on marks its variable with its layer, so that
    an optimizer handed only variables (Keras's fit builds it with model.trainable_variables)
    can find the layers to move. Idempotent."""
    build = keras.layers.Embedding.build
    if getattr(build, "_hybridsync_marks_layer", False):
        return

    def marking_build(self, input_shape=None):
        build(self, input_shape)
        variable = getattr(self, "_embeddings", None)
        if variable is not None:
            setattr(variable, _LAYER_OF_VARIABLE, weakref.ref(self))

    marking_build._hybridsync_marks_layer = True
    keras.layers.Embedding.build = marking_build


def layer_of(variable):
    """The keras.layers.Embedding whose table `variable` is (built after install()), or None."""
    ref = getattr(variable, _LAYER_OF_VARIABLE, None)
    layer = ref() if ref is not None else None
    return layer if layer is not None and getattr(layer, "_embeddings", None) is variable else None


def plain_embeddings(model) -> list:
    """The keras.layers.Embedding layers in `model` (itself, if it is one; or a list of
    layers), each once, not yet moved. (Layer._flatten_layers: the walk Keras itself uses to
    collect a model's variables.)"""
    layers = model._flatten_layers(include_self=True, recursive=True) if isinstance(model, keras.layers.Layer) \
        else list(model)
    return [layer for layer in layers if isinstance(layer, keras.layers.Embedding)
            and not isinstance(layer, ShardedKerasEmbedding)]


def why_not_movable(layer) -> str | None:
    """Why the shards cannot stand in for `layer` exactly (None: they can)."""
    if type(layer) is not keras.layers.Embedding:
        return f"it is a subclass ({type(layer).__qualname__}) whose lookup hybridsync cannot know"
    if not layer.built:
        return "it was not built before the step was traced (call the model on a batch before wrapping or fitting)"
    if layer.embeddings_regularizer is not None:
        return "its embeddings_regularizer reads the whole table every step"
    if layer.embeddings_constraint is not None:
        return "its embeddings_constraint rewrites the whole table after each update"
    if layer.lora_enabled or layer.quantization_mode is not None:
        return "it is LoRA-enabled or quantized"
    if np.dtype(layer._embeddings.dtype) != np.float32:
        return (f"its table is {layer._embeddings.dtype} and the parameter server holds float32 rows (a "
                "'mixed_float16' / 'mixed_bfloat16' policy keeps float32 variables; storage: {dtype: ...} "
                "stores rows in 16 bits)")
    return None


def warn_kept(layer, why: str) -> None:
    """Once per layer (rank 0): it keeps its TensorFlow variable, and why."""
    if layer in _warned:
        return
    _warned.add(layer)
    if runtime.world().rank == 0:
        warnings.warn(f"keras.layers.Embedding '{layer.name}' stays a TensorFlow variable (a whole table per rank, "
                      f"replicated on the parameter server) instead of moving to the PS shards: {why}", stacklevel=3)


def config_keeps(resolver, plan) -> bool:
    """Whether the config routes a plain Keras Embedding's variable (`plan`, a VariablePlan) off
    the sharded PS -- allgather, allreduce, replicated, or an explicit `sync: auto` (it measures
    routes on a replica): then the layer keeps its TensorFlow variable."""
    wanted, _ = resolver.settings_for(plan)
    return wanted.sync not in (None, "ps") or wanted.placement not in (None, "sharded")


def move_layers(layers, resolver, *, optimizer_built: bool) -> dict:
    """Collective: each built layer of `layers` that `resolver` (the optimizer's RouteResolver,
    planning with the model) puts on the sharded PS moves there; the others keep their variable
    -- silently where the config routes it elsewhere, with a warning where the shards cannot
    reproduce the layer. Returns {id(old variable): the moved layer's anchor}."""
    moved = {}
    for layer in layers:
        if not layer.built:
            continue  # (moved when the optimizer builds, once the model is)
        variable = layer._embeddings
        name = variable_name(variable)
        plan = VariablePlan(name=name, shape=tuple(variable.shape), dtype=tf.as_dtype(variable.dtype).name,
                            kind=GradKind.SPARSE, route=None)
        if config_keeps(resolver, plan):
            continue
        why = why_not_movable(layer)
        if why is None and optimizer_built:
            why = "the optimizer was built (with its variable) before hybridsync could move it"
        if why is not None:
            warn_kept(layer, why)
            continue
        try:
            resolver.decide(plan, variable)
        except ValueError:
            continue  # (the plan raises it at the first step, naming the variable, as for any table)
        if plan.route is Route.PS and plan.placement is Placement.SHARDED:
            moved[id(variable)] = layer  # (the id of a variable about to go: taken while it lives)
            move_to_shards(layer, name, shards=plan.shards, partition=plan.partition, storage=plan.storage or None)
    return {key: layer.ps_anchor for key, layer in moved.items()}


def move_to_shards(layer, name: str, *, shards: int, partition: str, storage=None) -> None:
    """Collective (every rank, same layers, same order): `layer`'s rows move onto a PS table
    named `name` from rank 0's values; its variable is dropped and its class becomes
    ShardedKerasEmbedding."""
    variable = layer._embeddings
    root = runtime.world().rank == 0
    # The variable's own memory (a read aliases it, unless a scatter has put the variable in
    # copy-on-read mode: then a copy): rank 0's pages go back to the system as its rows reach
    # the shards, the other ranks' at once. TensorFlow's allocator keeps what it frees, so
    # dropping the variable alone would leave the table resident.
    own = variable.value.read_value()._numpy()  # (np.asarray would alias it read-only)
    del layer._embeddings  # Keras untracks it
    _empty(variable)  # whoever still holds it (a list of the model's variables) holds no rows
    layer._tracker.unlock()
    try:
        layer.__class__ = ShardedKerasEmbedding
        layer.ps_anchor = layer.add_weight(shape=(1,), initializer="zeros", trainable=True, name="ps_anchor")
        layer.ps_anchor._hybridsync_table = layer  # the optimizer routes this variable's gradient to the PS
        layer._hs_table_name = name
        layer._table_weight = TableWeight(layer)
        layer.table = PSTable(name, layer.input_dim, layer.output_dim, shards, partition, storage=storage)
    finally:
        layer._tracker.lock()
    layer.table.load_from_root(own if root else None, 0, consume=root)
    if not root:
        _give_pages_back(own)


def _empty(variable) -> None:
    """A Keras variable made (0, dim): its table's memory is no longer its own."""
    dim = int(variable.shape[1])
    variable._shape = (0, dim)
    variable._initialize(np.zeros((0, dim), np.float32))


def _give_pages_back(array: np.ndarray) -> None:
    """The pages wholly inside `array` go back to the system (MADV_DONTNEED; they read as
    zeros if touched again), as the C++ core does with a table it loads by consuming it."""
    page = os.sysconf("SC_PAGE_SIZE")
    first = -(-array.ctypes.data // page) * page
    last = (array.ctypes.data + array.nbytes) // page * page
    if last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)  # advisory


@keras.saving.register_keras_serializable(package="hybridsync")
class ShardedKerasEmbedding(ShardedEmbedding, keras.layers.Embedding):
    """A keras.layers.Embedding whose table a DistributedOptimizer moved to the PS shards (never
    built directly: move_to_shards makes it). It keeps the Keras layer's config and mask
    (mask_zero); its weights are the sharded layer's (the anchor, then the table, read and
    written one-sided); and it saves as a Keras Embedding: model.save_weights / model.save files hold the
    table under the Keras layer's key, and load back into a plain Keras model."""

    @property
    def embeddings(self):
        raise AttributeError(
            f"layer '{self.name}': its table was moved to the parameter server shards by hybridsync's "
            "DistributedOptimizer, so it has no TensorFlow variable: read it with layer.get_table() or "
            "get_weights(), or keep the layer's variable with a config rule for it (placement: replicated)")

    def call(self, inputs):
        if isinstance(inputs, (tf.SparseTensor, tf.RaggedTensor)):
            raise TypeError(f"layer '{self.name}': the parameter server looks up dense id tensors, got a "
                            f"{type(inputs).__name__}; keep this layer's variable with a config rule for "
                            f"'{self._hs_table_name}' (placement: replicated)")
        return tf.cast(super().call(inputs), self.compute_dtype)

    def save_own_variables(self, store):
        store["0"] = self._table_weight  # (read from the shards when Keras converts it)

    def load_own_variables(self, store):
        self.set_table(np.asarray(store["0"]))

    def get_config(self):
        return keras.layers.Embedding.get_config(self)

    @classmethod
    def from_config(cls, config):
        """A saved model loads it as the plain Keras Embedding it was (a DistributedOptimizer that
        sees the loaded model moves it again)."""
        return keras.layers.Embedding.from_config(config)


# Keras names a layer's entry in a weights file by its class's name: a moved layer's must be a
# Keras Embedding's, so that files load across plain and moved models.
ShardedKerasEmbedding.__name__ = "Embedding"
