"""hybridsync: hybrid synchronization for distributed training.

Dense gradients go through all-reduce (Horovod, or MPI via mpi4py); sparse embedding
gradients go to a C++ parameter server whose shards live on the ranks.
"""

from . import config as config_mod
from . import runtime
from .comm import choose
from .comm import horovod as horovod_backend
from .comm import objects as object_collectives  # (`objects` is the hybridsync.objects module's name)
from .frontend import framework_of, module_for
from .runtime import is_initialized, shutdown, world

__version__ = "0.1.0"


def init(comm=None, backend: str | None = None, config=None) -> None:
    """Joins the job: MPI through mpi4py (`comm` replaces COMM_WORLD), and Horovod on the same
    communicator when torch is already imported and Horovod is installed (otherwise Horovod
    starts when the PyTorch frontend first needs it). Idempotent.

    backend: default dense backend of this process, 'horovod' or 'mpi' (overrides
    HYBRIDSYNC_BACKEND; a DistributedOptimizer's own `backend=` overrides it).
    config: YAML path or dict used by DistributedOptimizers given no config (overrides
    HYBRIDSYNC_CONFIG); it is validated here, on every rank, before any communication."""
    runtime.init(comm)
    if config is not None:
        loaded = config_mod.load(config)
        runtime.set_default_config(loaded)
        if backend is None and loaded.backend is not None:
            backend = loaded.backend
    if backend is not None:
        runtime.set_default_backend(choose(backend))
        if runtime.default_backend() == "horovod":  # asked for: Horovod joins the job now, on its communicator
            horovod_backend.module()
    runtime.run_init_hooks()  # a frontend imported already starts what it needs (Horovod for torch)


def rank() -> int:
    """This process's rank in the job (joins the job on first use)."""
    return world().rank


def size() -> int:
    """Number of processes in the job."""
    return world().size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return world().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return world().local_size


def DistributedOptimizer(optimizer, *args, **kwargs):
    """Wraps a PyTorch or Keras optimizer for hybrid synchronization (framework detected from
    the optimizer). See hybridsync.torch.DistributedOptimizer and
    hybridsync.tensorflow.DistributedOptimizer for the arguments."""
    frontend = module_for(optimizer)
    if frontend is None:
        raise TypeError(
            "hybridsync.DistributedOptimizer wraps a torch.optim.Optimizer or a Keras optimizer "
            f"(keras.optimizers.SGD/Adam/Adagrad); got {type(optimizer).__module__}.{type(optimizer).__qualname__}")
    return frontend.DistributedOptimizer(optimizer, *args, **kwargs)


def explain(file=None, as_json: bool = False) -> str:
    """Prints the plan (one row per variable: route, placement, shards, server optimizer,
    bytes per step, and why) of every live DistributedOptimizer; returns the text."""
    from .planning import explain as _explain  # (the planning loads the C++ engine, and with it MPI)

    return _explain(file=file, as_json=as_json)


def save_checkpoint(path, model, optimizer, extra=None):
    """Collective: a sharded, atomic checkpoint of model, optimizer and parameter-server state
    (PyTorch or Keras; see hybridsync.checkpoint). extra: JSON data kept with it."""
    from .checkpoint import save_checkpoint as _save  # (loads the C++ engine, and with it MPI)

    return _save(path, model, optimizer, extra)


def load_checkpoint(path, model, optimizer):
    """Collective: restores a checkpoint at any world size; returns its `extra`."""
    from .checkpoint import load_checkpoint as _load

    return _load(path, model, optimizer)


def _first_value(params):
    values = list(params.values()) if isinstance(params, dict) else list(params)
    first = values[0] if values else None
    return first[1] if isinstance(first, tuple) and len(first) == 2 else first


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Collective: every rank's parameters become root_rank's, in place. PyTorch: a module, its
    state_dict(), named_parameters() or tensors; TensorFlow/Keras: a model or its variables
    (framework detected from the values)."""
    if framework_of(params) == "torch" and hasattr(params, "state_dict"):
        params = params.state_dict()  # a module
    elif hasattr(params, "variables") and not isinstance(params, (dict, list, tuple)):
        params = params.variables  # a Keras model or layer
    params = params if isinstance(params, dict) else list(params)
    first = _first_value(params)
    if first is None:
        return None
    framework = framework_of(first)
    if framework == "torch":
        return module_for(first).broadcast_parameters(params, root_rank)
    if framework == "tensorflow":
        return module_for(first).broadcast_variables(params, root_rank)
    raise TypeError(f"broadcast_parameters takes torch tensors (a state_dict, named_parameters()) or TensorFlow/Keras "
                    f"variables; got {type(first).__module__}.{type(first).__qualname__}")


def broadcast_optimizer_state(optimizer, root_rank: int = 0) -> None:
    """Collective: every rank's optimizer state and hyper-parameters become root_rank's
    (torch.optim: hybridsync.torch.broadcast_optimizer_state; Keras: its variables)."""
    framework = framework_of(optimizer)
    if framework == "torch":
        return module_for(optimizer).broadcast_optimizer_state(optimizer, root_rank)
    if framework == "tensorflow":
        return module_for(optimizer).broadcast_variables(list(optimizer.variables), root_rank)
    raise TypeError("broadcast_optimizer_state takes a torch.optim.Optimizer or a Keras optimizer; got "
                    f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")


def broadcast_object(obj, root_rank: int = 0, name=None):
    """Collective: root_rank's picklable `obj`, on every rank."""
    return object_collectives().broadcast_object(obj, root_rank, name=name)


def allgather_object(obj, name=None) -> list:
    """Collective: every rank's picklable `obj`, as a list in rank order."""
    return object_collectives().allgather_object(obj, name=name)


from .config import ConfigError, ConfigWarning  # noqa: E402

__all__ = ["init", "is_initialized", "shutdown", "rank", "size", "local_rank", "local_size",
           "DistributedOptimizer", "explain", "ConfigError", "ConfigWarning", "save_checkpoint", "load_checkpoint",
           "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]
