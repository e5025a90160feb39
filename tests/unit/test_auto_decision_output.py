"""What `sync: auto` prints when it decides (plan.auto_decision_table), where it prints it
(plan.announce_auto_decision: wherever the plan was printed while auto measured), and that
benchmarks/auto.py reads the routes back from that table."""
import io

from hybridsync.planning import report as plan_mod
from hybridsync.planning import Plan, VariablePlan
from hybridsync.types import GradKind, Placement, Route


def _measuring(name, rows):
    return VariablePlan(name, (rows, 4), "float32", GradKind.SPARSE, Route.PS, Placement.SHARDED, shards=2,
                        auto={"status": "measuring", "steps": 4})


def _decide(v, route, shards, density, predicted, why):
    v.route, v.shards = route, shards
    v.placement = Placement.SHARDED if route is Route.PS else Placement.NONE
    v.auto.update(status="decided", choice=route.value, shards=shards, why=why, predicted_ms=predicted,
                  measured={"density": density, "rows_per_rank": 37.2, "union_rows": 39.8})


def _plan():
    hot, cold = _measuring("hot.weight", 40), _measuring("cold.weight", 4000)
    dense = VariablePlan("mlp.weight", (8, 8), "float32", GradKind.DENSE, Route.ALLREDUCE)
    return Plan([hot, cold, dense], world_size=2, backend="mpi"), hot, cold


def _decide_both(hot, cold):
    _decide(hot, Route.SPARSE_AS_DENSE, 0, 0.9938, {"allreduce-as-dense": 0.0218, "ps": 0.0824},
            "allreduce-as-dense predicted 73% faster than ps")
    _decide(cold, Route.PS, 1, 0.0041, {"ps": 0.0806, "allgather": 0.1906}, "ps predicted fastest")


def test_the_decision_table_has_the_route_shards_numbers_and_why():
    _, hot, cold = _plan()
    _decide_both(hot, cold)
    lines = plan_mod.auto_decision_table([hot, cold], 4).splitlines()
    assert lines[0].startswith("hybridsync sync: auto decided at step 4:")
    assert lines[1].split()[:4] == ["variable", "route", "shards", "density"] and set(lines[2]) <= {"-", " "}
    hot_row, cold_row = lines[3], lines[4]
    assert hot_row.split()[:4] == ["hot.weight", "allreduce-as-dense", "-", "99.38%"]
    assert "allreduce-as-dense 21.8 us, ps 82.4 us" in hot_row and hot_row.endswith("73% faster than ps")
    assert cold_row.split()[:4] == ["cold.weight", "ps", "1", "0.41%"]
    assert lines[1].index("route") == hot_row.index("allreduce-as-dense") == cold_row.index("ps ")  # aligned


def test_the_decision_is_printed_where_the_plan_was_printed_while_measuring(capsys):
    plan, hot, cold = _plan()
    plan_mod._print_plans([plan], io.StringIO())  # what explain() does
    _decide_both(hot, cold)
    plan_mod.announce_auto_decision([hot, cold], 4)
    first = capsys.readouterr().out
    assert "sync: auto decided at step 4:" in first and "cold.weight" in first
    plan_mod.announce_auto_decision([hot, cold], 4)  # once only
    assert capsys.readouterr().out == ""


def test_nothing_is_printed_where_no_plan_was_or_after_the_decision(capsys):
    plan, hot, cold = _plan()
    _decide_both(hot, cold)
    plan_mod._print_plans([plan], io.StringIO())  # printed after the decision: it already shows it
    plan_mod.announce_auto_decision([hot, cold], 4)
    assert capsys.readouterr().out == ""


def test_the_auto_benchmark_reads_the_routes_back():
    from benchmarks.auto import decided_routes

    _, hot, cold = _plan()
    _decide_both(hot, cold)
    tagged = "\n".join(["step    10  loss 0.6", plan_mod.auto_decision_table([hot, cold], 4), "step    20  loss 0.5"])
    assert decided_routes(tagged) == {"hot.weight": "allreduce-as-dense", "cold.weight": "ps/1"}
    assert decided_routes("step 1 loss 0.5") is None
