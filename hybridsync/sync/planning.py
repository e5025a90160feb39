"""What both frontends do to plan their variables: a RouteResolver for the wrapped optimizer,
and the plan of a PS-backed embedding (hybridsync.torch.Embedding, hybridsync.tensorflow.Embedding),
whose rows exist only on the shards. The frontends say only which variables they have and how
their optimizer looks (server_optimizer.describe)."""
from __future__ import annotations

from typing import Callable

from ..config import DYNAMIC_KEYS, Config
from ..plan import VariablePlan
from ..routing import RouteResolver
from ..types import GradKind
from ..ps.rules import OptimizerSpec, server_rule


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
    resolver.decide(v, None, ps_module=True, table_layout=layout)
    if not v.reason.startswith(("rule", "config")):
        v.reason = f"{frontend} PS embedding: rows live on the shards"
    options = getattr(table, "options", None)  # a dynamic table's
    if options is not None:
        rule = resolver.config.rule_for(name) if resolver.config is not None else None
        v.dynamic = {k: options[k] for k in DYNAMIC_KEYS}
        v.dynamic.update(rule.dynamic if rule is not None and rule.dynamic else {})  # what the rule makes of it
    return v
