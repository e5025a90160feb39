"""What every synchronizer (one per route) works with, whatever the framework.

A frontend wraps each variable's tensors in a GradAccess: the only place that turns its
tensors into buffers (NumPy arrays, or whatever its dense backend takes) and back. The
synchronizers here never see a torch or TensorFlow object.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import numpy as np

from ..types import ReduceOp, as_reduce_op
from .compression import NONE, Codec



def check_options(op, gradient_predivide_factor: float, backward_passes_per_step: int) -> ReduceOp:
    """Validates a DistributedOptimizer's reduction options (both frontends); returns the op."""
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    op = as_reduce_op(op)
    if gradient_predivide_factor != 1.0 and op is not ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    return op


class GradAccess(Protocol):
    """A frontend's view of one variable and its gradient for this step."""

    def kind(self) -> str | None:
        """'dense', 'sparse' (row-sparse) or None (no gradient this step)."""

    def dense(self, codec: Codec):
        """The gradient as a contiguous buffer the dense backend takes (zeros when there is none;
        a sparse one densified), in the dtype the codec sends it in."""

    def set_dense(self, buffer) -> None:
        """The reduced buffer becomes the gradient (cast back; nothing to do if it aliases it)."""

    def rows(self):
        """The gradient as (ids int64 (n,), values float32 (n, dim)); a dense gradient gives
        every row; None when there is none."""

    def set_rows(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Gathered rows become the (row-sparse) gradient the wrapped optimizer applies."""

    def applied(self) -> None:
        """The server applied the update: the wrapped optimizer must not apply it again."""

    def lr(self) -> float:
        """The learning rate of this variable now (LR schedules reach the server)."""

    # Replicated placement: the variable's own memory.
    def replica(self) -> np.ndarray | None:
        """A (rows, dim) float32 view of the variable the shard may alias, or None."""

    def replica_copy(self) -> np.ndarray:
        """A (rows, dim) float32 copy of the variable."""

    def set_replica(self, values: np.ndarray) -> None:
        """Assigns (rows, dim) values to the variable."""

    def write_rows(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Rows the server changed, written into the variable."""


@dataclasses.dataclass(eq=False)
class Variable:
    """One variable under a distributed optimizer."""

    name: str
    plan: object  # a hybridsync.planning.plan.VariablePlan (made above the sync core, which only reads it)
    access: GradAccess
    index: int = 0  # position in the plan: the order every rank handles variables in
    table: object = None  # its PSTable once it has one
    passes: int = 0  # backward passes accumulated since the last synchronize()
    ps_home: dict | None = None  # its parameter-server settings while sync: auto tries another route

    @functools.cached_property
    def codec(self) -> Codec:
        """Read once the route is decided (at wrap time, or at the first backward)."""
        return NONE if self.plan.compression == "none" else Codec(self.plan.compression)

    @functools.cached_property
    def dim(self) -> int:
        """Row width when the variable is seen as a table: the first dimension is rows."""
        return int(np.prod(self.plan.shape[1:], dtype=np.int64))


@dataclasses.dataclass
class SyncContext:
    """What the synchronizers of one distributed optimizer share."""

    backend: object  # dense collectives (hybridsync.comm.backend())
    op: ReduceOp
    world_size: int
    gradient_predivide_factor: float = 1.0
    loss_scale: float = 1.0  # gradients arrive multiplied by this (Keras loss scaling)
    tensor_buffers: bool = False  # the frontend's buffers are the backend's own tensors
    # Adaptive batch size (hybridsync.adaptive): gradients are multiplied by this (1/accumulation
    # steps: the summed micro-steps become their mean), and the step's statistics recorder.
    grad_scale: float = 1.0
    stats: object = None
    lr_factor: float = 1.0  # the scaling rule's factor, for server rules whose LR the config fixed
    # A PS table's own factor (adaptive.Adaptive.table_lr_factors), where its server rule
    # normalises its update (Adagrad, Adam): the rule applied to what its row updates average.
    table_lr_factors: dict = dataclasses.field(default_factory=dict)

    def allreduce_scales(self) -> tuple[float, float]:
        """(prescale, postscale) of an all-reduce: with Average, the division is split across
        both sides to limit overflow (as Horovod does)."""
        if self.op is ReduceOp.AVERAGE:
            f = self.gradient_predivide_factor
            return 1.0 / f, f * self.grad_scale
        return 1.0, self.grad_scale

    def allreduce_sum(self, array: np.ndarray, name: str) -> np.ndarray:
        """A small sum all-reduce of `array` (in place) on this optimizer's dense backend: the
        one a rank that called join() takes part in, with zeros, as in the gradients'."""
        backend = self.backend
        return backend.synchronize(backend.allreduce_async_(array, name=name, op="sum"))

    def row_scale(self) -> float:
        """Factor the sum of rows over ranks gets (PS and allgather routes)."""
        scale = 1.0 / self.world_size if self.op is ReduceOp.AVERAGE else 1.0
        return scale * self.grad_scale / self.loss_scale


class RouteError(RuntimeError):
    """A variable's gradient does not fit the route it was planned for."""


class Synchronizer:
    """One route's exchange for its variables. Subclasses override grad_ready() and/or
    synchronize(); waits=False marks routes whose synchronize() only sends (run first)."""

    waits = True
    applies_updates = False  # synchronize() changes the variables itself (the server applies the rule)

    def __init__(self, ctx: SyncContext):
        self.ctx = ctx
        self.variables: list[Variable] = []
        self.verified = False  # every rank agreed on the plan: per-step layout checks can go

    def add(self, var: Variable) -> None:
        self.variables.append(var)
        self.variables.sort(key=lambda v: v.index)

    def prepare(self) -> None:
        """Once, when the optimizer is wrapped (tables named, rules set)."""

    def grad_ready(self, var: Variable) -> None:
        """var's gradient is final for this step (every backward pass done)."""

    def synchronize(self) -> None:
        raise NotImplementedError

    def discard(self) -> None:
        """The step was skipped: drop what synchronize() would have sent (applies_updates routes,
        whose synchronize() was held back)."""

    def in_flight(self) -> bool:
        return False

    def rescale_accumulators(self, factor: float) -> None:
        """Collective, between steps: state this route keeps outside the frontend's optimizer
        that sums squared gradients over every step (the PS's Adagrad rule) times `factor`
        (hybridsync.adaptive.accumulators). Routes whose updates the frontend's optimizer
        applies keep nothing of the kind."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> set:
        """Loads what state_dict() returned; the names of the variables it loaded."""
        return set()
