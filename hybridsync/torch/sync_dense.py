"""All-reduce-family routes, through the dense backend:

ALLREDUCE        dense gradients all-reduced, launched from the gradient hook as soon as a
                 gradient is final (Horovod then fuses and overlaps them);
SPARSE_AS_DENSE  a sparse gradient densified, then the same (Horovod's sparse_as_dense);
ALLGATHER        a sparse gradient's rows all-gathered from every rank and applied by the wrapped
                 optimizer on every rank (Horovod's default for sparse gradients).
"""
from __future__ import annotations

import torch

from .. import timeline
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

    def _dense_grad(self, var: Variable):
        grad = var.param.grad
        if grad.is_sparse:
            raise RuntimeError(f"variable '{var.name}' is planned for dense all-reduce but produced a sparse gradient")
        return grad

    def _compressed_grad(self, var: Variable):
        """var's gradient ready to send: zeros if it has none (another rank may have one, in
        data-dependent graphs), dense, compressed. Returns (tensor, ctx)."""
        p = var.param
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad = self._dense_grad(var)
        compressed, ctx = var.compressor.compress(p.grad)
        var.plan.bytes_per_step = compressed.numel() * compressed.element_size()
        return compressed, ctx

    def _launch(self, var: Variable):
        compressed, ctx = self._compressed_grad(var)
        pre, post = self._scale_factors()
        # Every rank exchanges every variable of the plan, which was checked across ranks at the
        # first synchronize: the backend may skip its own per-step layout check.
        handle = self.settings.backend.allreduce_async_(compressed, name=f"hybridsync.{var.name}", op=self.settings.op,
                                                        prescale_factor=pre, postscale_factor=post,
                                                        verified_layout=self.plan_verified)
        self._handles[var] = (handle, ctx)

    def _fused(self) -> bool:
        # A backend that cannot overlap (MPI: no progress thread) gains nothing from launching in
        # hooks; one fused all-reduce per dtype at synchronize() costs the least.
        return hasattr(self.settings.backend, "allreduce_many_")

    def grad_ready(self, var: Variable) -> None:
        if self.settings.world_size > 1 and not self._fused():
            self._launch(var)

    def synchronize(self) -> None:
        if self.settings.world_size == 1:
            for var in self.variables:
                var.plan.bytes_per_step = 0  # nothing to exchange
            return
        if self._fused():
            with timeline.span(f"all-reduce ({len(self.variables)} tensors fused, {self.settings.backend.name})", "dense"):
                self._synchronize_fused()
            return
        for var in self.variables:
            if var not in self._handles:
                self._launch(var)
        with timeline.span(f"all-reduce wait ({len(self._handles)} tensors, {self.settings.backend.name})", "dense"):
            self._wait_all()

    def _synchronize_fused(self) -> None:
        groups: dict = {}
        for var in sorted(self.variables, key=lambda v: v.index):  # the same order on every rank
            compressed, ctx = self._compressed_grad(var)
            groups.setdefault((var.compressor, compressed.dtype), []).append((var, compressed, ctx))
        pre, post = self._scale_factors()
        for (compressor, dtype), items in groups.items():
            tensors = [c for _, c, _ in items]
            self.settings.backend.allreduce_many_(tensors, op=self.settings.op, prescale_factor=pre,
                                                  postscale_factor=post, verified_layout=self.plan_verified,
                                                  name=f"hybridsync.fused.{dtype}")
            for var, compressed, ctx in items:
                reduced = compressor.decompress(compressed, ctx)
                if reduced.data_ptr() != var.param.grad.data_ptr():
                    var.param.grad.copy_(reduced)

    def _wait_all(self) -> None:
        for var, (handle, ctx) in self._handles.items():
            reduced = var.compressor.decompress(self.settings.backend.synchronize(handle), ctx)
            if reduced.data_ptr() != var.param.grad.data_ptr():
                var.param.grad.copy_(reduced)
        self._handles.clear()

    def in_flight(self) -> bool:
        return bool(self._handles)


class SparseAsDense(DenseAllreduce):
    """A sparse gradient densified and all-reduced; the wrapped optimizer applies it densely."""

    def _dense_grad(self, var: Variable):
        grad = var.param.grad
        return grad.to_dense() if grad.is_sparse else grad


class SparseAllgather(Synchronizer):
    """Every rank gathers every rank's (row, gradient) pairs; the wrapped optimizer applies the
    sum on every rank, so replicas stay identical. Bytes per rank grow with the world size:
    the baseline the parameter server is measured against."""

    def synchronize(self) -> None:
        if self.settings.world_size == 1:
            return
        backend = self.settings.backend
        for var in sorted(self.variables, key=lambda v: v.index):
            p = var.param
            g = p.grad
            if g is None:
                rows = torch.zeros(0, dtype=torch.int64, device=p.device)
                values = torch.zeros((0,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device)
            elif g.is_sparse:
                rows, values = g._indices()[0], g._values()
            else:
                raise RuntimeError(f"variable '{var.name}' is planned for allgather but produced a dense gradient")
            all_rows = backend.allgather(rows.contiguous(), name=f"hybridsync.{var.name}.rows")
            all_values = backend.allgather(values.contiguous(), name=f"hybridsync.{var.name}.values")
            if self.settings.op is ReduceOp.AVERAGE:
                all_values = all_values / self.settings.world_size
            p.grad = torch.sparse_coo_tensor(all_rows[None], all_values, p.shape, check_invariants=False)
            var.plan.bytes_per_step = int(all_rows.numel() * 8 + all_values.numel() * all_values.element_size())
