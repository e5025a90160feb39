"""Choosing a route for a `sync: auto` variable: which routes apply exactly its optimizer's
update (the candidates), and the cost model's choice among them (estimate.py predicts)."""
from __future__ import annotations

from . import estimate


def candidates_for(spec, optimizer_source: str) -> tuple:
    """Routes that apply the same update as the server rule of a wrapped optimizer described by
    `spec` (server_rules.OptimizerSpec): a dense update equals it for SGD and Adagrad (a row with a
    zero gradient does not move); an applied row-sparse gradient equals it when the frontend's
    sparse update matches the rule (spec.sparse_exact). A server optimizer fixed in the config
    differs from the wrapped one: only ps."""
    if optimizer_source == "config":
        return (estimate.PS,)
    out = [estimate.PS]
    if spec.applies_sparse and spec.sparse_exact:
        out.append(estimate.ALLGATHER)
    if spec.family in ("sgd", "adagrad"):
        out.append(estimate.DENSE)
    return tuple(out)




# A route predicted this many times slower than a variable's fastest is not tried: the model
# prunes, the clock decides among the rest.
PRUNE_FACTOR = 3.0
MAX_TRIALS = 3


def _fits(assignment: dict, predictions: dict, budget: float) -> bool:
    return sum(predictions[n]["memory_bytes"].get(a["choice"], 0) for n, a in assignment.items()) <= budget


def assignments_to_try(predictions: dict, budget: float, may_try: bool) -> tuple[list, dict]:
    """(assignments to try, the assignment chosen without trying). An assignment maps each auto
    variable to {"choice": route, "shards": PS shards}. predictions: per variable, the model's
    decision (estimate.Decision.to_json() with "candidates" and "memory_bytes" per route).
    Tried: the model's choice and, per other route, that route wherever it is not pruned; none
    over `budget` (bytes per rank for these variables together); the parameter server's own
    measurement stands for staying. A frontend that cannot bring a table back to the parameter
    server, or auto_trial_steps 0 (may_try False), tries nothing: the model's choice is taken."""
    staying = {n: {"choice": estimate.PS, "shards": p["ps_current_shards"]} for n, p in predictions.items()}
    model = {n: {"choice": p["choice"], "shards": p["shards"]} for n, p in predictions.items()}
    for n, p in sorted(predictions.items(), key=lambda kv: -max(kv[1]["memory_bytes"].values())):
        if not _fits(model, predictions, budget) and model[n]["choice"] != estimate.PS:
            model[n] = {"choice": estimate.PS, "shards": p["ps_best_shards"]}  # the biggest replicas go first
            p["over_budget"] = True
    if not may_try:
        return [], model
    tried = [model] if model != staying else []
    for route in (estimate.ALLGATHER, estimate.DENSE):
        option = dict(model)
        for n, p in predictions.items():
            times = p["predicted_ms"]
            if route in times and times[route] <= PRUNE_FACTOR * min(times.values()):
                option[n] = {"choice": route, "shards": 0}
        if option != staying and option not in tried and _fits(option, predictions, budget):
            tried.append(option)
    return tried[:MAX_TRIALS], model
