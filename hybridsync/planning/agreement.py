"""Plan agreement: the plan is computed on rank 0 and broadcast; every rank checks its own
against it, and all raise together, naming the first rank that differs, instead of one rank
deadlocking in a later collective."""
from __future__ import annotations

from .plan import Plan


class PlanMismatchError(RuntimeError):
    """Ranks built different models (or read different configs)."""


def _signature(plan: Plan) -> list:
    return [(v.name, tuple(v.shape), v.route.value if v.route else None, v.placement.value) for v in plan.variables]


def _difference(reference: list, mine: list, rank: int) -> str:
    for i, (a, b) in enumerate(zip(reference, mine)):
        if a != b:
            return (f"rank {rank} differs from rank 0 at variable #{i}: rank 0 has {a[0]} {a[1]} ({a[2]}/{a[3]}), "
                    f"rank {rank} has {b[0]} {b[1]} ({b[2]}/{b[3]}); every rank must build the same model and use "
                    "the same config")
    if len(reference) != len(mine):
        return (f"rank {rank} has {len(mine)} variables, rank 0 has {len(reference)}; every rank must build the "
                "same model")
    return ""


def agree(plan: Plan, objects) -> Plan:
    """Collective: rank 0's plan, on every rank. `objects` carries small Python objects
    (broadcast_object, allgather_object, rank, size: a dense backend)."""
    if objects.size == 1:
        return plan
    # Named: Horovod names an unnamed object by its type, which differs between root and the rest.
    # Roots are global ranks: a process set's first member is its local rank 0.
    root = getattr(objects, "ranks", [0])[0]
    reference = objects.broadcast_object(plan.to_json() if objects.rank == 0 else None, root, name="hybridsync.plan")
    problem = _difference(_signature(Plan.from_json(reference)), _signature(plan), objects.rank)
    problems = objects.allgather_object(problem, name="hybridsync.plan_check")
    first = next((p for p in problems if p), "")
    if first:
        raise PlanMismatchError(first)
    return plan if objects.rank == 0 else Plan.from_json(reference)
