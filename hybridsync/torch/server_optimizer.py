"""A torch optimizer described for hybridsync.ps.rules (which decides the server rule
and words the errors): SGD -> sgd; Adagrad -> adagrad; Adam, AdamW and SparseAdam -> adam
(lazy); settings the server cannot apply row by row are listed as blockers."""
from __future__ import annotations

import torch

from ..ps.rules import OptimizerSpec

# Optimizers that apply a sparse gradient themselves (the allgather route needs one).
_SPARSE_CAPABLE = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


def describe(optimizer, group: dict) -> OptimizerSpec:
    """The optimizer with the hyper-parameters of param group `group`."""
    def set_(key):
        return float(group.get(key, 0) or 0) != 0.0

    blockers = [("maximize", True)] if group.get("maximize", False) else []
    lr = float(group["lr"])
    family, hparams = None, {}
    if isinstance(optimizer, (torch.optim.SparseAdam, torch.optim.Adam)):  # AdamW is an Adam
        beta1, beta2 = group["betas"]
        family, hparams = "adam", {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": group["eps"]}
        blockers += [(k, group[k]) for k in ("weight_decay",) if set_(k)]
        blockers += [("amsgrad", True)] if group.get("amsgrad", False) else []
    elif isinstance(optimizer, torch.optim.Adagrad):
        family = "adagrad"
        hparams = {"lr": lr, "lr_decay": group["lr_decay"], "initial_accumulator_value": group["initial_accumulator_value"],
                   "eps": group["eps"]}
        blockers += [(k, group[k]) for k in ("weight_decay",) if set_(k)]
    elif isinstance(optimizer, torch.optim.SGD):
        family, hparams = "sgd", {"lr": lr}
        blockers += [(k, group[k]) for k in ("momentum", "weight_decay") if set_(k)]
    # torch coalesces a sparse gradient (sums duplicate rows) before applying it, as the server does
    return OptimizerSpec(type(optimizer).__name__, family, hparams, blockers,
                         applies_sparse=isinstance(optimizer, _SPARSE_CAPABLE),
                         sparse_exact=isinstance(optimizer, _SPARSE_CAPABLE))


def group_of(optimizer, param) -> dict:
    """The param group holding `param`; the first group for tables that are not parameters."""
    if param is not None:
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return group
    return optimizer.param_groups[0]
