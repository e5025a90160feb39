"""DistributedOptimizer(process_set=...) in PyTorch: the scope of a process set is
hybridsync.sync.process_set_scope's (shared with Keras); a rank outside the set gets an optimizer
that never synchronizes: its step() applies its own gradients."""
from __future__ import annotations

import contextlib

from ..sync.process_set_scope import SetScope, check_routes, scope_for, set_config  # noqa: F401
from .optimizer_args import parameter_names


class _OutsideSetOptimizer:
    """Mixed in front of the wrapped optimizer's class on a rank outside the process set: no
    gradient exchange (Horovod registers no hooks there); step() is the wrapped optimizer's."""

    def _hs_setup(self, named, backward_passes_per_step):
        self._parameter_names = parameter_names(named)
        self._hs_bpps = backward_passes_per_step

    @property
    def backward_passes_per_step(self):
        return self._hs_bpps

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self._hs_bpps = passes

    def synchronize(self):
        """Nothing to exchange: this rank is not in the optimizer's process set."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield


def outside_set_optimizer(optimizer, named, backward_passes_per_step):
    """The optimizer of a rank outside the process set (shares the wrapped one's state)."""
    base = type(optimizer)
    cls = type(base.__name__, (_OutsideSetOptimizer, base), {"__module__": __name__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    wrapped._hs_setup(named, backward_passes_per_step)
    return wrapped
