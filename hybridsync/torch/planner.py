"""Classifies a torch optimizer's variables and picks each one's route (the plan).

Sparse: weights of nn.Embedding / nn.EmbeddingBag built with sparse=True (seen through the
model), hybridsync.torch.Embedding / EmbeddingBag tables, or, without a model, any parameter
whose first gradient is sparse. Everything else is dense. Defaults: dense -> all-reduce;
sparse -> parameter server, sharded when the model is given (its embedding modules can be
swapped), replicated otherwise; the server optimizer follows the wrapped optimizer.
"""
from __future__ import annotations

import torch

from ..plan import Plan, VariablePlan
from ..types import GradKind, Placement, Route
from .embedding import PS_MODULES
from .server_optimizer import group_of, server_rule


def sparse_parameter_ids(model) -> set:
    """ids of parameters whose gradients will be sparse, from the model's modules."""
    out = set()
    if model is None:
        return out
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            out.add(id(module.weight))
    return out


def ps_modules(model) -> list:
    """(name, module) of user-built PS-backed modules: tables with no torch parameter."""
    if model is None:
        return []
    return [(f"{name}.weight" if name else "weight", m) for name, m in model.named_modules() if isinstance(m, PS_MODULES)]


def _route_default(v: VariablePlan, has_model: bool, optimizer, param, world_size: int) -> None:
    if v.kind is GradKind.DENSE:
        v.route, v.placement, v.reason = Route.ALLREDUCE, Placement.NONE, "default: dense"
        return
    v.route = Route.PS
    v.shards = world_size
    v.placement = Placement.SHARDED if has_model else Placement.REPLICATED
    v.reason = "default: sparse embedding" + ("" if has_model else " (no model given: replicated)")
    v.compression = "none"
    v.optimizer = server_rule(optimizer, group_of(optimizer, param), v.name)
    v.optimizer_source = "wrapped"


def plan_for(optimizer, named, model, config, compression, backend) -> Plan:
    sparse_ids = sparse_parameter_ids(model)
    compression_name = {"NoneCompressor": "none", "FP16Compressor": "fp16"}.get(
        getattr(compression, "__name__", ""), getattr(compression, "__name__", "custom"))
    variables = []
    for name, p in named:
        kind = (GradKind.SPARSE if id(p) in sparse_ids else GradKind.DENSE) if model is not None else None
        v = VariablePlan(name=name, shape=tuple(p.shape), dtype=str(p.dtype).replace("torch.", ""), kind=kind,
                         route=None, compression=compression_name)
        if kind is not None:
            _route_default(v, True, optimizer, p, backend.size)
        variables.append(v)
    for name, module in ps_modules(model):
        v = VariablePlan(name=name, shape=module.shape, dtype="float32", kind=GradKind.SPARSE, route=None)
        _route_default(v, True, optimizer, None, backend.size)
        v.reason = "hybridsync.torch PS embedding: rows live on the shards"
        variables.append(v)
    from ..comm import why

    return Plan(variables, framework="torch", backend=backend.name, world_size=backend.size,
                backend_reason=why(backend.name))


def route_for_observed(v: VariablePlan, kind: GradKind, optimizer, param, world_size: int) -> None:
    """Completes a variable's plan from its first gradient (no model was given)."""
    v.kind = kind
    _route_default(v, False, optimizer, param, world_size)
    v.reason += " (seen at first backward)"
