"""DistributedOptimizer(op=Adasum): Horovod's Adasum optimizer.

With Adasum, ranks do not combine gradients: each rank applies the wrapped optimizer to its own
gradient, and the ranks combine the resulting parameter *changes* with the Adasum all-reduce
(hvd.allreduce(op=Adasum)), which adds orthogonal updates and averages parallel ones. As in
Horovod, a parameter's local update runs as soon as its gradient is final (from its gradient
hook), and its all-reduce starts right away; step() waits for them and sets every parameter to
its starting value plus the combined change.

Every parameter takes this path (sparse embedding gradients too, as dense changes): Adasum has
no parameter-server route, so `model=` and `config=` are refused rather than silently ignored.
"""
from __future__ import annotations

import contextlib

import torch

from .. import comm, runtime
from .horovod import mpi_ops
from .optimizer_args import parameter_names


class _AdasumOptimizer:
    """Mixed in front of the wrapped optimizer's class. Attributes are prefixed `_hs_`."""

    def _hs_setup(self, named, compression, backward_passes_per_step):
        self._hs_names = {p: name for name, p in named}
        self._parameter_names = parameter_names(named)
        self._hs_compression = compression
        self._hs_bpps = backward_passes_per_step
        self._hs_start = {p: torch.zeros_like(p, requires_grad=False) for _, p in named}
        self._hs_passes = {p: 0 for _, p in named}
        self._hs_handles: dict = {}  # parameter -> (handle, compression context), in launch order
        self._hs_should_sync = True
        self._hs_hooks = [p.register_post_accumulate_grad_hook(self._hs_on_grad) for _, p in named if p.requires_grad]

    # -- one parameter's change -----------------------------------------------------------------
    def _hs_on_grad(self, p):
        if p in self._hs_handles and self._hs_handles[p] is not None:
            raise RuntimeError(
                f"the gradient of '{self._hs_names[p]}' was computed {self._hs_passes[p] + 1} times before step() "
                f"(backward_passes_per_step={self._hs_bpps}); increase backward_passes_per_step "
                "to accumulate gradients locally")
        self._hs_passes[p] += 1
        if self._hs_passes[p] == self._hs_bpps:
            self._hs_handles[p] = self._hs_launch(p)

    def _hs_launch(self, p):
        """Applies the wrapped optimizer to p alone, turns p into the change it made, and starts
        combining that change across ranks."""
        start = self._hs_start[p]
        start.copy_(p.detach())
        kept = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [q for q in group["params"] if q is p]
            with torch.no_grad():
                super().step()
        finally:
            for group, params in zip(self.param_groups, kept):
                group["params"] = params
        with torch.no_grad():
            p.sub_(start)
            compressed, ctx = self._hs_compression.compress(p.detach())
            if compressed.data_ptr() != p.data_ptr():  # a codec made a copy: reduce the copy
                return mpi_ops.allreduce_async_(compressed, name=f"adasum.{self._hs_names[p]}", op=mpi_ops.Adasum), ctx
            return mpi_ops.allreduce_async_(p.data, name=f"adasum.{self._hs_names[p]}", op=mpi_ops.Adasum), ctx

    # -- Horovod's optimizer API ----------------------------------------------------------------
    @property
    def backward_passes_per_step(self):
        return self._hs_bpps

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self._hs_bpps = passes

    def synchronize(self):
        """Starts the change of every parameter whose gradient never became final this step (it
        may have none: its change is then zero), waits for all, and applies the combined changes."""
        for p in self._hs_start:
            if p.requires_grad and self._hs_handles.get(p) is None:
                self._hs_handles[p] = self._hs_launch(p)
        for p, (handle, ctx) in list(self._hs_handles.items()):
            reduced = mpi_ops.synchronize(handle)
            change = self._hs_compression.decompress(reduced, ctx)
            with torch.no_grad():
                start = self._hs_start[p]
                start.add_(change.to(start.dtype))
                p.copy_(start)
            self._hs_passes[p] = 0
        self._hs_handles.clear()

    @contextlib.contextmanager
    def skip_synchronize(self):
        self._hs_should_sync = False
        try:
            yield
        finally:
            self._hs_should_sync = True

    def step(self, closure=None):
        """The updates were applied per parameter as gradients became final; step() combines
        their changes across ranks."""
        loss = closure() if closure is not None else None
        if self._hs_should_sync:
            self.synchronize()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        if self._hs_handles:
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                               "or optimizer.synchronize(): parameter changes are still being combined")
        return super().zero_grad(set_to_none=set_to_none)


def adasum_optimizer(optimizer, named, compression, backward_passes_per_step, model, config, backend):
    """The Adasum form of DistributedOptimizer (arguments already checked by the caller)."""
    if model is not None or config is not None:
        raise ValueError("DistributedOptimizer(op=Adasum): every parameter's update is combined with Adasum "
                         "(Horovod's Adasum optimizer), which has no parameter-server route; leave out model= and "
                         "config=")
    size = runtime.world().size
    if size & (size - 1):  # Horovod finds out at the first all-reduce; no need to wait for it
        raise NotImplementedError(f"DistributedOptimizer(op=Adasum): Adasum needs a power-of-two number of ranks "
                                  f"(as in Horovod), not {size}")
    job_backend = comm.choose()
    if backend is not None and comm.choose(backend) != job_backend:
        raise ValueError(f"DistributedOptimizer(op=Adasum, backend={backend!r}): Adasum runs on the job's dense "
                         f"backend ({job_backend!r}); choose it with hybridsync.init(backend=...)")
    base = type(optimizer)
    cls = type(base.__name__, (_AdasumOptimizer, base), {"__module__": __name__})
    dist = cls.__new__(cls)
    dist.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    dist._hs_setup(named, compression, backward_passes_per_step)
    return dist
