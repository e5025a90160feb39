"""Horovod's DistributedOptimizer arguments for the Keras optimizer (hybridsync.tensorflow.optimizer),
checked and turned into its Settings, and horovod.tensorflow's DistributedOptimizer signature.
horovod.tensorflow.keras's signature is in hybridsync.tensorflow.keras; both end in distributed().

hybridsync's own arguments (config=, adaptive=, backend=) are keyword-only after Horovod's.
"""
from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from .. import config as config_mod
from .. import process_sets, runtime
from ..process_sets import global_process_set
from ..sync.base import check_options
from ..sync.process_set_scope import scope_for, set_config, sparse_as_dense_config
from ..comm.negotiation import horovod_op_name
from ..types import ReduceOp
from .compression import Compression, codec_name
from .optimizer import _DistributedKerasOptimizer
from .optimizer_methods import NAME, PACKAGE
from .tape import check_groups


@dataclasses.dataclass
class Settings:
    """A DistributedOptimizer's options, checked (see distributed())."""

    config: object  # the loaded config (hybridsync.config.Config) or None
    op: ReduceOp
    compression: str  # the sync core's codec: 'none' | 'fp16'
    gradient_predivide_factor: float = 1.0
    adaptive: object = None
    name: str | None = None
    device_dense: str = ""
    device_sparse: str = ""
    sparse_as_dense: bool = False
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    process_set: object = global_process_set
    scope: object = None  # hybridsync.sync.process_set_scope.scope_for(process_set)
    scale_local_gradients: bool = True
    config_arg: object = None  # the config as given (a path or a dict is saved with the model)
    model: object = None  # the Keras model whose plain Embedding layers may move to the PS shards

    def compressor(self):
        return Compression.fp16 if self.compression == "fp16" else Compression.none

    def to_config(self) -> dict:
        """What a saved model keeps (JSON): everything but objects of this process (local
        variables; a process set is kept as its ranks, to be registered again before loading)."""
        portable = self.config_arg if isinstance(self.config_arg, (str, dict)) else None
        adaptive = self.adaptive if isinstance(self.adaptive, (bool, dict)) else None
        ranks = None if process_sets.is_global(self.process_set) else list(self.process_set.ranks)
        return {"name": self.name, "compression": self.compression, "sparse_as_dense": self.sparse_as_dense,
                "gradient_predivide_factor": self.gradient_predivide_factor, "op": self.op.value,
                "backward_passes_per_step": self.backward_passes_per_step,
                "average_aggregated_gradients": self.average_aggregated_gradients,
                "scale_local_gradients": self.scale_local_gradients, "config": portable, "adaptive": adaptive,
                "process_set": ranks}

    @classmethod
    def from_config(cls, saved: dict) -> "Settings":
        process_set = global_process_set
        if saved.get("process_set") is not None:
            process_set = process_sets.by_ranks(saved["process_set"])
            if process_set is None:
                raise ValueError(f"the saved DistributedOptimizer reduced over process set {saved['process_set']}: "
                                 "register it (hvd.add_process_set) before loading the model")
        return settings(compression=saved["compression"], sparse_as_dense=saved["sparse_as_dense"],
                        gradient_predivide_factor=saved["gradient_predivide_factor"], op=saved["op"],
                        backward_passes_per_step=saved["backward_passes_per_step"],
                        average_aggregated_gradients=saved["average_aggregated_gradients"],
                        scale_local_gradients=saved["scale_local_gradients"], name=saved["name"],
                        process_set=process_set, config=saved["config"], adaptive=saved["adaptive"])


def _check_op(op) -> ReduceOp:
    """Average or Sum: what Horovod's Keras optimizer takes."""
    name = horovod_op_name(op)
    if name == "adasum":
        raise ValueError("op == Adasum is not supported yet with Keras")
    if name not in ("average", "sum"):
        raise ValueError("op currently only supports Average and Sum")
    return ReduceOp(name)


def settings(*, name=None, device_dense="", device_sparse="", compression=Compression.none, sparse_as_dense=False,
             gradient_predivide_factor=1.0, op=ReduceOp.AVERAGE, backward_passes_per_step=1,
             average_aggregated_gradients=False, num_groups=0, groups=None, process_set=global_process_set,
             scale_local_gradients=True, config=None, adaptive=None, backend=None, model=None,
             named_parameters=None) -> Settings:
    """Checks a DistributedOptimizer's arguments (every rank alike, before any collective)."""
    if named_parameters is not None:
        raise ValueError("named_parameters is a PyTorch argument: a Keras optimizer knows its variables")
    if model is not None and not isinstance(model, keras.layers.Layer):
        raise TypeError(f"model must be a Keras model (or layer), got {type(model).__module__}.{type(model).__qualname__}")
    if backend not in (None, "mpi"):
        raise ValueError(f"the TensorFlow frontend all-reduces over MPI (backend='mpi'); got backend={backend!r}")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name must be a string, got {name!r}")
    op = check_options(_check_op(op), gradient_predivide_factor, backward_passes_per_step)
    check_groups(num_groups, groups)
    runtime.init()
    scope = scope_for(process_set)
    if adaptive not in (None, False) and (backward_passes_per_step > 1 or scope is not None):
        raise ValueError("adaptive=... chooses its own accumulation over every rank: it takes neither "
                         "backward_passes_per_step > 1 nor a process set")
    if scope is not None:
        loaded = set_config(config, sparse_as_dense)
    elif sparse_as_dense:
        loaded = sparse_as_dense_config(config)
    else:
        loaded = config_mod.load(config if config is not None else runtime.default_config())
    return Settings(config=loaded, op=op, compression=codec_name(compression),
                    gradient_predivide_factor=float(gradient_predivide_factor), adaptive=adaptive, name=name,
                    device_dense=device_dense, device_sparse=device_sparse, sparse_as_dense=bool(sparse_as_dense),
                    backward_passes_per_step=int(backward_passes_per_step),
                    average_aggregated_gradients=bool(average_aggregated_gradients), process_set=process_set,
                    scope=scope, scale_local_gradients=bool(scale_local_gradients), config_arg=config, model=model)


