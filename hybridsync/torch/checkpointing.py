"""What hybridsync.checkpoint needs from a torch model and optimizer: the dense state as NumPy
arrays plus JSON, and back. Tables on the parameter server are not here: their shards are
written by their owners (hybridsync.checkpoint refreshes a replicated table's replica after a load)."""
from __future__ import annotations

import torch

from ..checkpoint import check_dense_match
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
    check_dense_match({name: t.shape for name, t in mine.items()},
                      {k[len("model."):]: v.shape for k, v in arrays.items() if k.startswith("model.")})
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
