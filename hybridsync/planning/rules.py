"""Route decisions shared by every frontend: built-in defaults, then the config's `defaults`,
then the first `variables` rule whose glob matches the variable's name. The frontends supply
only what is framework-specific (the server rule that matches their optimizer, and whether that
optimizer can apply a sparse gradient itself), so one YAML file gives the same routes for a
PyTorch and a TensorFlow model. Deciding needs no communication: every rank validates the same
config and raises the same ConfigError before any collective starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import warnings
from typing import Callable

from .. import runtime
from ..config import Config, ConfigError, ConfigWarning, Settings
from ..settings import settings
from ..types import GradKind, Placement, Route
from . import estimate
from .plan import VariablePlan


@dataclasses.dataclass
class RouteResolver:
    config: Config | None
    has_model: bool  # the embedding modules/layers can be swapped (sharded placement)
    world_size: int
    compression: str  # the optimizer-level compression's name
    server_rule: Callable  # (variable name, param or None) -> {"name": rule, hyper-parameters...}
    applies_sparse: bool  # the wrapped optimizer applies sparse gradients itself (allgather route)
    optimizer_name: str = "the optimizer"
    auto_supported: bool = True  # the frontend can switch a variable's route during training
    _default_budget: int | None = dataclasses.field(default=None, repr=False)

    @property
    def auto_steps(self) -> int:
        """Steps `sync: auto` measures: the config's auto_steps, else HYBRIDSYNC_AUTO_STEPS."""
        if self.config is not None and self.config.auto_steps is not None:
            return self.config.auto_steps
        return settings().auto_steps

    def _auto(self, v: VariablePlan, sync: str, ps_module: bool, explicit: bool, stored: bool = False) -> str:
        """`sync: auto` (the default for sparse variables): measure on the parameter server for
        auto_steps steps, then hybridsync.planning.measure picks the route. Returns the route to
        start on. stored: the config gives the table a `storage:` -- only the parameter server
        stores rows that way (16-bit, a disk tier), so auto keeps it there."""
        v.auto = None
        if sync != "auto":
            return sync
        if v.kind is not GradKind.SPARSE:
            v.reason += "; auto: dense variables are all-reduced"
            return "allreduce"
        if not settings().auto or ps_module or stored or self.world_size == 1 or not self.auto_supported:
            if explicit or stored:  # the implicit default says nothing where auto has nothing to do
                v.reason += ("; auto off (HYBRIDSYNC_AUTO=off): ps" if not settings().auto else
                             "; auto: a PS embedding's rows exist only on the PS" if ps_module else
                             "; auto: its storage exists only on the PS" if stored else
                             "; auto: one rank, nothing to exchange: ps" if self.world_size == 1 else
                             "; auto: not available in this frontend: ps")
        else:
            v.auto = {"status": "measuring", "steps": self.auto_steps}
            v.reason += f"; auto: measuring {self.auto_steps} steps on ps"
        return "ps"

    def settings_for(self, v: VariablePlan) -> tuple[Settings, str]:
        """Merged settings for v, and why: built-in < config defaults < first matching rule."""
        kind = "sparse" if v.kind is GradKind.SPARSE else "dense"
        merged, why = Settings(), f"default: {kind}"
        layers = []
        if self.config is not None:
            where = self.config.where.get(f"defaults.{kind}", self.config.source)
            layers.append((getattr(self.config, kind), f"config defaults.{kind} ({where})"))
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

    def decide(self, v: VariablePlan, param, ps_module: bool = False, table_layout=None) -> None:
        """Fills v's route, placement, shards, partition, compression and server optimizer.
        table_layout: (shards, partition) of a PS module's table, which exists already."""
        s, why = self.settings_for(v)
        where = why if why.startswith(("rule", "config")) else "the built-in defaults"

        def fail(key, problem):
            raise ConfigError(f"{where}: {key}: variable '{v.name}': {problem}")

        sparse = v.kind is GradKind.SPARSE
        # A staleness bound is a parameter-server setting: without a sync of its own, it means ps.
        sync = s.sync or ("allreduce" if not sparse else "ps" if s.staleness else "auto")
        v.reason = why
        storage, storage_where = self.config.storage_for(v.name) if self.config is not None and sparse else (None, "")
        sync = self._auto(v, sync, ps_module, explicit=s.sync == "auto", stored=storage is not None)
        if ps_module and sync != "ps":
            fail("sync", f"'{sync}' is impossible for a PS embedding: its rows exist only on the PS")
        if not sparse and sync in ("allgather", "allreduce-as-dense"):
            fail("sync", f"'{sync}' applies to sparse variables; '{v.name}' is dense (use allreduce or ps)")
        v.compression, v.optimizer, v.optimizer_source = "none", None, "-"
        v.shards, v.placement = 0, Placement.NONE
        if sync == "ps":
            v.route = Route.PS
            placement = s.placement or ("sharded" if sparse and (self.has_model or ps_module) else "replicated")
            if placement == "sharded" and not sparse:
                fail("placement", "'sharded' swaps embedding modules for PS-backed ones; a dense variable on the "
                                  "PS keeps its replica: use placement: replicated")
            if placement == "sharded" and not self.has_model and not ps_module:
                fail("placement", "'sharded' needs the model (DistributedOptimizer(..., model=model)) to move "
                                  "its embedding layers to the PS shards")
            if ps_module and placement != "sharded":
                fail("placement", "a PS embedding is always sharded")
            v.placement = Placement(placement)
            v.shards = s.partitions or self.world_size
            if v.shards > self.world_size:
                fail("partitions", f"{v.shards} is more than the world size ({self.world_size})")
            v.partition = s.partition or "cyclic"
            if table_layout is not None:  # a PS module's table was made with its own layout
                for key, want, have in (("partitions", s.partitions, table_layout[0]),
                                        ("partition", s.partition, table_layout[1])):
                    if want is not None and want != have:
                        fail(key, f"{want!r}, but the PS embedding was built with {key}={have!r}: pass it "
                                  "to the embedding's constructor instead")
                v.shards, v.partition = table_layout
            if s.compression not in (None, "none"):
                fail("compression", "compression applies to all-reduce routes, not to the parameter server")
            if len(v.shape) == 0:
                fail("sync", "a scalar cannot be split into rows on the parameter server")
            if s.optimizer is not None:
                v.optimizer, v.optimizer_source = dict(s.optimizer), "config"
            else:
                v.optimizer, v.optimizer_source = self.server_rule(v.name, param), "wrapped"
        elif sync == "allgather":
            v.route = Route.ALLGATHER
            if not self.applies_sparse:
                fail("sync", f"'allgather' lets the wrapped optimizer apply the sparse gradient, and "
                             f"{self.optimizer_name} cannot (use SGD, Adagrad or SparseAdam, or sync: ps)")
        else:
            v.route = Route.SPARSE_AS_DENSE if sparse else Route.ALLREDUCE
            v.compression = s.compression or self.compression
        if s.optimizer is not None and v.route is not Route.PS:
            fail("optimizer", "a server optimizer applies to variables on the parameter server (sync: ps)")
        if s.partitions is not None and v.route is not Route.PS:
            fail("partitions", "partitions apply to variables on the parameter server (sync: ps)")
        if s.storage is not None and not sparse:  # (only a rule: defaults.dense has no storage)
            fail("storage", "storage applies to tables sharded on the parameter server (sync: ps, placement: "
                            "sharded): a dense variable's values are the framework's own")
        if storage is not None and (v.route is not Route.PS or v.placement is not Placement.SHARDED):
            if storage_where.startswith("defaults."):  # a default applies where it can: tables sharded on the PS
                v.reason += "; defaults.sparse.storage: not applied (not a table sharded on the PS)"
                storage = None
            else:
                raise ConfigError(f"{storage_where}: storage: variable '{v.name}': storage applies to tables sharded "
                                  "on the parameter server (sync: ps, placement: sharded): a replica's rows are the "
                                  "framework's own")
        if storage is not None:  # (else a PS module's table's own: see describe.py)
            v.storage = dict(storage)
        v.staleness = self._staleness(v, s.staleness, fail)
        if sparse and v.shape and v.shape[0] > 0:
            self._check_memory(v, param, sync, fail)

    def memory_budget(self) -> int:
        """Bytes per rank the tables may take: the config's memory_per_rank, else the host's
        available memory at start over its ranks, times 0.8."""
        if self.config is not None and self.config.memory_per_rank is not None:
            return self.config.memory_per_rank
        if self._default_budget is None:
            self._default_budget = estimate.default_memory_per_rank(runtime.world().local_size)
        return self._default_budget

    def _slots(self, v: VariablePlan, param) -> int:
        """Optimizer state per row (in rows) of v on its route."""
        if v.optimizer:
            return estimate.SLOTS.get(v.optimizer["name"], 1)
        try:
            return estimate.SLOTS.get(self.server_rule(v.name, param)["name"], 1)
        except ValueError:  # an optimizer with no server rule (it may still apply a replica): say 1
            return 1

    def _check_memory(self, v: VariablePlan, param, sync: str, fail) -> None:
        """A table's predicted bytes per rank on its route (explain() shows them); a route the
        config fixed that does not fit in memory_per_rank is an error naming both numbers (sync:
        auto never chooses one: the parameter server is where it measures)."""
        route = estimate.PS if v.route is Route.PS else (estimate.ALLGATHER if v.route is Route.ALLGATHER
                                                          else estimate.DENSE)
        v.memory_bytes = int(estimate.memory_per_rank(route, int(v.shape[0]), _dim(v.shape), self.world_size,
                                                      v.shards, v.placement.value, self._slots(v, param),
                                                      storage=v.storage))
        budget = self.memory_budget()
        if sync != "auto" and v.memory_bytes > budget:
            fail("sync", f"'{v.route.value}'{' ' + v.placement.value if v.route is Route.PS else ''} needs about "
                         f"{estimate.human_bytes(v.memory_bytes)} per rank for this table (rows, optimizer state, "
                         f"gradient and buffers), over memory_per_rank {estimate.human_bytes(budget)}: route it to "
                         "the sharded parameter server, on more shards, or raise memory_per_rank")

    @staticmethod
    def _staleness(v: VariablePlan, k, fail) -> int:
        """Bounded staleness applies to sharded PS tables only: dense variables stay synchronous,
        and so do `sync: auto` (while it measures) and replicas (they must stay identical)."""
        if not k:
            return 0
        if v.kind is not GradKind.SPARSE or v.route is not Route.PS:
            fail("staleness", "bounded staleness applies to sparse tables on the parameter server (sync: ps); "
                              "dense variables and other routes stay synchronous")
        if v.auto:
            fail("staleness", "sync: auto stays synchronous: give the table sync: ps to bound its staleness")
        if v.placement is not Placement.SHARDED:
            fail("staleness", "a replicated table's replicas are updated synchronously: it needs a sharded table "
                              "(give DistributedOptimizer(..., model=model), which shards embedding tables on the "
                              "PS, or placement: sharded with it)")
        return int(k)

    def check_strict(self, variables) -> None:
        """A rule that takes no variable (it matches none, or only ones an earlier rule takes
        first) is an error at its line under strict: true, else a warning, on rank 0, once per
        rule; both name the closest variable names."""
        if self.config is None:
            return
        names = [v.name for v in variables]
        for rule in self.config.rules:
            if any(self.config.rule_for(name) is rule for name in names):
                continue
            problem = unmatched_rule(self.config, rule, names)
            if self.config.strict:
                raise ConfigError(f"{problem} (strict: true)")
            _warn_once(rule, f"{problem} (strict: true makes this an error)")


