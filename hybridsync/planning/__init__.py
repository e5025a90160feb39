"""Planning, in one place: one stage a file, as both frontends use it.

    describe.py   the variables as a frontend describes them -> the plan (make_plan)
    rules.py      each variable's route from the built-in defaults and the YAML rules
    agreement.py  rank 0's plan, checked on every rank
    estimate.py   the cost model: time and memory per rank of each route
    choose.py     which routes apply an optimizer exactly; which assignments are worth trying
    measure.py    sync: auto -- measure on the parameter server, try, keep the fastest
    switch.py     moving a variable between routes exactly, both ways
    report.py     explain(): the plan and the decisions as tables, and the live plans' registry
    plan.py       the plan itself, plain data (JSON that loads back as a config)
"""
from .agreement import PlanMismatchError, agree
from .describe import Described, make_plan, ps_embedding_plan, route_resolver
from .measure import TRIAL_STEPS, AutoStrategy
from .plan import Plan, VariablePlan
from .report import announce, explain, register, render
from .rules import RouteResolver
from .switch import adopt


def start_auto(sync_set, frontend, resolver: RouteResolver, links=None) -> None:
    """Collective, at the first step: the `sync: auto` variables not decided yet are measured,
    tried and switched (measure.AutoStrategy), within the memory budget."""
    variables = sorted((var for var in sync_set.route_of
                        if var.plan.auto and var.plan.auto.get("status") != "decided"), key=lambda v: v.index)
    if variables and resolver.auto_steps > 0:
        fixed = sum(var.plan.memory_bytes or 0 for var in sync_set.route_of if not var.plan.auto)
        trial_steps = resolver.config.auto_trial_steps if resolver.config is not None else None
        sync_set.auto = AutoStrategy(sync_set, variables, frontend, resolver.auto_steps, resolver.memory_budget(),
                                     links, fixed, trial_steps=TRIAL_STEPS if trial_steps is None else trial_steps)


def adopt_auto(sync_set, frontend, saved: dict) -> None:
    """Collective: `sync: auto` variables not decided yet take a checkpointed run's decisions
    instead of measuring (switch.adopt)."""
    if adopt(sync_set, frontend, saved):
        sync_set.auto = None  # measuring, if it had started, is over


__all__ = ["Described", "make_plan", "route_resolver", "ps_embedding_plan", "RouteResolver", "agree",
           "PlanMismatchError", "Plan", "VariablePlan", "start_auto", "adopt_auto", "explain", "announce", "register",
           "render"]
