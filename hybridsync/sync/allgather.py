"""Route.ALLGATHER (Horovod's default for sparse gradients): every rank gathers every rank's
(row, gradient) pairs, and the wrapped optimizer applies their sum on every rank, so replicas
stay identical. Bytes per rank grow with the world size: the baseline the parameter server is
measured against."""
from __future__ import annotations

import numpy as np

from .. import timeline
from ..types import ReduceOp, Route
from . import accounting
from .base import RouteError, Synchronizer
from .registry import register


def allgather_rows(backend, ids: np.ndarray, values: np.ndarray, name: str):
    """Every rank's (ids, values), concatenated in rank order."""
    return (backend.allgather(np.ascontiguousarray(ids, dtype=np.int64), name=f"{name}.rows"),
            backend.allgather(np.ascontiguousarray(values), name=f"{name}.values"))


@register(Route.ALLGATHER)
class SparseAllgather(Synchronizer):
    def synchronize(self) -> None:
        if self.ctx.world_size == 1:
            return
        with timeline.span(f"all-gather ({len(self.variables)} tables)", "dense"):
            for var in self.variables:
                if var.access.kind() == "dense":
                    raise RouteError(f"variable '{var.name}' is planned for allgather but produced a dense gradient")
                got = var.access.rows()
                if got is None:  # another rank may have rows: send none
                    shape = (0,) + tuple(var.plan.shape[1:])
                    got = np.zeros(0, np.int64), np.zeros(shape, np.dtype(var.plan.dtype))
                ids, values = allgather_rows(self.ctx.backend, *got, name=f"hybridsync.{var.name}")
                if self.ctx.op is ReduceOp.AVERAGE:
                    values = values / values.dtype.type(self.ctx.world_size)
                if self.ctx.grad_scale != 1.0:  # accumulation micro-steps: their sum becomes their mean
                    values = values * values.dtype.type(self.ctx.grad_scale)
                var.access.set_rows(ids, values)
                accounting.allgather(var.plan, ids, values)
