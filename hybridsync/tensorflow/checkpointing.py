"""What hybridsync.checkpoint needs from a Keras model and optimizer: the dense state as NumPy
arrays, and back. Tables on the parameter server are written by their shards' owners; a
replicated table's variable is refreshed from them after a load."""
from __future__ import annotations

from ..types import Placement
from .optimizer import variable_name
from .table_weight import TableWeight


def _dense_variables(model, optimizer, variables):
    """(key, variable) of the model's and the optimizer's variables that are not on the PS."""
    skip = {id(var.access.variable) for var in variables if var.plan.placement is Placement.REPLICATED}
    weights = [w for w in model.weights if not isinstance(w, TableWeight)]  # tables: saved by the shards
    for prefix, owner in (("model", weights), ("optimizer", optimizer.variables)):
        for i, v in enumerate(owner):
            if id(v) not in skip:
                yield f"{prefix}.{i}.{variable_name(v)}", v


def dense_state(model, optimizer, variables) -> tuple[dict, dict]:
    return {key: v.numpy() for key, v in _dense_variables(model, optimizer, variables)}, {}


def load_dense_state(model, optimizer, variables, arrays: dict, meta: dict) -> None:
    mine = dict(_dense_variables(model, optimizer, variables))
    for key in sorted(set(mine) ^ set(arrays)):
        where = "the model" if key in mine else "the checkpoint"
        raise ValueError(f"variable '{key.split('.', 2)[-1]}' is only in {where} (a checkpoint of another model?)")
    for key, v in mine.items():
        if tuple(arrays[key].shape) != tuple(v.shape):
            raise ValueError(f"variable '{key.split('.', 2)[-1]}': checkpoint has shape {tuple(arrays[key].shape)}, "
                             f"the model {tuple(v.shape)}")
    for key, v in mine.items():
        v.assign(arrays[key])


def refresh_replica(var, table) -> None:
    """Collective for replicated tables: the variable and the shard's copy take the loaded rows."""
    if var.plan.placement is not Placement.REPLICATED:
        return
    var.access.set_replica(table.read())
