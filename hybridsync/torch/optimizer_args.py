"""The keyword arguments Horovod's DistributedOptimizer takes beyond hybridsync's own, checked
and turned into what the hybrid optimizer understands."""
from __future__ import annotations

import warnings

import torch

from ..sync.process_set_scope import sparse_as_dense_config, sparse_default_config  # noqa: F401


def parameter_names(named) -> dict:
    """Horovod's `optimizer._parameter_names`: parameter -> name (scripts and tools read it);
    names are 'allreduce.noname.<group>.<index>' when no named_parameters were given."""
    return {p: name for name, p in sorted(named, key=lambda pair: pair[0])}


def check_op(op):
    """Average, Sum (as hybridsync.types understands them) or 'adasum'; Horovod's other ops,
    which no optimizer of Horovod's takes either, are errors."""
    if isinstance(op, int) and not isinstance(op, bool):  # a constant taken from horovod.torch
        if op in (0, 1):
            return ("average", "sum")[op]
        name = {2: "adasum", 3: "min", 4: "max", 5: "product"}.get(op, str(op))
    else:
        name = str(getattr(op, "value", op)).lower()
    if name == "adasum":
        return name
    if name in ("min", "max", "product"):
        raise NotImplementedError(f"DistributedOptimizer(op={name}): gradients are combined with Average, Sum or "
                                  "Adasum (as in Horovod)")
    return op


def check_groups(num_groups, groups, named):
    """Horovod's explicit grouping of gradient all-reduces, validated as Horovod does. It only
    decides which all-reduces are launched together, never a result: the MPI backend already
    reduces every dense gradient in one fused exchange per step, and Horovod fuses what is ready
    in each cycle, so hybridsync accepts it and keeps its own fusion."""
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, 3)
        if groups is None:
            groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        ids, seen = {id(p) for _, p in named}, set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                if id(p) not in ids:
                    raise ValueError("groups names a tensor that the optimizer does not update")
                seen.add(id(p))
    return groups
