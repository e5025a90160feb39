"""Classifies a torch optimizer's variables and picks each one's route: the plan.

Kinds: weights of nn.Embedding / nn.EmbeddingBag built with sparse=True (seen through the
model) and hybridsync.torch PS embeddings are sparse; without a model, a parameter whose first
gradient is sparse is. Everything else is dense.

Routes: built-in defaults (dense -> all-reduce; sparse -> PS, sharded when the model is given,
replicated otherwise), then the config's `defaults`, then the first `variables` rule whose glob
matches the name. Computing a plan needs no communication, so every rank validates the same
config and raises the same ConfigError before any collective starts.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import Config, ConfigError, Settings
from ..plan import Plan, VariablePlan
from ..types import GradKind, Placement, Route
from .embedding import PS_MODULES
from .server_optimizer import group_of, server_rule

# Optimizers that apply a sparse gradient themselves (the allgather route needs one).
_SPARSE_CAPABLE = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


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


@dataclasses.dataclass
class Planner:
    """Everything route decisions depend on; decide() is called per variable (at wrap time, or
    at the first backward for variables planned without their module)."""

    optimizer: torch.optim.Optimizer
    config: Config | None
    has_model: bool
    world_size: int
    compression: str  # the optimizer-level compression's name

    def settings_for(self, v: VariablePlan) -> tuple[Settings, str]:
        """Merged settings for v, and why: built-in < config defaults < first matching rule."""
        kind = "sparse" if v.kind is GradKind.SPARSE else "dense"
        merged = Settings()
        why = f"default: {kind}"
        layers = []
        if self.config is not None:
            layers.append((getattr(self.config, kind), f"config defaults.{kind} ({self.config.where.get(f'defaults.{kind}', self.config.source)})"))
            rule = self.config.rule_for(v.name)
            if rule is not None:
                layers.append((rule, f"rule '{rule.match}' ({rule.where})"))
        for layer, reason in layers:
            touched = False
            for field in dataclasses.fields(Settings):
                value = getattr(layer, field.name)
                if value is not None:
                    setattr(merged, field.name, value)
                    touched = True
            if touched:
                why = reason
        return merged, why

    def decide(self, v: VariablePlan, param, ps_module=False) -> None:
        """Fills v's route, placement, shards, compression and server optimizer."""
        s, why = self.settings_for(v)
        where = why if why.startswith(("rule", "config")) else "the built-in defaults"
        fail = lambda key, problem: _fail(where, v.name, key, problem)
        sparse = v.kind is GradKind.SPARSE
        sync = s.sync or ("ps" if sparse else "allreduce")
        v.reason = why
        if ps_module and sync != "ps":
            fail("sync", f"'{sync}' is impossible for a hybridsync.torch PS embedding: its rows exist only on the PS")
        if not sparse and sync in ("allgather", "allreduce-as-dense"):
            fail("sync", f"'{sync}' applies to sparse variables; '{v.name}' is dense (use allreduce or ps)")
        v.compression = "none"
        v.optimizer, v.optimizer_source, v.shards, v.placement = None, "-", 0, Placement.NONE
        if sync == "ps":
            v.route = Route.PS
            placement = s.placement or ("sharded" if sparse and self.has_model else "replicated")
            if placement == "sharded" and not sparse:
                fail("placement", "'sharded' swaps embedding modules for PS-backed ones; a dense variable on the "
                                  "PS keeps its replica: use placement: replicated")
            if placement == "sharded" and not self.has_model:
                fail("placement", "'sharded' needs DistributedOptimizer(..., model=model) to swap the embedding modules")
            if ps_module and placement != "sharded":
                fail("placement", "a hybridsync.torch PS embedding is always sharded")
            v.placement = Placement(placement)
            v.shards = s.partitions or self.world_size
            if v.shards > self.world_size:
                fail("partitions", f"{v.shards} is more than the world size ({self.world_size})")
            v.partition = s.partition or "cyclic"
            if s.compression not in (None, "none"):
                fail("compression", "compression applies to all-reduce routes, not to the parameter server")
            if len(v.shape) == 0:
                fail("sync", "a scalar cannot be split into rows on the parameter server")
            if s.optimizer is not None:
                v.optimizer, v.optimizer_source = dict(s.optimizer), "config"
            else:
                v.optimizer = server_rule(self.optimizer, group_of(self.optimizer, param), v.name)
                v.optimizer_source = "wrapped"
        elif sync == "allgather":
            v.route = Route.ALLGATHER
            if not isinstance(self.optimizer, _SPARSE_CAPABLE):
                fail("sync", f"'allgather' lets the wrapped optimizer apply the sparse gradient, and "
                             f"{type(self.optimizer).__name__} cannot (use SGD, Adagrad or SparseAdam, or sync: ps)")
        else:
            v.route = Route.SPARSE_AS_DENSE if sparse else Route.ALLREDUCE
            v.compression = s.compression or self.compression
        if s.optimizer is not None and v.route is not Route.PS:
            fail("optimizer", "a server optimizer applies to variables on the parameter server (sync: ps)")
        if s.partitions is not None and v.route is not Route.PS:
            fail("partitions", "partitions apply to variables on the parameter server (sync: ps)")


def _fail(where: str, name: str, key: str, problem: str):
    raise ConfigError(f"{where}: {key}: variable '{name}': {problem}")


def plan_for(optimizer, named, model, config: Config | None, compression_name: str, backend_name: str,
             world_size: int, backend_reason: str = "") -> tuple[Plan, Planner]:
    planner = Planner(optimizer, config, model is not None, world_size, compression_name)
    sparse_ids = sparse_parameter_ids(model)
    variables = []
    for name, p in named:
        kind = (GradKind.SPARSE if id(p) in sparse_ids else GradKind.DENSE) if model is not None else None
        v = VariablePlan(name=name, shape=tuple(p.shape), dtype=str(p.dtype).replace("torch.", ""), kind=kind, route=None)
        if kind is not None:
            planner.decide(v, p)
        variables.append(v)
    for name, module in ps_modules(model):
        v = VariablePlan(name=name, shape=module.shape, dtype="float32", kind=GradKind.SPARSE, route=None)
        planner.decide(v, None, ps_module=True)
        if not v.reason.startswith(("rule", "config")):
            v.reason = "hybridsync.torch PS embedding: rows live on the shards"
        variables.append(v)
    if config is not None and config.strict:
        for rule in config.rules:
            if not any(config.rule_for(v.name) is rule for v in variables):
                raise ConfigError(f"{rule.where}: match: rule '{rule.match}' matches no variable (strict: true); "
                                  f"variables are: {', '.join(v.name for v in variables[:12])}"
                                  f"{' ...' if len(variables) > 12 else ''}")
    plan = Plan(variables, framework="torch", backend=backend_name, world_size=world_size, backend_reason=backend_reason)
    return plan, planner


def route_for_observed(v: VariablePlan, kind: GradKind, planner: Planner, param) -> None:
    """Completes a variable's plan from its first gradient (no model was given)."""
    v.kind = kind
    planner.decide(v, param)
    v.reason += " (kind seen at first backward)"
