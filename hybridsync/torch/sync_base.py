"""What every synchronizer (one per route) shares: the variables it owns and the settings of
the optimizer it serves. The optimizer calls grad_ready() from the gradient hooks and
synchronize() before the wrapped optimizer's step()."""
from __future__ import annotations

import dataclasses

import torch

from ..plan import VariablePlan
from ..types import ReduceOp


@dataclasses.dataclass(eq=False)
class Variable:
    """One parameter under a distributed optimizer."""

    name: str
    param: torch.nn.Parameter | None  # None for tables that only exist on the PS
    plan: VariablePlan
    index: int = 0  # position in the plan: the order every rank handles variables in
    module: torch.nn.Module | None = None  # a user-built PS-backed module, for PS-only tables
    passes: int = 0  # backward passes accumulated since the last synchronize()
    compressor: type | None = None  # the all-reduce compression of this variable


@dataclasses.dataclass
class SyncSettings:
    backend: object  # torch-facing dense collectives (ops.backend())
    op: ReduceOp
    compression: type
    gradient_predivide_factor: float
    world_size: int
    wrapped: torch.optim.Optimizer  # the user's optimizer (for hyper-parameters)


class Synchronizer:
    """Base class: subclasses override grad_ready() and/or synchronize()."""

    waits = True  # synchronize() blocks on peers; False for routes that only send
    plan_verified = False  # every rank agreed on the plan (set at the first synchronize)

    def __init__(self, settings: SyncSettings, variables: list[Variable], model=None):
        self.settings = settings
        self.variables = list(variables)
        self.model = model

    def add(self, var: Variable) -> None:
        self.variables.append(var)

    def on_wrap(self) -> None:
        """Called once, when the optimizer has been wrapped (e.g. to swap in PS modules)."""

    def grad_ready(self, var: Variable) -> None:
        """var's gradient is final for this step (all backward passes done)."""

    def synchronize(self) -> None:
        """Completes the exchange for every variable; afterwards each p.grad holds the global
        gradient, or is None when the update was already applied (server-side)."""
        raise NotImplementedError

    def in_flight(self) -> bool:
        return False

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
