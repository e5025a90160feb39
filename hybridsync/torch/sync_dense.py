"""Route.ALLREDUCE: dense gradients all-reduced through the dense backend, launched from the
gradient hook as soon as a gradient is final (Horovod then fuses and overlaps them)."""
from __future__ import annotations

import torch

from ..types import ReduceOp
from .sync_base import Synchronizer, Variable


class DenseAllreduce(Synchronizer):
    def __init__(self, settings, variables, model=None):
        super().__init__(settings, variables, model)
        self._handles: dict = {}

    def _scale_factors(self):
        s = self.settings
        if s.op is ReduceOp.AVERAGE:
            # Split the average across both sides to limit overflow (as Horovod does).
            return 1.0 / s.gradient_predivide_factor, s.gradient_predivide_factor
        return 1.0, 1.0

    def _launch(self, var: Variable):
        p = var.param
        if p.grad is None:
            # Another rank may have a gradient for it (data-dependent graphs): send zeros.
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            raise RuntimeError(f"variable '{var.name}' is planned for dense all-reduce but produced a sparse gradient")
        compressed, ctx = self.settings.compression.compress(p.grad)
        var.plan.bytes_per_step = compressed.numel() * compressed.element_size()
        pre, post = self._scale_factors()
        # Every rank exchanges every variable of the plan, which was checked across ranks at the
        # first synchronize: the backend may skip its own per-step layout check.
        handle = self.settings.backend.allreduce_async_(compressed, name=f"hybridsync.{var.name}", op=self.settings.op,
                                                        prescale_factor=pre, postscale_factor=post,
                                                        verified_layout=self.plan_verified)
        self._handles[var] = (handle, ctx)

    def grad_ready(self, var: Variable) -> None:
        if self.settings.world_size > 1:
            self._launch(var)

    def synchronize(self) -> None:
        if self.settings.world_size == 1:
            for var in self.variables:
                var.plan.bytes_per_step = 0  # nothing to exchange
            return
        for var in self.variables:
            if var not in self._handles:
                self._launch(var)
        for var, (handle, ctx) in self._handles.items():
            reduced = self.settings.compression.decompress(self.settings.backend.synchronize(handle), ctx)
            if reduced.data_ptr() != var.param.grad.data_ptr():
                var.param.grad.copy_(reduced)
        self._handles.clear()

    def in_flight(self) -> bool:
        return bool(self._handles)
