"""Gradient statistics of a world of one, from its accumulation micro-steps (as Pollux does):
each micro-step's own gradient (batch b) and their mean (batch k b) are the two batch sizes the
estimator needs. Each micro-step's gradient is what it added to .grad (or, for a PS-backed
module, the rows its backward staged), so no extra pass is needed; a copy of the running sum of
the dense gradients is kept between micro-steps to tell them apart."""
from __future__ import annotations

import torch

from ..adaptive.collect import rows_squared_norm as _rows_sq
from ..adaptive.collect import squared_norm
from .access import StagedRowsAccess


def _sq(t: torch.Tensor) -> float:
    if t.is_sparse:
        t = t.coalesce()._values()
    return squared_norm(t)


class MicroStepStats:
    def __init__(self, optimizer):
        self.opt = optimizer
        self._prev: dict = {}  # name -> the running .grad sum after the previous micro-step
        self._staged: dict = {}  # name -> staged parts already counted
        self._micro_sq: dict = {}  # name -> each micro-step's |g_i|^2

    def _gradients(self):
        """(name, grad tensor or None, staged parts or None) of every variable with a gradient."""
        opt = self.opt
        for var in opt._hs_vars:
            if isinstance(var.access, StagedRowsAccess):
                yield var.name, None, var.access._parts
                continue
            p = opt._hs_param_of.get(var)
            if p is not None and p.grad is not None:
                yield var.name, p.grad, None

    def micro_step_done(self) -> None:
        """After each micro-step's backward (the last one's included)."""
        for name, grad, parts in self._gradients():
            if parts is not None:
                seen = self._staged.get(name, 0)
                sq = _rows_sq(parts[seen:])
                self._staged[name] = len(parts)
            else:
                prev = self._prev.get(name)
                sq = _sq(grad if prev is None else grad - prev)
                self._prev[name] = grad.detach().clone()
            self._micro_sq.setdefault(name, []).append(sq)

    def observe(self, controller) -> None:
        """After the last micro-step: each variable's mean micro-step |g_i|^2 at batch b and the
        mean gradient's |g|^2 at batch k b, into the statistics."""
        b, k = controller.local_batch, controller.accumulation
        observations = []  # all or none: a non-finite step is left out whole (GradientStats.observe_step)
        for name, grad, parts in self._gradients():
            micro = self._micro_sq.get(name, [])
            if len(micro) != k or not b:
                continue  # a variable without a gradient in some micro-step: no clean pair
            total = _rows_sq(parts) if parts is not None else _sq(grad)
            weight = k * b / (controller.base_batch or k * b)
            observations.append((name, sum(micro) / k, b, total / k ** 2, k * b, weight))
        controller.stats.observe_step(observations)
        self._prev.clear()
        self._staged.clear()
        self._micro_sq.clear()
