"""Every route a config can ask for trains exactly like one process with the whole batch:
a sparse table all-reduced as dense, a sparse table all-gathered Horovod-style, a dense variable
on the parameter server (row-sharded), and PS tables on fewer shards than ranks -- for SGD and
Adagrad, at -np 2 and -np 3. Moving a table off the PS changes explain() and keeps parity."""
import pytest

from tests.parallel.harness import rank_main, run_scenarios
from hybridsync.planning import render

CASES = {
    "sparse-as-dense": {"variables": [{"match": "emb.weight", "sync": "allreduce"}]},
    "allgather": {"variables": [{"match": "emb.weight", "sync": "allgather"}, {"match": "bag.*", "sync": "allgather"}]},
    "dense-on-ps": {"variables": [{"match": "mlp.0.*", "sync": "ps", "partitions": 1},
                                  {"match": "mlp.2.weight", "sync": "ps"}]},
    "few-partitions": {"variables": [{"match": "emb.weight", "sync": "ps", "partitions": 1, "partition": "block"},
                                     {"match": "bag.weight", "sync": "ps", "placement": "replicated", "partitions": 2}]},
}


def _train(optimizer_name, config, placement, rank, size, steps=6):
    import torch
    import torch.nn.functional as F

    import hybridsync.torch as hvd
    from tests.parallel.test_sparse_parity import LOCAL_BATCH, _batch, _model

    model = _model()
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.2),
            "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1)}[optimizer_name]
    opt = make(model.parameters())
    if placement is not None:
        kwargs = {"model": model} if placement == "sharded" else {"named_parameters": model.named_parameters()}
        opt = hvd.DistributedOptimizer(opt, config=config, **kwargs)
    for step in range(steps):
        ids, bag_ids, dense, y = _batch(step, size)
        if placement is not None:
            part = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            ids, bag_ids, dense, y = ids[part], bag_ids[part], dense[part], y[part]
        opt.zero_grad()
        F.mse_loss(model(ids, bag_ids, dense), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt


def rank_routes(backend):
    import torch

    import hybridsync.torch as hvd

    hvd.init(backend=backend)  # the dense backend of every optimizer below
    rank, size = hvd.rank(), hvd.size()
    for optimizer_name in ("sgd", "adagrad"):
        want, _ = _train(optimizer_name, None, None, rank, size)
        for case, config in CASES.items():
            for placement in ("sharded", "replicated"):
                got, opt = _train(optimizer_name, config, placement, rank, size)
                for key in want:
                    torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{case}/{placement}/{optimizer_name} {key}: {m}")
                assert opt.plan.backend == backend
                routes = {v.name: (v.route.value, v.placement.value, v.shards) for v in opt.plan.variables}
                if case == "sparse-as-dense":
                    assert routes["emb.weight"][0] == "allreduce-as-dense", routes
                elif case == "allgather":
                    assert routes["emb.weight"][0] == routes["bag.weight"][0] == "allgather", routes
                elif case == "dense-on-ps":
                    assert routes["mlp.0.weight"] == routes["mlp.0.bias"] == ("ps", "replicated", 1), routes
                    assert routes["mlp.2.weight"] == ("ps", "replicated", size), routes
                else:
                    assert routes["emb.weight"][2] == 1 and routes["bag.weight"] == ("ps", "replicated", 2), routes
        print(f"rank {rank}: every route matches the single-process run ({optimizer_name})", flush=True)


def rank_moving_a_table_changes_explain():
    import torch

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()
    want, _ = _train("adagrad", None, None, rank, size)
    _, before = _train("adagrad", None, "sharded", rank, size)
    got, after = _train("adagrad", CASES["sparse-as-dense"], "sharded", rank, size)
    row = lambda plan: next(line for line in render(plan).splitlines() if line.startswith("emb.weight"))
    assert " ps " in row(before.plan) and "sharded" in row(before.plan), row(before.plan)
    assert "allreduce-as-dense" in row(after.plan) and "rule 'emb.weight'" in row(after.plan), row(after.plan)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


# One launch per world size (a launch costs seconds on 2 cores): both backends, and at 2 ranks the
# explain() check first (it reads the plans of the live optimizers). A failure names its sub-case.
@pytest.mark.parametrize("np_", [2, 3])
def test_every_route_matches_the_single_process_run_under_mpi_and_horovod(np_):
    """At 2 ranks also: moving a table from the PS to all-reduce changes explain()."""
    first = ("rank_moving_a_table_changes_explain",) if np_ == 2 else ()
    run_scenarios(__file__, np_, *first, ("rank_routes", "mpi"), ("rank_routes", "horovod"), timeout=400)


if __name__ == "__main__":
    rank_main(globals())
