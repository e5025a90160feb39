"""Starting every rank from rank 0's model and optimizer, and Python objects across ranks
(the functions of horovod.torch.functions)."""
from __future__ import annotations

import torch

from ... import objects
from . import mpi_ops, ops
from .process_sets import global_process_set


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """root_rank's `obj` (pickled; any picklable object), on every rank of the process set."""
    route, name = ops.route(process_set), objects.auto_name("broadcast_object", name, process_set)
    if isinstance(route, ops._HorovodTorch) and route.engine is None:  # horovodrun --gloo
        return route.hvd.broadcast_object(obj, root_rank, name=name)
    return objects.broadcast(route.engine, obj, root_rank, ops.global_rank(), name)


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's `obj`, as a list in rank order."""
    route, name = ops.route(process_set), objects.auto_name("allgather_object", name, process_set)
    if isinstance(route, ops._HorovodTorch) and route.engine is None:  # horovodrun --gloo
        return route.hvd.allgather_object(obj, name=name)
    return objects.allgather(route.engine, obj, name)


def _is_ps_backed(tensor) -> bool:
    # Tables that live on the parameter server are already consistent across ranks.
    return getattr(tensor, "_hybridsync_ps_table", False)


def broadcast_parameters(params, root_rank=0, process_set=global_process_set):
    """Makes every rank's tensors equal to root_rank's, in place.

    params: model.state_dict(), model.named_parameters(), model.parameters(), or a list of
    tensors or (name, tensor) pairs."""
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        try:
            items = [p if isinstance(p, tuple) else (None, p) for p in params]
        except TypeError:
            raise ValueError(f"invalid params of type: {type(params).__name__}") from None
    if any(len(x) != 2 for x in items):
        raise ValueError("broadcast_parameters takes a state_dict, tensors or (name, tensor) pairs, "
                         "e.g. model.named_parameters()")
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters: '{name}' is a {type(tensor).__name__}, not a tensor")
    if ops.set_size(process_set) == 1:
        return
    handles = [mpi_ops.broadcast_async_(t.detach(), root_rank, name, process_set)
               for name, t in items if not _is_ps_backed(t)]
    for handle in handles:  # one negotiation for all of them on the MPI backend
        mpi_ops.synchronize(handle)


def _base_step(optimizer) -> None:
    """The wrapped optimizer's own update (a DistributedOptimizer's step() would exchange
    gradients, which only works if every rank calls it)."""
    from ..optimizer import _DistributedOptimizer

    if isinstance(optimizer, _DistributedOptimizer):
        super(_DistributedOptimizer, optimizer).step()
    else:
        type(optimizer).step(optimizer)


def _initialise_state(optimizer, model) -> None:
    """Horovod's way to create state on a fresh optimizer: one step with zero gradients for
    every parameter that trains. Parameter values and existing gradients are restored afterwards,
    so only the state changes (an AdamW step would otherwise decay the weights); a parameter that
    had no gradient keeps the zero one, as in Horovod (scripts read p.grad afterwards)."""
    sparse = set()
    if model is not None:
        sparse = {id(m.weight) for m in model.modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad or p in optimizer.state:
                continue
            saved.append((p, p.grad, p.detach().clone()))
            grad = torch.zeros_like(p)
            if isinstance(optimizer, torch.optim.SparseAdam) or (isinstance(optimizer, torch.optim.SGD)
                                                                and id(p) in sparse):
                grad = grad.to_sparse()
            p.grad = grad
    if not saved:
        return
    _base_step(optimizer)
    with torch.no_grad():
        for p, grad, value in saved:
            p.copy_(value)
            if grad is not None:
                p.grad = grad


def _assign_option(group: dict, key, value) -> None:
    """group[key] = value; a tensor hyper-parameter (lr=torch.tensor(...)) is copied into the
    tensor this rank already has, which keeps its device and the objects LR schedulers hold."""
    current = group.get(key)
    if torch.is_tensor(current) and torch.is_tensor(value) and current.shape == value.shape:
        with torch.no_grad():
            current.copy_(value)
    elif torch.is_tensor(value) and torch.is_tensor(current):
        group[key] = value.to(current.device)
    else:
        group[key] = value


def _state_layout(optimizer) -> dict:
    """{(group, index): {key: ('tensor', shape, dtype) | ('value', v)}} of every parameter with state."""
    layout = {}
    for i, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if p in optimizer.state:
                layout[i, j] = {k: ("tensor", tuple(v.shape), v.dtype) if torch.is_tensor(v) else ("value", v)
                                for k, v in optimizer.state[p].items()}
    return layout


def broadcast_optimizer_state(optimizer, root_rank=0, model=None, process_set=global_process_set):
    """Makes every rank's optimizer state and hyper-parameters (lr, momentum, ...) equal to
    root_rank's, for every torch.optim optimizer (LBFGS too, which Horovod refuses). A rank whose
    optimizer has no state yet first creates it with a zero-gradient step, as Horovod does (not
    LBFGS: its step needs a closure); then state tensors are broadcast in place and everything
    else (options, tensor hyper-parameters included, and non-tensor state) as one object; state
    the root has not got (a parameter without gradient) is dropped. Server-side state of
    parameter-server tables lives on the shards and is not copied. model: lets sparse embedding
    weights get sparse zero gradients."""
    if ops.set_size(process_set) == 1:
        return
    if len(optimizer.state) == 0 and not isinstance(optimizer, torch.optim.LBFGS):
        _initialise_state(optimizer, model)
    groups = optimizer.param_groups
    meta = None
    if ops.global_rank() == root_rank:
        meta = {"options": [{k: v for k, v in g.items() if k != "params"} for g in groups],
                "sizes": [len(g["params"]) for g in groups], "state": _state_layout(optimizer)}
    meta = broadcast_object(meta, root_rank, name="optimizer_state.meta", process_set=process_set)
    if meta["sizes"] != [len(g["params"]) for g in groups]:
        raise ValueError(f"broadcast_optimizer_state: rank {root_rank}'s optimizer has param_groups of sizes "
                         f"{meta['sizes']}, this rank's {[len(g['params']) for g in groups]}; every rank must "
                         "build the same optimizer")
    handles = []
    for i, group in enumerate(groups):
        for key, value in meta["options"][i].items():
            _assign_option(group, key, value)
        for j, p in enumerate(group["params"]):
            wanted = meta["state"].get((i, j))
            if wanted is None:
                optimizer.state.pop(p, None)
                continue
            state = optimizer.state[p]
            for key in [k for k in state if k not in wanted]:
                del state[key]
            for key, (kind, *spec) in sorted(wanted.items(), key=lambda kv: str(kv[0])):
                if kind == "value":
                    state[key] = spec[0]
                    continue
                current = state.get(key)
                if not (torch.is_tensor(current) and tuple(current.shape) == spec[0] and current.dtype == spec[1]):
                    device = current.device if torch.is_tensor(current) else p.device
                    state[key] = current = torch.zeros(spec[0], dtype=spec[1], device=device)
                handles.append(mpi_ops.broadcast_async_(current, root_rank, f"optimizer_state.{i}.{j}.{key}",
                                                        process_set))
    for handle in handles:
        mpi_ops.synchronize(handle)
