"""All-reduce routes, through the dense backend:

ALLREDUCE        dense gradients all-reduced. With a backend that runs collectives in the
                 background (Horovod), each is launched from its gradient hook as soon as it is
                 final, overlapping backward. The MPI backend fuses them all into one exchange,
                 posted from the hook of the last one to become final (the rest of backward and
                 the parameter server's pushes then overlap it) and waited for at synchronize().
SPARSE_AS_DENSE  a sparse gradient densified, then the same (Horovod's sparse_as_dense).
"""
from __future__ import annotations

from .. import timeline
from ..settings import settings
from ..types import ReduceOp, Route
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
        self._overlap = self._fused and hasattr(ctx.backend, "start_allreduce_arrays") and settings().overlap_dense
        self._ready: set = set()  # variables whose gradient is final this step (fused mode)
        self._started = None  # (buffers, the backend's round in flight), posted from a hook

    def _buffer(self, var: Variable):
        if not self.densify and var.access.kind() == "sparse":
            raise RouteError(f"variable '{var.name}' is planned for dense all-reduce but produced a sparse gradient; "
                             "give the model (DistributedOptimizer(..., model=model)) or a config rule for it")
        buffer = var.access.dense(var.codec)
        accounting.dense(var.plan, buffer, self.ctx.world_size)
        if self.ctx.stats is not None:
            self.ctx.stats.dense_in(var.name, buffer)
        return buffer

    def _reduced(self, var: Variable, buffer) -> None:
        """The all-reduced buffer becomes var's gradient (and feeds the gradient statistics)."""
        var.access.set_dense(buffer)
        if self.ctx.stats is not None:
            self.ctx.stats.dense_out(var.name, buffer, summed=self.ctx.op is not ReduceOp.AVERAGE)

    def _launch(self, var: Variable) -> None:
        pre, post = self.ctx.allreduce_scales()
        # Every rank exchanges every variable of the plan, which was checked across ranks: the
        # backend may skip its own per-step layout check.
        self._handles[var] = self.ctx.backend.allreduce_async_(
            self._buffer(var), name=f"hybridsync.{var.name}", op=self.ctx.op, prescale_factor=pre,
            postscale_factor=post, verified_layout=self.verified)

    def grad_ready(self, var: Variable) -> None:
        if self.ctx.world_size == 1:
            return
        if not self._fused:
            self._launch(var)
        elif self._overlap and self.verified:
            self._ready.add(var)
            if len(self._ready) == len(self.variables) and self._started is None:
                self._start_fused()

    def _start_fused(self) -> None:
        """Every gradient of this route is final: post the fused exchange now. Only once the
        plan is verified: every rank then has the same variables, and each posts this round
        once per step (a rank whose gradient never comes falls back to synchronize)."""
        buffers = [self._buffer(var) for var in self.variables]
        pre, post = self.ctx.allreduce_scales()
        with timeline.span(f"all-reduce start ({len(buffers)} tensors fused, overlapping backward)", "dense"):
            started = self.ctx.backend.start_allreduce_arrays(buffers, op=self.ctx.op, prescale_factor=pre,
                                                              postscale_factor=post)
        if started is not None:
            self._started = (buffers, started)

    def synchronize(self) -> None:
        if self.ctx.world_size == 1:
            for var in self.variables:
                var.plan.bytes_per_step = 0  # nothing to exchange
            return
        backend = self.ctx.backend
        self._ready.clear()
        if self._started is not None:
            buffers, started = self._started
            self._started = None
            with timeline.span(f"all-reduce wait ({len(buffers)} tensors fused, {backend.name})", "dense"):
                backend.finish_allreduce_arrays(started)
                for var, buffer in zip(self.variables, buffers):
                    self._reduced(var, buffer)
            return
        if self._fused:
            with timeline.span(f"all-reduce ({len(self.variables)} tensors fused, {backend.name})", "dense"):
                buffers = [self._buffer(var) for var in self.variables]
                pre, post = self.ctx.allreduce_scales()
                backend.allreduce_arrays(buffers, op=self.ctx.op, prescale_factor=pre, postscale_factor=post,
                                         verified_layout=self.verified, name="hybridsync.fused")
                for var, buffer in zip(self.variables, buffers):
                    self._reduced(var, buffer)
            return
        for var in self.variables:
            if var not in self._handles:
                self._launch(var)
        with timeline.span(f"all-reduce wait ({len(self._handles)} tensors, {backend.name})", "dense"):
            for var, handle in self._handles.items():
                self._reduced(var, backend.synchronize(handle))
            self._handles.clear()

    def in_flight(self) -> bool:
        return bool(self._handles) or self._started is not None


@register(Route.SPARSE_AS_DENSE)
class SparseAsDense(DenseAllreduce):
    """A sparse gradient densified and all-reduced; the wrapped optimizer applies it densely."""

    densify = True
