"""What hybridsync.checkpoint needs from a Keras model and optimizer: the dense state as NumPy
arrays, and back. Tables on the parameter server are written by their shards' owners;
hybridsync.checkpoint refreshes a replicated table's variable after a load."""
from __future__ import annotations

import re

import ml_dtypes  # (TensorFlow's own dependency: its bfloat16 arrays are ml_dtypes')
import numpy as np

from ..array_files import RawBits
from ..checkpoint import check_dense_match
from ..types import GradKind, Placement
from . import adaptive, keras_embeddings
from .names import table_variable_name, variable_name
from .table_weight import TableWeight


def before_load(model, optimizer, manifest: dict) -> None:
    """Collective. Before its first step a Keras DistributedOptimizer has no plan (it plans when
    the gradients' kinds are known): it is made here for the model's trainable variables, with
    the kinds the checkpoint's plan recorded for them, so a model loads right after compile().
    First the checkpoint's names become this model's where Keras numbered them differently."""
    _rename_as_saved(model, manifest)
    if getattr(optimizer, "_hs_plan", None) is not None or not hasattr(optimizer, "_hs_plan_ahead"):
        return
    _move_embeddings_as_saved(model, optimizer, manifest)
    variables = list(model.trainable_variables)
    if not variables:
        raise ValueError("the model has no variables yet: build it (call it once, or give it an Input) before "
                         "load_checkpoint")
    saved = {v["name"]: v.get("kind") for v in (manifest.get("plan") or {}).get("variables", [])}
    kinds = []
    for v in variables:
        if getattr(v, "_hybridsync_table", None) is not None:  # a PS table's anchor: its plan needs no kind
            kinds.append(None)
            continue
        name = variable_name(v)
        if not saved.get(name):
            raise ValueError(f"variable '{name}' is not in the checkpoint's plan (a checkpoint of another model?)")
        kinds.append(GradKind(saved[name]))
    optimizer._hs_plan_ahead(variables, kinds)


_KERAS_NUMBER = re.compile(r"_\d+(?=[/_]|$)")


def _unnumbered(name: str) -> str:
    """A Keras name without the numbers Keras adds to make layer and optimizer names unique in a
    process ('sequential_1/dense_2/kernel' -> 'sequential/dense/kernel'; an optimizer's slot
    'adagrad_1/sequential_1_dense_2_kernel_accumulator' likewise): the same model built again, or
    after another, gets other numbers, and its checkpoint must still load (as Keras's own does)."""
    return _KERAS_NUMBER.sub("", name)


def _rename_as_saved(model, manifest: dict) -> None:
    """The checkpoint's variable names become this model's, in place, where Keras numbered them
    differently: only if the saved plan's variables and this model's trainable variables are the
    same sequence once the numbers are dropped, position by position (a name that merely exists
    in both may belong to another layer now). The plan's names, the tables' and those the
    adaptive batch's statistics are kept under all follow. Otherwise nothing is renamed, and
    what differs is reported later, as before."""
    plan = manifest.get("plan") or {}
    saved = [v["name"] for v in plan.get("variables", [])]
    mine = [table_variable_name(v) if getattr(v, "_hybridsync_table", None) is not None else variable_name(v)
            for v in model.trainable_variables]
    if saved == mine or [_unnumbered(n) for n in saved] != [_unnumbered(n) for n in mine]:
        return
    renamed = dict(zip(saved, mine))
    for v in plan.get("variables", []):
        v["name"] = renamed[v["name"]]
    for entry in manifest.get("tables", []):
        entry["variable"] = renamed.get(entry["variable"], entry["variable"])
    state = ((manifest.get("dense") or {}).get("meta") or {}).get("adaptive") or {}
    for part, keyed in (("stats", "by_variable"), ("stats", "steady"), ("rows", "counts"), ("rows", "duplicates")):
        names = (state.get(part) or {}).get(keyed)
        if names:
            state[part][keyed] = {renamed.get(name, name): value for name, value in names.items()}


def _move_embeddings_as_saved(model, optimizer, manifest: dict) -> None:
    """Collective: the plain Keras Embeddings that the run which saved had moved to the shards
    (fit's callback or model= moved them there; only a moved layer's variable is on the sharded
    PS) move now, before the plan, as they would have at train begin. The others stay: a
    checkpoint of a loop that kept its tables holds them as variables."""
    saved = (manifest.get("plan") or {}).get("variables", [])
    sharded = {v["name"] for v in saved if v.get("route") == "ps" and v.get("placement") == "sharded"}
    optimizer._hs_move_embeddings([layer for layer in keras_embeddings.plain_embeddings(model)
                                   if layer.built and variable_name(layer._embeddings) in sharded])


def _dense_variables(model, optimizer, variables):
    """(key, variable) of the model's and the optimizer's variables that are not on the PS."""
    skip = {id(var.access.variable) for var in variables if var.plan.placement is Placement.REPLICATED}
    weights = [w for w in model.weights if not isinstance(w, TableWeight)]  # tables: saved by the shards
    for prefix, owner in (("model", weights), ("optimizer", optimizer.variables)):
        for i, v in enumerate(owner):
            if id(v) not in skip:
                yield f"{prefix}.{i}.{variable_name(v)}", v


def dense_state(model, optimizer, variables) -> tuple[dict, dict]:
    # (bfloat16 variables give ml_dtypes arrays: the checkpoint stores their raw bits)
    arrays = {key: v.numpy() for key, v in _dense_variables(model, optimizer, variables)}
    adaptive = getattr(optimizer, "_hs_adaptive", None)
    # The adaptive batch's statistics, batch and scale-invariant progress, as PyTorch's checkpoint keeps them.
    return arrays, ({"adaptive": adaptive.state_dict()} if adaptive is not None else {})


def _from_array(value, key: str) -> np.ndarray:
    """A stored array as NumPy hands it to TensorFlow: raw bits (bfloat16, float8) become
    ml_dtypes' type of that name (what TensorFlow's own bfloat16 arrays are)."""
    if not isinstance(value, RawBits):
        return value
    dtype = getattr(ml_dtypes, value.dtype, None)
    if dtype is None:
        raise ValueError(f"checkpoint entry '{key}' has dtype '{value.dtype}', which ml_dtypes does not know")
    return value.bits.view(dtype)


def load_dense_state(model, optimizer, variables, arrays: dict, meta: dict) -> None:
    # Keys ('model.3.dense/kernel') are matched without Keras's numbers: the index tells
    # variables of one name apart, and a model built again in a process gets other numbers.
    mine = {_unnumbered(key): (key, v) for key, v in _dense_variables(model, optimizer, variables)}
    saved = {_unnumbered(key): key for key in arrays}
    shown = {**{k: key for k, key in saved.items()}, **{k: key for k, (key, _) in mine.items()}}
    check_dense_match({k: v.shape for k, (_, v) in mine.items()}, {k: arrays[key].shape for k, key in saved.items()},
                      shown=lambda k: shown[k].split(".", 2)[-1])
    for k, (key, v) in mine.items():
        v.assign(_from_array(arrays[saved[k]], saved[k]))
    if "adaptive" in meta and getattr(optimizer, "_hs_adaptive", None) is not None:
        adaptive.load_state(optimizer, meta["adaptive"])  # at another world size: the global batch, re-chosen later