def unmatched_rule(config: Config, rule, names: list) -> str:
    """Why `rule` takes none of `names` -- it matches none (the closest names, if any look like
    it), or only ones an earlier rule takes first (which) -- prefixed with its file:line."""
    head = f"{rule.where}: match: rule '{rule.match}'"
    matched = [n for n in names if fnmatch.fnmatchcase(n, rule.match)]
    if matched:
        earlier = {}
        for n in matched:
            first = config.rule_for(n)
            earlier.setdefault(f"'{first.match}' ({first.where})", []).append(n)
        taken = "; ".join(f"{r} takes {_listed(ns)}" for r, ns in earlier.items())
        return f"{head} takes no variable: an earlier rule comes first for each it matches ({taken})"
    close = closest_names(rule.match, names)
    hint = f"closest: {', '.join(close)}" if close else f"variables are: {_listed(names, 12)}"
    return f"{head} matches no variable; {hint}"


def closest_names(pattern: str, names: list, n: int = 3) -> list:
    """Up to n variable names that `pattern` (a glob) most looks like a typo of: compared with
    each name and with each name's prefix globs ('mlp.0.weight': 'mlp.*', 'mlp.0.*'), so that
    'mpl.*' finds the mlp's variables."""
    forms: dict[str, list] = {}
    for name in names:
        forms.setdefault(name, []).append(name)
        parts = name.split(".")
        for i in range(1, len(parts)):
            forms.setdefault(".".join(parts[:i]) + ".*", []).append(name)
    out = []
    for form in difflib.get_close_matches(pattern, list(forms), n=len(forms), cutoff=0.7):
        for name in forms[form]:
            if name not in out:
                out.append(name)
    return out[:n]


def _listed(names: list, most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


_warned: set = set()  # (file:line, glob) of rules warned about in this process


def _warn_once(rule, message: str) -> None:
    """Rank 0 only (every rank plans alike), once per rule per process."""

    key = (rule.where, rule.match)
    if key in _warned or runtime.world().rank != 0:
        return
    _warned.add(key)
    warnings.warn(message, ConfigWarning, stacklevel=2)


def _dim(shape) -> int:
    out = 1
    for d in shape[1:]:
        out *= int(d)
    return out
