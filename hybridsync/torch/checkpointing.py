"""What hybridsync.checkpoint needs from a torch model and optimizer: the dense state as NumPy
arrays plus JSON, and back. Tables on the parameter server are not here: their shards are
written by their owners (a replicated table's replica is refreshed from them after a load)."""
from __future__ import annotations

import torch

from ..types import Placement


def _replicas(variables) -> set:
    return {id(var.access.param) for var in variables if var.plan.placement is Placement.REPLICATED}


def _dense_tensors(model, variables):
    """(name, tensor) of the model's parameters and buffers that are not on the PS."""
    skip = _replicas(variables)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) not in skip and t.numel() > 0:  # a table swapped onto the shards is left empty
            yield name, t


def _json(value):
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def dense_state(model, optimizer, variables) -> tuple[dict, dict]:
    arrays = {f"model.{name}": t.detach().cpu().numpy() for name, t in _dense_tensors(model, variables)}
    state = torch.optim.Optimizer.state_dict(optimizer)  # the wrapped optimizer's own state only
    scalars = {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                arrays[f"optimizer.{index}.{key}"] = value.detach().cpu().numpy()
            else:
                scalars[f"{index}.{key}"] = [_json(value), isinstance(value, torch.Tensor)]
    groups = [{k: _json(v) for k, v in group.items()} for group in state["param_groups"]]
    meta = {"optimizer_scalars": scalars, "param_groups": groups}
    adaptive = getattr(optimizer, "_hs_adaptive", None)
    if adaptive is not None and adaptive.enabled:  # statistics, batch, scale-invariant progress
        meta["adaptive"] = adaptive.controller.state_dict()
    return arrays, meta


def load_dense_state(model, optimizer, variables, arrays: dict, meta: dict) -> None:
    mine = dict(_dense_tensors(model, variables))
    saved = {k[len("model."):] for k in arrays if k.startswith("model.")}
    for name in sorted(set(mine) ^ saved):
        where = "the model" if name in mine else "the checkpoint"
        raise ValueError(f"variable '{name}' is only in {where} (a checkpoint of another model?)")
    for name, t in mine.items():
        value = arrays[f"model.{name}"]
        if tuple(value.shape) != tuple(t.shape):
            raise ValueError(f"variable '{name}': checkpoint has shape {tuple(value.shape)}, the model {tuple(t.shape)}")
    with torch.no_grad():
        for name, t in mine.items():
            t.copy_(torch.from_numpy(arrays[f"model.{name}"]))
    state = {}
    for key, value in arrays.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = torch.from_numpy(value.copy())
    for key, (value, was_tensor) in meta["optimizer_scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = torch.tensor(value) if was_tensor else value
    torch.optim.Optimizer.load_state_dict(optimizer, {"state": state, "param_groups": meta["param_groups"]})
    adaptive = getattr(optimizer, "_hs_adaptive", None)
    if "adaptive" in meta and adaptive is not None and adaptive.enabled:
        adaptive.load_state_dict(meta["adaptive"])  # at another world size: the global batch, re-chosen later


def refresh_replica(var, table) -> None:
    """Collective for replicated tables: every replica takes the loaded rows whole."""
    if var.plan.placement is not Placement.REPLICATED:
        return
    var.access.set_replica(table.read())
    if table.attached is None:  # the shard keeps a copy of its own: refresh it too
        table.scatter(var.access.replica_copy())
