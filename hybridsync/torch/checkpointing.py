"""What hybridsync.checkpoint needs from a torch model and optimizer: the dense state as NumPy
arrays plus JSON, and back. Tables on the parameter server are not here: their shards are
written by their owners (hybridsync.checkpoint refreshes a replicated table's replica after a load)."""
from __future__ import annotations

import numpy as np
import torch

from ..array_files import RawBits
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


_UNSIGNED = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32),
             8: (torch.int64, np.uint64)}


def _to_array(t: torch.Tensor):
    """A tensor as the checkpoint stores it, dtype kept: a NumPy array, or the raw bits of a
    dtype NumPy lacks (bfloat16, float8)."""
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16,) or (t.dtype.is_floating_point and t.element_size() == 1):
        as_int, unsigned = _UNSIGNED[t.element_size()]
        return RawBits(t.contiguous().view(as_int).numpy().view(unsigned), str(t.dtype).removeprefix("torch."))
    return t.numpy()


def _from_array(value, key: str) -> torch.Tensor:
    """What _to_array stored, back as a tensor of its dtype."""
    if not isinstance(value, RawBits):
        return torch.from_numpy(np.array(value))  # (a copy: the file's memory is read-only)
    dtype = getattr(torch, value.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint entry '{key}' has dtype '{value.dtype}', which this torch does not know")
    as_int, _ = _UNSIGNED[value.bits.dtype.itemsize]
    return torch.from_numpy(np.array(value.bits)).view(as_int).view(dtype)


def before_load(model, optimizer, manifest: dict) -> None:
    """Nothing to do: a torch DistributedOptimizer has its plan from the start."""


def dense_state(model, optimizer, variables) -> tuple[dict, dict]:
    arrays = {f"model.{name}": _to_array(t) for name, t in _dense_tensors(model, variables)}
    state = torch.optim.Optimizer.state_dict(optimizer)  # the wrapped optimizer's own state only
    scalars = {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):  # 0-d ones too (Adam's step): their dtype is kept
                arrays[f"optimizer.{index}.{key}"] = _to_array(value)
            else:
                scalars[f"{index}.{key}"] = [_json(value), False]
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
            t.copy_(_from_array(arrays[f"model.{name}"], name))
    state = {}
    for key, value in arrays.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = _from_array(value, key)
    for key, (value, was_tensor) in meta["optimizer_scalars"].items():  # (was_tensor: older checkpoints)
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = torch.tensor(value) if was_tensor else value
    torch.optim.Optimizer.load_state_dict(optimizer, {"state": state, "param_groups": meta["param_groups"]})
    adaptive = getattr(optimizer, "_hs_adaptive", None)
    if "adaptive" in meta and adaptive is not None and adaptive.enabled:
        adaptive.load_state_dict(meta["adaptive"])  # at another world size: the global batch, re-chosen later
