"""Which server-side rule applies a wrapped optimizer's update to a table on the parameter
server, for every frontend: the frontend describes its optimizer (OptimizerSpec), this module
decides, with one set of error messages.

SGD (no momentum) -> sgd; Adagrad -> adagrad; Adam (and torch's SparseAdam) -> adam, applied
lazily: only rows with a gradient move. Settings that would not reach the rows the server
updates (weight decay, momentum, clipping, EMA, ...) are errors naming the optimizer, the setting
and the variable.
"""
from __future__ import annotations

import dataclasses

FAMILIES = ("sgd", "adagrad", "adam")


class UnsupportedSparseOptimizer(ValueError):
    """The wrapped optimizer has no server-side equivalent for a table on the PS."""


@dataclasses.dataclass
class OptimizerSpec:
    class_name: str
    family: str | None  # one of FAMILIES, or None when the server has no such rule
    hparams: dict  # the rule's hyper-parameters (lr, eps, ...), read now
    blockers: list = dataclasses.field(default_factory=list)  # [(setting, value)] the server cannot apply
    applies_sparse: bool = False  # the optimizer applies a row-sparse gradient itself (allgather)
    # ... and that update equals the server rule's, duplicate rows included (sync: auto may
    # then move the table to allgather)
    sparse_exact: bool = False


def server_rule(spec: OptimizerSpec, variable: str) -> dict:
    """{"name": rule, **hyper-parameters} for `variable`, or UnsupportedSparseOptimizer."""
    if spec.blockers:
        setting, value = spec.blockers[0]
        _reject(variable, spec, f"with {setting}={value}")
    if spec.family not in FAMILIES:
        _reject(variable, spec, "is not supported")
    return {"name": spec.family, **{k: float(v) for k, v in spec.hparams.items()}}


def _reject(variable: str, spec: OptimizerSpec, reason: str):
    raise UnsupportedSparseOptimizer(
        f"variable '{variable}': {spec.class_name} {reason}, which the parameter server cannot apply to a table "
        "row by row; use SGD (no momentum), Adagrad or Adam (or torch's SparseAdam) for it, or give it a server "
        "optimizer in the config (variables: - match: ... optimizer: {name: adagrad, lr: ...})")


def hyperparameters(rule: dict) -> tuple[str, dict]:
    """(rule name, float hyper-parameters) as the C++ engine takes them."""
    return rule["name"], {k: float(v) for k, v in rule.items() if k != "name"}
