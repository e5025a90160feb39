"""DistributedOptimizer(process_set=...) in either frontend: gradients averaged over the members
of a process set.

As in Horovod, a member exchanges gradients with the other members only (over the set's own MPI
communicator, whatever the dense backend), and a rank outside the set never synchronizes: it
applies its own gradients. The parameter server's shards span every rank, so sparse gradients
take Horovod's routes here: all-gathered (the default) or, with sparse_as_dense=True, densified
and all-reduced; a config that puts a variable on the PS is an error naming it. Also here: the
config defaults that Horovod's sparse_as_dense=True means.
"""
from __future__ import annotations

import dataclasses

from .. import config as config_mod
from .. import process_sets, runtime
from ..types import Route


def sparse_default_config(config, sync: str, why: str):
    """The config with every sparse variable on route `sync` by default (`why` names who asked);
    rules in the config's `variables` still win."""
    cfg = config_mod.load(config if config is not None else runtime.default_config())
    if cfg is None:
        cfg = config_mod.load({"defaults": {"sparse": {"sync": sync}}})
    else:
        sparse = config_mod.Settings(sync=sync, compression=cfg.sparse.compression)
        cfg = dataclasses.replace(cfg, sparse=sparse, where=dict(cfg.where))
    cfg.where["defaults.sparse"] = why
    return cfg


def sparse_as_dense_config(config):
    """Horovod's sparse_as_dense=True: sparse variables densified and all-reduced by default."""
    return sparse_default_config(config, "allreduce-as-dense", "DistributedOptimizer(sparse_as_dense=True)")


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
        return sparse_as_dense_config(config)
    return sparse_default_config(config, "allgather", "DistributedOptimizer(process_set=...): Horovod's allgather")


def check_routes(variables, scope: SetScope) -> None:
    """No variable (VariablePlan) of a process-set optimizer may be on the parameter server (the
    plan is the same on every member, so every member raises)."""
    for v in variables:
        if v.route is Route.PS:
            raise ValueError(f"variable '{v.name}' is on the parameter server ({v.reason}), whose shards span every "
                             f"rank of the job, but the optimizer reduces over process set {scope.process_set.ranks}; "
                             "use sync: allgather or allreduce-as-dense for it (or the global process set)")
