"""The server-side rule that applies a torch optimizer's update to a sparse table.

SGD (no momentum / weight decay) -> sgd; Adagrad -> adagrad; Adam, AdamW (no weight decay)
and SparseAdam -> adam, applied lazily (only rows with a gradient move, as SparseAdam does).
Anything else cannot be applied row by row and is an error naming the variable.
"""
from __future__ import annotations

import torch


class UnsupportedSparseOptimizer(ValueError):
    """The wrapped optimizer has no server-side equivalent for a sparse table."""


def _reject(name: str, optimizer, reason: str):
    raise UnsupportedSparseOptimizer(
        f"variable '{name}': {type(optimizer).__name__} {reason}, which the parameter server cannot apply to "
        "a sparse table row by row; use SGD (no momentum), Adagrad, Adam or SparseAdam for it, or give it a "
        "server optimizer in the config (variables: - match: ... optimizer: {name: adagrad, lr: ...})")


def server_rule(optimizer, group: dict, name: str) -> dict:
    """{"name": rule, **hyper-parameters} for variable `name` in param group `group`."""
    def nonzero(key):
        return float(group.get(key, 0) or 0) != 0.0

    if group.get("maximize", False):
        _reject(name, optimizer, "with maximize=True")
    lr = float(group["lr"])
    if isinstance(optimizer, torch.optim.SparseAdam) or isinstance(optimizer, torch.optim.Adam):
        if nonzero("weight_decay"):
            _reject(name, optimizer, f"with weight_decay={group['weight_decay']}")
        if group.get("amsgrad", False):
            _reject(name, optimizer, "with amsgrad=True")
        beta1, beta2 = group["betas"]
        return {"name": "adam", "lr": lr, "beta1": float(beta1), "beta2": float(beta2), "eps": float(group["eps"])}
    if isinstance(optimizer, torch.optim.Adagrad):
        if nonzero("weight_decay"):
            _reject(name, optimizer, f"with weight_decay={group['weight_decay']}")
        return {"name": "adagrad", "lr": lr, "lr_decay": float(group["lr_decay"]),
                "initial_accumulator_value": float(group["initial_accumulator_value"]), "eps": float(group["eps"])}
    if isinstance(optimizer, torch.optim.SGD):
        if nonzero("momentum"):
            _reject(name, optimizer, f"with momentum={group['momentum']}")
        if nonzero("weight_decay"):
            _reject(name, optimizer, f"with weight_decay={group['weight_decay']}")
        return {"name": "sgd", "lr": lr}
    _reject(name, optimizer, "is not supported")


def group_of(optimizer, param) -> dict:
    """The param group holding `param`; the first group for tables that are not parameters."""
    if param is not None:
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return group
    return optimizer.param_groups[0]
