"""The first stage: the variables as a frontend describes them (Described), and the plan made from
that description the same way for every frontend -- each route from the YAML rules (rules.py),
a PS-backed embedding's (hybridsync.torch.Embedding, hybridsync.tensorflow.Embedding) on the
table it already has. The frontends say only which variables they have and how their optimizer
looks (server_optimizer.describe)."""
from __future__ import annotations

import dataclasses
from typing import Callable

from ..config import DYNAMIC_KEYS, Config
from ..ps.rules import OptimizerSpec, server_rule
from ..types import GradKind
from .plan import Plan, VariablePlan
from .rules import RouteResolver


@dataclasses.dataclass
class Described:
    """One variable as its frontend describes it."""

    name: str
    shape: tuple
    dtype: str
    kind: GradKind | None  # None: its first gradient tells
    param: object = None  # the frontend's variable (its optimizer settings may differ per variable)
    table: object = None  # a PS-backed embedding's table (made with the module or layer)
    note: str = ""  # what the frontend knows of it that the reason should start with (e.g. a tied weight)


def make_plan(described: list, resolver: RouteResolver, *, framework: str, backend: str, backend_reason: str,
              label: str) -> Plan:
    """The plan of `described` (every route decided where the kind is known); no communication,
    so every rank raises the same ConfigError before any collective. label names the frontend in
    reasons ("hybridsync.torch")."""
    variables = []
    for d in described:
        if d.table is not None:
            variables.append(ps_embedding_plan(resolver, d.name, d.table, label))
            if d.note:
                variables[-1].reason = f"{d.note}; {variables[-1].reason}"
            continue
        v = VariablePlan(name=d.name, shape=tuple(d.shape), dtype=d.dtype, kind=d.kind, route=None)
        if d.kind is not None:
            resolver.decide(v, d.param)
            if d.note:
                v.reason = f"{d.note}; {v.reason}"
        variables.append(v)
    resolver.check_strict(variables)
    return Plan(variables, framework=framework, backend=backend, world_size=resolver.world_size,
                backend_reason=backend_reason)


def route_resolver(config: Config | None, describe: Callable[[object], OptimizerSpec], *, has_model: bool,
                   world_size: int, compression: str, optimizer_name: str) -> RouteResolver:
    """describe(param) is the optimizer as it applies to `param` (None: as it applies to tables
    that are no parameter, and to sparse gradients in general)."""
    return RouteResolver(config, has_model=has_model, world_size=world_size, compression=compression,
                         server_rule=lambda name, param: server_rule(describe(param), name),
                         applies_sparse=describe(None).applies_sparse, optimizer_name=optimizer_name)


def ps_embedding_plan(resolver: RouteResolver, name: str, table, frontend: str) -> VariablePlan:
    """The plan of a PS-backed embedding's table (its route: the parameter server, on the
    table's own layout, unless a config rule says what). The layout is the one the table asked
    for at the world size planned for: the shards it was given, else every rank (`python -m
    hybridsync explain --world-size N` plans N ranks with tables made in a world of one)."""
    v = VariablePlan(name=name, shape=(table.num_rows, table.dim), dtype="float32", kind=GradKind.SPARSE, route=None)
    layout = (table.requested_shards or resolver.world_size, table.layout[1])
    v.storage = table.storage  # (the table's; a rule's storage was given to the table when it was made)
    resolver.decide(v, None, ps_module=True, table_layout=layout)
    if not v.reason.startswith(("rule", "config")):
        v.reason = f"{frontend} PS embedding: rows live on the shards"
    options = getattr(table, "options", None)  # a dynamic table's
    if options is not None:
        rule = resolver.config.rule_for(name) if resolver.config is not None else None
        v.dynamic = {k: options[k] for k in DYNAMIC_KEYS}
        v.dynamic.update(rule.dynamic if rule is not None and rule.dynamic else {})  # what the rule makes of it
    return v
