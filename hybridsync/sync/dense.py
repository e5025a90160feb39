"""All-reduce routes, through the dense backend:

ALLREDUCE        dense gradients all-reduced. With a backend that runs collectives in the
                 background (Horovod), each is launched from its gradient hook as soon as it is
                 final, overlapping backward; otherwise all are fused at synchronize().
SPARSE_AS_DENSE  a sparse gradient densified, then the same (Horovod's sparse_as_dense).
"""
from __future__ import annotations

from .. import timeline
from ..types import Route
from . import accounting
from .base import RouteError, Synchronizer, Variable
from .registry import register


@register(Route.ALLREDUCE)
class DenseAllreduce(Synchronizer):
    densify = False  # a sparse gradient here is an error (the plan said dense)

    def __init__(self, ctx):
        super().__init__(ctx)
        self._handles: dict = {}
        # A backend without a progress thread (MPI) gains nothing from launching in hooks: one
        # fused all-reduce per dtype at synchronize() costs the least.
        self._fused = hasattr(ctx.backend, "allreduce_arrays")

    def _buffer(self, var: Variable):
        if not self.densify and var.access.kind() == "sparse":
            raise RouteError(f"variable '{var.name}' is planned for dense all-reduce but produced a sparse gradient; "
                             "give the model (DistributedOptimizer(..., model=model)) or a config rule for it")
        buffer = var.access.dense(var.codec)
        accounting.dense(var.plan, buffer, self.ctx.world_size)
        return buffer

    def _launch(self, var: Variable) -> None:
        pre, post = self.ctx.allreduce_scales()
        # Every rank exchanges every variable of the plan, which was checked across ranks: the
        # backend may skip its own per-step layout check.
        self._handles[var] = self.ctx.backend.allreduce_async_(
            self._buffer(var), name=f"hybridsync.{var.name}", op=self.ctx.op, prescale_factor=pre,
            postscale_factor=post, verified_layout=self.verified)

    def grad_ready(self, var: Variable) -> None:
        if self.ctx.world_size > 1 and not self._fused:
            self._launch(var)

    def synchronize(self) -> None:
        if self.ctx.world_size == 1:
            for var in self.variables:
                var.plan.bytes_per_step = 0  # nothing to exchange
            return
        backend = self.ctx.backend
        if self._fused:
            with timeline.span(f"all-reduce ({len(self.variables)} tensors fused, {backend.name})", "dense"):
                buffers = [self._buffer(var) for var in self.variables]
                pre, post = self.ctx.allreduce_scales()
                backend.allreduce_arrays(buffers, op=self.ctx.op, prescale_factor=pre, postscale_factor=post,
                                         verified_layout=self.verified, name="hybridsync.fused")
                for var, buffer in zip(self.variables, buffers):
                    var.access.set_dense(buffer)
            return
        for var in self.variables:
            if var not in self._handles:
                self._launch(var)
        with timeline.span(f"all-reduce wait ({len(self._handles)} tensors, {backend.name})", "dense"):
            for var, handle in self._handles.items():
                var.access.set_dense(backend.synchronize(handle))
            self._handles.clear()

    def in_flight(self) -> bool:
        return bool(self._handles)


@register(Route.SPARSE_AS_DENSE)
class SparseAsDense(DenseAllreduce):
    """A sparse gradient densified and all-reduced; the wrapped optimizer applies it densely."""

    densify = True
