"""A torch optimizer's variables as hybridsync.planning takes them (planning.Described): which
are sparse, and how the wrapped optimizer looks to the server-rule mapping. The plan itself is
made by hybridsync.planning, the same way for the TensorFlow frontend.

Kinds: weights of nn.Embedding / nn.EmbeddingBag built with sparse=True (seen through the
model) and hybridsync.torch PS embeddings are sparse -- unless a module of another kind holds the
same weight (tied to an nn.Linear output layer: the gradient is dense); without a model, a
parameter whose first gradient is sparse is. Everything else is dense.
"""
from __future__ import annotations

import torch

from ..config import Config, ConfigError
from ..planning import Described, Plan, RouteResolver, VariablePlan, make_plan, route_resolver
from ..types import GradKind
from .dynamic_embedding import DynamicEmbedding
from .embedding import PS_MODULES
from .server_optimizer import describe, group_of


def _is_sparse_embedding(module) -> bool:
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse


def sparse_parameter_ids(model) -> set:
    """ids of parameters whose gradients will be sparse, from the model's modules: the weights
    of sparse embeddings, held by no other kind of module (see tied_dense_reasons)."""
    if model is None:
        return set()
    return {id(m.weight) for m in model.modules() if _is_sparse_embedding(m)} - set(tied_dense_reasons(model))


def tied_dense_reasons(model) -> dict:
    """{id(param): why it is dense} for weights of sparse embeddings that another kind of module
    also holds (an output nn.Linear tied to the input embedding, a dense nn.Embedding): autograd
    sums that module's dense gradient into the embedding's sparse one, so the whole gradient is
    dense. Several sparse embeddings sharing one weight stay sparse (one table on the PS)."""
    if model is None:
        return {}
    sparse = {id(m.weight): name for name, m in model.named_modules() if _is_sparse_embedding(m)}
    out = {}
    for name, module in model.named_modules():
        if _is_sparse_embedding(module):
            continue
        for p in module._parameters.values():
            if p is not None and id(p) in sparse and id(p) not in out:
                out[id(p)] = (f"tied: '{sparse[id(p)]}' (sparse embedding) shares its weight with "
                              f"'{name}' ({type(module).__name__}), so its gradient is dense")
    return out


def ps_modules(model) -> list:
    """(name, module) of user-built PS-backed modules: tables with no torch parameter."""
    if model is None:
        return []
    kinds = PS_MODULES + (DynamicEmbedding,)
    return [(f"{name}.weight" if name else "weight", m) for name, m in model.named_modules() if isinstance(m, kinds)]


def apply_table_rules(config: Config | None, named, model) -> None:
    """Collective where it changes a table: a config rule's `dynamic:` options replace those of
    the hybridsync.torch.DynamicEmbedding it matches (its table is made anew, still empty), and
    its `storage:` (else defaults.sparse's) becomes the storage of the PS embedding it matches (a fixed table moves its
    rows and optimizer state to a new table that stores them so). A rule with `dynamic:` that
    matches another kind of variable is a ConfigError, raised on every rank alike before
    anything changes (every rank has the same config and model); `storage:` on a variable that
    is not a PS table is checked when its route is planned."""
    if config is None or not (config.sparse.storage or any(rule.dynamic or rule.storage for rule in config.rules)):
        return
    tables = ps_modules(model)
    for name, module in [(n, None) for n, _ in named] + tables:
        rule = config.rule_for(name)
        if rule is not None and rule.dynamic and not isinstance(module, DynamicEmbedding):
            raise ConfigError(f"{rule.where}: dynamic: variable '{name}' is not a hybridsync DynamicEmbedding "
                              "(dynamic options apply to those only)")
    moved = {}  # id(old table) -> (it, its new table): modules sharing a table (tied) follow it together
    for name, module in tables:
        rule = config.rule_for(name)
        dynamic = rule.dynamic if rule is not None else None
        storage, _ = config.storage_for(name)  # (its rule's, else defaults.sparse's)
        if not (dynamic or storage):
            continue
        if isinstance(module, DynamicEmbedding):
            if dynamic or storage != module.table.storage:
                module.reconfigure(storage=storage, **(dynamic or {}))
        elif storage != module.table.storage and id(module.table) not in moved:
            moved[id(module.table)] = (module.table, module.table.restored_as(storage))
    for _, module in tables:
        if id(module.table) in moved:
            module.table = moved[id(module.table)][1]
    for old, _ in moved.values():
        old.drop()


apply_dynamic_rules = apply_table_rules  # (its older name)


def plan_for(optimizer, named, model, config: Config | None, compression_name: str, backend_name: str,
             world_size: int, backend_reason: str = "") -> tuple[Plan, RouteResolver]:
    resolver = route_resolver(config, lambda param: describe(optimizer, group_of(optimizer, param)),
                              has_model=model is not None, world_size=world_size, compression=compression_name,
                              optimizer_name=type(optimizer).__name__)
    sparse_ids, tied = sparse_parameter_ids(model), tied_dense_reasons(model)
    described = [Described(name, tuple(p.shape), str(p.dtype).replace("torch.", ""),
                           (GradKind.SPARSE if id(p) in sparse_ids else GradKind.DENSE) if model is not None else None,
                           param=p, note=tied.get(id(p), ""))
                 for name, p in named]
    described += [Described(name, (module.table.num_rows, module.table.dim), "float32", GradKind.SPARSE,
                            table=module.table) for name, module in ps_modules(model)]
    plan = make_plan(described, resolver, framework="torch", backend=backend_name, backend_reason=backend_reason,
                     label="hybridsync.torch")
    return plan, resolver


def route_for_observed(v: VariablePlan, kind: GradKind, planner: RouteResolver, param) -> None:
    """Completes a variable's plan from its first gradient (no model was given)."""
    v.kind = kind
    planner.decide(v, param)
    v.reason += " (kind seen at first backward)"