def distributed(optimizer, **kwargs):
    """`optimizer` (a Keras 3 optimizer, the same object) made a DistributedOptimizer."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise NotImplementedError(
            f"{type(optimizer).__name__} is a TensorFlow 1 optimizer (tf.compat.v1.train.Optimizer), which runs in "
            "graph sessions; hybridsync distributes Keras 3 optimizers (keras.optimizers.SGD, Adam, ...): use one")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a Keras optimizer, got {type(optimizer).__module__}.{type(optimizer).__qualname__}")
    return wrap(optimizer, settings(**kwargs))


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=ReduceOp.AVERAGE, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True, *,
                         config=None, adaptive=None, backend=None, model=None, named_parameters=None):
    """horovod.tensorflow.DistributedOptimizer: `optimizer` (a Keras 3 optimizer; the same object
    is returned) now averages its gradients over the ranks before applying them.

    name: prefix of the exchange op's name. use_locking: TensorFlow 1's, accepted (Keras
    optimizers take none). device_dense / device_sparse: where TensorFlow places the exchange
    (collectives run in host memory). compression: Compression.none / fp16. sparse_as_dense:
    tf.IndexedSlices densified and all-reduced. backward_passes_per_step: gradients of that many
    apply() calls are summed locally and exchanged once (the others only count an iteration);
    average_aggregated_gradients: their mean instead of their sum. op: Average or Sum;
    gradient_predivide_factor: with Average, 1/f before the sum and f/size after it. num_groups /
    groups: accepted (hybridsync fuses every dense gradient into one collective). process_set:
    average over its members only (a rank outside it applies its own gradients).
    scale_local_gradients: register_local_var()'s variables get their gradient / size.

    hybridsync's: config (YAML path or dict: routes per variable, the parameter server),
    adaptive (docs/adaptive.md), backend ('mpi'), model (the Keras model: its built
    keras.layers.Embedding tables move to the PS shards now, as PyTorch's model= swaps its
    embeddings; without it they move when Keras's fit builds the optimizer)."""
    return distributed(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                       compression=compression, sparse_as_dense=sparse_as_dense,
                       backward_passes_per_step=backward_passes_per_step, op=op,
                       gradient_predivide_factor=gradient_predivide_factor,
                       average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
                       process_set=process_set, scale_local_gradients=scale_local_gradients, config=config,
                       adaptive=adaptive, backend=backend, model=model, named_parameters=named_parameters)


def wrap(optimizer, settings: Settings):
    """Makes `optimizer` (a Keras 3 optimizer, kept as the same object) synchronize its
    gradients as `settings` say."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"expected a Keras optimizer, got {type(optimizer).__module__}.{type(optimizer).__qualname__}")
    if isinstance(optimizer, _DistributedKerasOptimizer):
        raise ValueError("this optimizer is already a hybridsync DistributedOptimizer")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedKerasOptimizer, base),
               {"__module__": _DistributedKerasOptimizer.__module__, "from_config": classmethod(_from_config)})
    register_serializable(cls)
    optimizer.__class__ = cls
    optimizer._hs_setup(settings)
    return optimizer


def _from_config(cls, config, custom_objects=None):
    """The optimizer get_config() describes, wrapped again with its hybridsync settings (a wrapped
    optimizer's from_config, and what Keras calls when it loads a saved model)."""
    config = dict(config)
    extra = config.pop("hybridsync", None)
    if extra is None:
        raise ValueError("a hybridsync DistributedOptimizer's config has a 'hybridsync' entry (its wrapped "
                         "class and settings); this one has none")
    base = keras.saving.deserialize_keras_object({**extra["optimizer"], "config": config},
                                                 custom_objects=custom_objects)
    optimizer = wrap(base, Settings.from_config(extra))
    if extra.get("built_for") is not None:
        optimizer._hs_build_for = set(extra["built_for"])
    return optimizer


class _SavedDistributedOptimizer:
    """What Keras finds under 'hybridsync>DistributedOptimizer' when it loads a saved model."""

    from_config = classmethod(_from_config)

    def get_config(self):  # (Keras registers only classes that have one; this one is never instantiated)
        raise NotImplementedError


def register_serializable(cls=None) -> None:
    """Keras saves a wrapped optimizer (`cls`) as 'hybridsync>DistributedOptimizer' and loads that
    name through _SavedDistributedOptimizer.from_config, whatever optimizer it wraps."""
    register = keras.saving.register_keras_serializable(package=PACKAGE, name=NAME)
    if cls is not None:
        register(cls)
    register(_SavedDistributedOptimizer)  # (registering cls pointed the name at it: the loader is this class)


register_serializable()
