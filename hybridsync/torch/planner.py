"""Classifies a torch optimizer's parameters and picks each one's route (the plan).

Sparse: weights of nn.Embedding / nn.EmbeddingBag built with sparse=True (seen through the
model), or, without a model, any parameter whose first gradient is sparse. Everything else is
dense. Defaults: dense -> all-reduce; sparse -> parameter server, sharded when the model is
given (its embedding modules can be swapped), replicated otherwise.
"""
from __future__ import annotations

import torch

from ..plan import Plan, VariablePlan
from ..types import GradKind, Placement, Route


def sparse_parameter_ids(model) -> set:
    """ids of parameters whose gradients will be sparse, from the model's modules."""
    out = set()
    if model is None:
        return out
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            out.add(id(module.weight))
    return out


def _default_route(kind: GradKind, has_model: bool):
    if kind is GradKind.DENSE:
        return Route.ALLREDUCE, Placement.NONE, "default: dense"
    placement = Placement.SHARDED if has_model else Placement.REPLICATED
    why = "default: sparse embedding" + ("" if has_model else " (no model: replicated)")
    return Route.PS, placement, why


def plan_for(optimizer, named, model, config, compression, backend) -> Plan:
    sparse_ids = sparse_parameter_ids(model)
    compression_name = {"NoneCompressor": "none", "FP16Compressor": "fp16"}.get(
        getattr(compression, "__name__", ""), getattr(compression, "__name__", "custom"))
    variables = []
    for name, p in named:
        if model is not None:
            kind = GradKind.SPARSE if id(p) in sparse_ids else GradKind.DENSE
        else:
            kind = None
        v = VariablePlan(name=name, shape=tuple(p.shape), dtype=str(p.dtype).replace("torch.", ""), kind=kind,
                         route=None, compression=compression_name if kind is not GradKind.SPARSE else "none")
        if kind is not None:
            v.route, v.placement, v.reason = _default_route(kind, model is not None)
        variables.append(v)
    return Plan(variables, framework="torch", backend=backend.name, world_size=backend.size)


def route_for_observed(v: VariablePlan, kind: GradKind, plan: Plan) -> None:
    """Completes a variable's plan from its first gradient."""
    v.kind = kind
    v.route, v.placement, v.reason = _default_route(kind, has_model=False)
    v.reason += " (seen at first backward)"
    if kind is GradKind.SPARSE:
        v.compression = "none"
