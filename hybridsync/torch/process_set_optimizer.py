"""DistributedOptimizer(process_set=...): gradients averaged over the members of a process set.

As in Horovod, a member exchanges gradients with the other members only (over the set's own MPI
communicator, whatever the dense backend), and a rank outside the set gets an optimizer that
never synchronizes: its step() applies its own gradients. The parameter server's shards span
every rank, so sparse gradients take Horovod's routes here: all-gathered (the default) or, with
sparse_as_dense=True, densified and all-reduced; a config that puts a variable on the PS is an
error naming it.
"""
from __future__ import annotations

import contextlib

from ..types import Route
from .horovod import process_sets
from .optimizer_args import parameter_names, sparse_default_config


class SetScope:
    """Where a process-set optimizer's exchanges run: the set's MPI collectives on a member."""

    def __init__(self, process_set):
        self.process_set = process_set
        self.engine = process_sets.engine_of(process_set, "DistributedOptimizer(process_set=...)")
        self.size = len(process_set.ranks)

    def reason(self) -> str:
        return f"process set {self.process_set.ranks}: gradients are averaged over its members, on their MPI communicator"


def scope_for(process_set):
    """None for the global set; a SetScope on a member; False on a rank outside the set.
    Raises ValueError for a set that is not registered."""
    if process_sets.is_global(process_set):
        return None
    if not isinstance(process_set, process_sets.ProcessSet):
        raise ValueError(f"DistributedOptimizer(process_set=...) takes a hvd.ProcessSet, not {type(process_set).__name__}")
    if process_set.process_set_id is None or process_set.ranks is None:
        raise ValueError(f"DistributedOptimizer(process_set={process_set}): the set is not registered "
                         "(hvd.add_process_set or hvd.init(process_sets=...))")
    if not process_set.included():
        return False
    return SetScope(process_set)


def set_config(config, sparse_as_dense: bool):
    """The config with sparse variables on Horovod's route by default (rules still win)."""
    if sparse_as_dense:
        return sparse_default_config(config, "allreduce-as-dense", "DistributedOptimizer(sparse_as_dense=True)")
    return sparse_default_config(config, "allgather", "DistributedOptimizer(process_set=...): Horovod's allgather")


def check_routes(variables, scope: SetScope) -> None:
    """No variable (VariablePlan) of a process-set optimizer may be on the parameter server (the
    plan is the same on every member, so every member raises)."""
    for v in variables:
        if v.route is Route.PS:
            raise ValueError(f"variable '{v.name}' is on the parameter server ({v.reason}), whose shards span every "
                             f"rank of the job, but the optimizer reduces over process set {scope.process_set.ranks}; "
                             "use sync: allgather or allreduce-as-dense for it (or the global process set)")


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
