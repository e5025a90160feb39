"""`sync: auto`: two sparse tables, one touched densely (most of its rows by every rank, every
step) and one sparsely (a few rows of thousands). After the measured steps, auto moves the
first to allreduce-as-dense and keeps the second on the parameter server (on the shard count
the cost model prefers), at the same step on every rank; the parameters match one process
training on the whole batch, before and after the switch, for SGD and Adagrad, in both
placements, at -np 2 and 3. The plan's JSON loads back as a fixed config that trains the same.

The links are fixed (a cache file in a temporary HYBRIDSYNC_CACHE_DIR: a 10 Gbit-like network)
so the choice depends only on what was measured; one scenario runs the real probe instead."""
import contextlib
import json
import os
import tempfile

import pytest

from tests.parallel.harness import rank_main, run_ranks, run_scenarios, subcase_output
from hybridsync.planning import render

LOCAL_BATCH, AUTO_STEPS, STEPS = 5, 4, 9
DENSE_ROWS, SPARSE_ROWS, DIM = 40, 4000, 4
LINKS = {"p2p_latency_s": 20e-6, "p2p_bandwidth": 1.25e9, "allreduce_latency_s": 40e-6,
         "allreduce_bandwidth": 0.6e9, "memory_bandwidth": 5e9, "ranks": 0, "hosts": 1, "source": "test",
         "format": 2, "collective_s": 20e-6}
CONFIG = {"auto_steps": AUTO_STEPS, "auto_trial_steps": 0}  # the model decides: the choice is deterministic


def _model():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hot = torch.nn.Embedding(DENSE_ROWS, DIM, sparse=True)
            self.cold = torch.nn.EmbeddingBag(SPARSE_ROWS, DIM, mode="sum", sparse=True)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(2 * DIM + 2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

        def forward(self, hot_ids, cold_ids, dense):
            return self.mlp(torch.cat([self.hot(hot_ids).mean(1), self.cold(cold_ids), dense], dim=1))

    torch.manual_seed(11)
    return Net()


def _batch(step, size):
    """The global batch: every local batch touches most of `hot` (20 draws of 40 rows per
    sample), and a handful of `cold`'s 4000 rows (with repeats across ranks)."""
    import torch

    g = torch.Generator().manual_seed(500 + step)
    n = LOCAL_BATCH * size
    hot = torch.randint(0, DENSE_ROWS, (n, 20), generator=g)
    cold = torch.randint(0, 12, (n, 2), generator=g)
    cold[:, 1] = torch.randint(0, SPARSE_ROWS, (n,), generator=g)
    return hot, cold, torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g)


def _optimizer(name, model):
    import torch

    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.3)
    return torch.optim.Adagrad(model.parameters(), lr=0.2, initial_accumulator_value=0.1, lr_decay=0.01)


def _train(name, placement, config, rank, size, steps=STEPS, check=None):
    import torch
    import torch.nn.functional as F

    import hybridsync.torch as hvd

    model = _model()
    opt = _optimizer(name, model)
    if placement is not None:
        kwargs = {"model": model} if placement == "sharded" else {"named_parameters": model.named_parameters()}
        opt = hvd.DistributedOptimizer(opt, config=config, **kwargs)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    for step in range(steps):
        hot, cold, dense, y = _batch(step, size)
        if placement is not None:
            part = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            hot, cold, dense, y = hot[part], cold[part], dense[part], y[part]
        opt.zero_grad()
        F.mse_loss(model(hot, cold, dense), y).backward()
        opt.step()
        schedule.step()
        if check is not None:
            check(step, opt)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt


def _routes(plan):
    return {v.name: (v.route.value, v.placement.value, v.shards) for v in plan.variables}


def _close(got, want, what):
    import torch

    assert set(got) == set(want), (what, set(got) ^ set(want))
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {key}: {m}")


def rank_auto_parity(backend):
    import hybridsync.torch as hvd

    hvd.init(backend=backend)
    rank, size = hvd.rank(), hvd.size()
    for name in ("sgd", "adagrad"):
        for placement in ("sharded", "replicated"):
            reference, _ = _train(name, None, None, rank, size)

            measured_on = {}

            def check(step, opt):
                if step == 0:
                    measured_on.update({var.name: var.table for var in opt._hs_vars if var.table is not None})
                routes = _routes(opt.plan)
                if step < AUTO_STEPS - 1:  # measuring, on the parameter server
                    assert routes["hot.weight"][0] == routes["cold.weight"][0] == "ps", (step, routes)
                    assert opt.plan.by_name()["hot.weight"].auto["status"] == "measuring"
                else:  # switched at the end of step AUTO_STEPS - 1, on every rank
                    assert routes["hot.weight"] == ("allreduce-as-dense", "-", 0), (step, routes)
                    assert routes["cold.weight"][:2] == ("ps", placement), (step, routes)

            got, opt = _train(name, placement, CONFIG, rank, size, check=check)
            _close(got, reference, f"{name}/{placement} auto")
            # The tables left behind (hot's, and cold's before re-sharding) gave their memory back.
            assert set(measured_on) == {"hot.weight", "cold.weight"}, measured_on
            for var_name, table in measured_on.items():
                with pytest.raises(Exception, match=f"PS table '{var_name}' was dropped"):
                    table.layout
            plan = opt.plan
            # Every rank agrees (the decision was rank 0's, broadcast).
            mine = {v.name: (v.route.value, v.placement.value, v.shards, v.auto) for v in plan.variables}
            everyone = hvd.allgather_object(json.dumps(mine, sort_keys=True))
            assert all(e == everyone[0] for e in everyone)
            hot, cold = plan.by_name()["hot.weight"].auto, plan.by_name()["cold.weight"].auto
            assert hot["status"] == cold["status"] == "decided" and hot["switched_at_step"] == AUTO_STEPS
            assert hot["choice"] == "allreduce-as-dense" and cold["choice"] == "ps", (hot, cold)
            assert hot["measured"]["density"] > 0.8 > 0.01 > cold["measured"]["density"], (hot, cold)
            assert set(hot["predicted_ms"]) == {"ps", "allgather", "allreduce-as-dense"}, hot
            assert hot["margin"] > 0 and cold["margin"] > 0, (hot, cold)
            # With these links a few rows go fastest to one shard: the table was re-sharded.
            assert cold["shards"] == 1 and plan.by_name()["cold.weight"].shards == 1, cold
            text = render(plan)
            line = next(x for x in text.splitlines() if x.strip().startswith("hot.weight: density"))
            assert "allreduce-as-dense" in line and "choice: allreduce-as-dense" in line and "margin" in line, text
            # The JSON plan (measurements and predictions kept) loads back as a fixed config.
            saved = json.loads(json.dumps(plan.to_json()))
            assert saved["variables"][0]["auto"]["choice"] in ("allreduce-as-dense", "ps")
            fixed, fixed_opt = _train(name, placement, saved, rank, size)
            assert _routes(fixed_opt.plan) == _routes(plan), (_routes(fixed_opt.plan), _routes(plan))
            assert all(v.auto is None for v in fixed_opt.plan.variables)
            _close(fixed, got, f"{name}/{placement} fixed config from the auto plan")
            print(f"rank {rank}: {name}/{placement}: auto switched and matches the {size * LOCAL_BATCH}-sample run",
                  flush=True)


def rank_trials_keep_the_measured_fastest(slow_route):
    """Trials on: after the PS phase auto runs each assignment worth trying for a few steps and
    keeps the fastest measured. One route is made artificially slow here (a sleep in its
    synchronize, on every rank): whatever the model predicted, that route loses; parity with one
    process holds through every switch."""
    import time

    import hybridsync.torch as hvd
    from hybridsync.sync.allgather import SparseAllgather
    from hybridsync.sync.dense import SparseAsDense
    from hybridsync.sync.ps_routes import ShardedPS

    slowed = {"allreduce-as-dense": SparseAsDense, "allgather": SparseAllgather, "ps": ShardedPS}[slow_route]
    original = slowed.synchronize

    def slow_synchronize(self):
        time.sleep(0.25)
        return original(self)

    slowed.synchronize = slow_synchronize
    rank, size = hvd.rank(), hvd.size()
    reference, _ = _train("sgd", None, None, rank, size, steps=20)
    config = {"auto_steps": 5, "auto_trial_steps": 4}
    try:
        got, opt = _train("sgd", "sharded", config, rank, size, steps=20)
    finally:  # the scenarios after this one in the same launch get the route as it is
        slowed.synchronize = original
    _close(got, reference, f"trials, {slow_route} slowed")
    hot = opt.plan.by_name()["hot.weight"]
    auto = hot.auto
    assert auto["status"] == "decided" and auto["choice"] != slow_route, auto
    assert hot.route.value == auto["choice"], (hot.route, auto)
    tried = auto["trials"]
    assert len(tried) >= 2 and tried[0]["routes"]["hot.weight"] == "ps", tried  # the PS phase first
    assert any(t["routes"]["hot.weight"] == slow_route for t in tried), ("the slowed route was not tried", tried)
    fastest = min(tried, key=lambda t: t["step_ms"])
    assert fastest["routes"]["hot.weight"] == auto["choice"], tried
    assert all(t["step_ms"] >= 250 for t in tried if t["routes"]["hot.weight"] == slow_route), tried
    assert "measured fastest" in auto["why"], auto
    text = render(opt.plan)
    line = next(x for x in text.splitlines() if x.strip().startswith("hot.weight: density"))
    assert "measured step: ps" in line and "memory/rank: ps" in line, line
    print(f"rank {rank}: {slow_route} slowed, auto kept {auto['choice']}", flush=True)


def _wide_model():
    """One large sparse table (100k x 16: 6.4 MB as a replica) of which a step touches a few
    thousand rows, and a small MLP."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wide = torch.nn.EmbeddingBag(WIDE_ROWS, 16, mode="mean", sparse=True)
            self.mlp = torch.nn.Linear(16, 1)

        def forward(self, ids):
            return self.mlp(self.wide(ids))

    torch.manual_seed(3)
    return Net()


WIDE_ROWS = 100_000


def _train_wide(config, rank, size, steps, wrap=True):
    import torch
    import torch.nn.functional as F

    import hybridsync.torch as hvd

    model = _wide_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if wrap:
        opt = hvd.DistributedOptimizer(opt, model=model, config=config)
    for step in range(steps):
        g = torch.Generator().manual_seed(900 + step)
        ids = torch.randint(0, WIDE_ROWS, (LOCAL_BATCH * size, 200), generator=g)
        y = torch.randn(LOCAL_BATCH * size, 1, generator=g)
        if wrap:
            part = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            ids, y = ids[part], y[part]
        opt.zero_grad()
        F.mse_loss(model(ids), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, opt


def rank_memory_budget():
    """memory_per_rank: with links that make a replica far faster (slow point-to-point messages),
    auto moves the wide table to a replica; with a budget the replica does not fit in, it keeps
    the table on the sharded parameter server -- the same numbers either way. A route fixed in
    the config over the budget is an error naming the variable and both sizes."""
    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    with _links(SLOW_P2P):
        _memory_budget(rank, size)
    print(f"rank {rank}: the budget kept the table on the sharded PS", flush=True)


@contextlib.contextmanager
def _links(links):
    """The job's cached links are `links` (rank 0 writes them where _env() wrote LINKS) until
    the block ends, then LINKS again, for the scenarios after it in the same launch."""
    import socket

    import hybridsync.torch as hvd
    from hybridsync.comm.probe import cache_path

    def write(what):
        if hvd.rank() == 0:
            with open(cache_path([socket.gethostname()] * hvd.size()), "w") as fh:
                json.dump(what, fh)
        hvd.barrier()  # every rank reads them after they are written

    write(links)
    try:
        yield
    finally:
        write(LINKS)


def _memory_budget(rank, size):
    from hybridsync.config import ConfigError

    reference, _ = _train_wide(None, rank, size, 8, wrap=False)
    free, opt = _train_wide({"auto_steps": 3, "auto_trial_steps": 0}, rank, size, 8)
    wide = opt.plan.by_name()["wide.weight"].auto
    assert wide["choice"] in ("allgather", "allreduce-as-dense"), wide  # the links make the PS slow
    _close(free, reference, "no budget")
    memory = wide["memory_bytes"]
    assert memory["ps"] < memory[wide["choice"]], memory
    budget = (memory["ps"] + min(memory["allgather"], memory["allreduce-as-dense"])) // 2
    for trials in (0, 3):
        got, opt = _train_wide({"auto_steps": 3, "auto_trial_steps": trials, "memory_per_rank": budget},
                               rank, size, 12)
        v = opt.plan.by_name()["wide.weight"]
        assert v.auto["choice"] == "ps" and v.route.value == "ps" and v.placement.value == "sharded", v.auto
        assert all(t["routes"]["wide.weight"] == "ps" for t in v.auto["trials"]), v.auto  # none over budget tried
        _close(got, _train_wide(None, rank, size, 12, wrap=False)[0], f"budget {budget}, trials {trials}")
    fixed = {"memory_per_rank": budget, "variables": [{"match": "wide.*", "sync": "allgather"}]}
    with pytest.raises(ConfigError) as err:
        _train_wide(fixed, rank, size, 1)
    message = str(err.value)
    assert "wide.weight" in message and "memory_per_rank" in message, message
    from hybridsync.planning.estimate import human_bytes
    assert human_bytes(budget) in message and human_bytes(memory["allgather"]).split()[0][:2] in message, message


def rank_real_probe():
    """The real link probe (cached per host set): the links are measured and cached, the step is
    the same everywhere, and parity holds whatever the tables' choices."""
    import hybridsync.torch as hvd
    from hybridsync.comm import probe

    rank, size = hvd.rank(), hvd.size()
    reference, _ = _train("adagrad", None, None, rank, size)
    got, opt = _train("adagrad", "replicated", CONFIG, rank, size)
    _close(got, reference, "adagrad/replicated auto, probed links")
    cold = opt.plan.by_name()["cold.weight"]
    # (which route wins depends on the links measured: on a loaded host the probe sees slow
    # messages; the route taken is the one decided, and a candidate)
    assert cold.auto["choice"] in cold.auto["candidates"] and cold.route.value == cold.auto["choice"], cold.auto
    links = cold.auto["links"]
    assert links["source"] == "probe" and links["p2p_latency_s"] > 0 and links["allreduce_bandwidth"] > 0, links
    # Facts of this start, not of the host set: every rank here is on one host.
    assert links["ranks_per_host"] == size and links["cpus_per_host"] == len(os.sched_getaffinity(0)) >= 1, links
    assert links["collective_s"] > 0, links
    files = os.listdir(os.environ["HYBRIDSYNC_CACHE_DIR"])
    assert len(files) == 1 and files[0].startswith("links-"), files
    # A second optimizer reads the cache instead of probing again.
    _, again = _train("adagrad", "replicated", CONFIG, rank, size, steps=1)
    assert again.plan.by_name()["cold.weight"].auto["links"]["source"] == "cache"


def rank_adam_stays_on_ps():
    """Adam on the PS is lazy (only rows with a gradient move): no other route applies that
    update, so auto keeps both tables on the PS and says why; parity with SparseAdam."""
    import torch
    import torch.nn.functional as F

    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    results = []
    for wrap in (False, True):
        model = _model()
        dense = [p for n, p in model.named_parameters() if n.startswith("mlp")]
        sparse = [p for n, p in model.named_parameters() if not n.startswith("mlp")]
        if wrap:
            opts = [hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model=model, config=CONFIG)]
        else:
            opts = [torch.optim.Adam(dense, lr=0.01), torch.optim.SparseAdam(sparse, lr=0.01)]
        for step in range(STEPS):
            hot, cold, x, y = _batch(step, size)
            if wrap:
                part = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
                hot, cold, x, y = hot[part], cold[part], x[part], y[part]
            for o in opts:
                o.zero_grad()
            F.mse_loss(model(hot, cold, x), y).backward()
            for o in opts:
                o.step()
        results.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    _close(results[1], results[0], "adam auto")
    plan = opts[0].plan
    for name in ("hot.weight", "cold.weight"):
        v = plan.by_name()[name]
        assert v.route.value == "ps" and v.auto["candidates"] == ["ps"], v.auto
        assert "only ps" in v.auto["why"], v.auto


def rank_auto_off():
    """HYBRIDSYNC_AUTO=off: sparse tables default to the PS, nothing is measured."""
    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    _, opt = _train("sgd", "sharded", None, rank, size, steps=AUTO_STEPS + 1)
    assert all(v.auto is None for v in opt.plan.variables)
    assert _routes(opt.plan)["hot.weight"][0] == "ps"


def rank_explain_prints_the_decision(show="env"):
    """Train past the switch; the test reads what was printed. show="explain": rank 0 calls
    hybridsync.explain() after the first step, while auto measures (as the examples do)."""
    import hybridsync
    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    model = _model()
    opt = hvd.DistributedOptimizer(_optimizer("sgd", model), model=model, config=CONFIG)
    _steps(model, opt, range(1), rank, size)
    if show == "explain" and rank == 0:
        hybridsync.explain()
    _steps(model, opt, range(1, AUTO_STEPS + 2), rank, size)


def _steps(model, opt, steps, rank, size):
    import torch.nn.functional as F

    for step in steps:
        hot, cold, dense, y = _batch(step, size)
        part = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        opt.zero_grad()
        F.mse_loss(model(hot[part], cold[part], dense[part]), y[part]).backward()
        opt.step()


def rank_auto_checkpoint(tmp, phase):
    """save: train past the switch (hot.weight leaves the PS) and save; load: a new run with the
    same code and config -- not the saved JSON plan -- loads it: auto takes the saved decisions
    instead of measuring, and the run continues as the saved one did."""
    import numpy as np
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    model = _model()
    opt = hvd.DistributedOptimizer(_optimizer("adagrad", model), model=model, config=CONFIG)
    state = lambda: {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}  # noqa: E731
    if phase == "save":
        _steps(model, opt, range(STEPS), rank, size)
        assert _routes(opt.plan)["hot.weight"][0] == "allreduce-as-dense", _routes(opt.plan)
        hybridsync.save_checkpoint(f"{tmp}/ckpt", model, opt)
        at_save = state()
        _steps(model, opt, range(STEPS, STEPS + 3), rank, size)
        final = state()  # collective: the PS tables are gathered
        if rank == 0:
            np.savez(f"{tmp}/at-save.npz", **at_save)
            np.savez(f"{tmp}/final.npz", **final)
        return
    hybridsync.load_checkpoint(f"{tmp}/ckpt", model, opt)
    routes = _routes(opt.plan)
    assert routes["hot.weight"] == ("allreduce-as-dense", "-", 0), routes
    assert routes["cold.weight"][:2] == ("ps", "sharded"), routes
    hot = opt.plan.by_name()["hot.weight"].auto
    assert hot["status"] == "decided" and hot["why"].startswith("from the checkpoint's plan"), hot
    want = np.load(f"{tmp}/at-save.npz")
    for key in want.files:
        np.testing.assert_allclose(state()[key], want[key], rtol=1e-6, atol=1e-7, err_msg=f"at load: {key}")
    _steps(model, opt, range(STEPS, STEPS + 3), rank, size)
    assert _routes(opt.plan) == routes  # nothing measured, nothing switched later
    if size == 2:  # the same batches as the saved run: the same numbers
        want = np.load(f"{tmp}/final.npz")
        for key in want.files:
            np.testing.assert_allclose(state()[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"continued: {key}")
    print(f"rank {rank}: auto's decisions adopted from the checkpoint at {size} ranks", flush=True)


def _env(links=True):
    """links: True for LINKS, a dict for other fixed links, False to probe."""
    tmp = tempfile.mkdtemp(prefix="hybridsync-cache-")
    if links:
        # Every host set reads these links: write the file under every name the job could hash to
        # (one host here), by asking the probe module for the name.
        import socket

        from hybridsync.comm.probe import cache_path

        for np_ in (1, 2, 3):
            with open(cache_path([socket.gethostname()] * np_, tmp), "w") as fh:
                json.dump(LINKS if links is True else links, fh)
    return {"HYBRIDSYNC_CACHE_DIR": tmp}


def _decision_rows(out: str) -> dict:
    """{variable: its row's cells} of the decision table, checked to come from rank 0 only and
    after the plan's `measuring` lines."""
    lines = out.splitlines()
    title = [i for i, line in enumerate(lines) if f"sync: auto decided at step {AUTO_STEPS}:" in line]
    assert len(title) == 1 and lines[title[0]].startswith("[1,0]<stdout>:"), out
    measuring = [i for i, line in enumerate(lines) if "hot.weight: measuring (4 steps on ps" in line]
    assert measuring and measuring[-1] < title[0], out
    rows = [line.split(":", 1)[1].split() for line in lines[title[0] + 1:title[0] + 5]]
    assert rows[0][:3] == ["variable", "route", "shards"], out
    return {cells[0]: cells for cells in rows[2:]}


def _check_decision_printed(out: str) -> None:
    rows = _decision_rows(out)
    assert set(rows) == {"hot.weight", "cold.weight"}, out
    hot, cold = rows["hot.weight"], rows["cold.weight"]
    assert hot[1:4] == ["allreduce-as-dense", "-", "99.38%"], hot  # route, shards, density
    assert cold[1] == "ps" and cold[2] in ("1", "2") and "ps" in cold[6:], cold
    assert "allreduce-as-dense predicted" in " ".join(hot), hot  # the why


def test_auto_decision_is_printed_where_the_plan_was_printed_at_wrap_time():
    """HYBRIDSYNC_EXPLAIN=1 (hybridsync-run) prints the plan at wrap time on rank 0; the
    decision follows, once, on rank 0."""
    out = run_ranks(__file__, "rank_explain_prints_the_decision", 2, "env", timeout=240,
                    env={**_env(), "HYBRIDSYNC_EXPLAIN": "1"})
    _check_decision_printed(out)


def test_auto_decision_is_printed_after_explain_and_not_where_no_plan_was():
    """HYBRIDSYNC_EXPLAIN=0: a run that printed no plan prints no decision; then (same launch)
    rank 0 calls explain() while auto measures, and the decision follows, once, on rank 0."""
    out = run_scenarios(__file__, 2, ("rank_explain_prints_the_decision", "quiet"),
                        ("rank_explain_prints_the_decision", "explain"),
                        timeout=240, env={**_env(), "HYBRIDSYNC_EXPLAIN": "0"})
    quiet = subcase_output(out, 1)
    assert "sync: auto decided" not in quiet and "measuring" not in quiet, out
    _check_decision_printed(subcase_output(out, 2))


SLOW_P2P = {**LINKS, "p2p_latency_s": 5e-3, "p2p_bandwidth": 1e6, "allreduce_latency_s": 1e-6,
            "allreduce_bandwidth": 10e9, "collective_s": 1e-6}


# Every scenario with the fixed links runs in one launch per world size (each launch starts
# ranks that import torch and TensorFlow: seconds each; the scenarios build their own models and
# optimizers, and a failure names its sub-case). The checkpoints saved at 2 ranks are loaded by
# new processes: at 2 ranks (launch 2) and at 3 (launch 3).
def _with_fixed_links(slow_route):
    return ["rank_keras_auto_parity", "rank_adam_stays_on_ps",
            ("rank_trials_keep_the_measured_fastest", slow_route), "rank_memory_budget",
            ("rank_auto_parity", "mpi"), ("rank_auto_parity", "horovod")]


def test_auto_at_two_and_three_ranks_and_checkpoints_saved_at_two_load_at_two_and_three(tmp_path):
    """Torch, both backends, at 2 and 3 ranks: auto moves the dense table to allreduce-as-dense
    and keeps parity (SGD, Adagrad, sharded and replicated), lazy Adam stays on the PS, trials
    keep the route measured fastest (allreduce-as-dense slowed at 2 ranks, ps at 3),
    memory_per_rank keeps a table that does not fit as a replica on the PS. Keras: the same
    switch with parity via fit and a tape. Checkpoints (torch, Keras) saved after the switch
    load without the saved plan: torch at 2 and 3 ranks, Keras at 2."""
    env, tmp = _env(), str(tmp_path)
    run_scenarios(__file__, 2, ("rank_keras_auto_checkpoint", tmp, "save"), ("rank_auto_checkpoint", tmp, "save"),
                  *_with_fixed_links("allreduce-as-dense"), timeout=600, env=env)
    run_scenarios(__file__, 2, ("rank_keras_auto_checkpoint", tmp, "load"), ("rank_auto_checkpoint", tmp, "load"),
                  timeout=400, env=env)
    run_scenarios(__file__, 3, ("rank_auto_checkpoint", tmp, "load"), *_with_fixed_links("ps"),
                  timeout=600, env=env)


def test_auto_with_the_real_link_probe():
    run_ranks(__file__, "rank_real_probe", 2, timeout=240, env=_env(links=False))


def test_auto_off():
    run_ranks(__file__, "rank_auto_off", 2, timeout=240, env={**_env(), "HYBRIDSYNC_AUTO": "off"})


# -- TensorFlow / Keras ------------------------------------------------------------------------------

def _keras_model():
    import keras

    keras.utils.set_random_seed(5)
    hot_ids = keras.Input(shape=(20,), dtype="int64", name="hot_ids")
    cold_ids = keras.Input(shape=(2,), dtype="int64", name="cold_ids")
    hot = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(DENSE_ROWS, DIM, name="hot")(hot_ids))
    cold = keras.layers.Flatten()(keras.layers.Embedding(SPARSE_ROWS, DIM, name="cold")(cold_ids))
    x = keras.layers.Dense(5, activation="tanh", name="hidden")(keras.layers.Concatenate()([hot, cold]))
    return keras.Model([hot_ids, cold_ids], keras.layers.Dense(1, name="out")(x))


def _keras_optimizer(name):
    import keras

    return keras.optimizers.SGD(0.3) if name == "sgd" else keras.optimizers.Adagrad(0.2)


def _keras_data(size):
    import numpy as np

    hot, cold, y = [], [], []
    for step in range(STEPS):
        h, c, _, t = (x.numpy() for x in _batch(step, size))
        hot.append(h), cold.append(c), y.append(t)
    return np.concatenate(hot), np.concatenate(cold), np.concatenate(y).astype("float32")


def _keras_reference(name, size):
    """One process, the whole batch, gradients densified (the exact math: see test_tf_parity)."""
    import tensorflow as tf

    model, opt = _keras_model(), _keras_optimizer(name)
    hot, cold, y = _keras_data(size)
    n = LOCAL_BATCH * size
    for s in range(STEPS):
        part = slice(s * n, (s + 1) * n)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([hot[part], cold[part]]) - y[part]))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights()


def _keras_mine(size, rank):
    import numpy as np

    hot, cold, y = _keras_data(size)
    n = LOCAL_BATCH * size
    pick = np.concatenate([np.arange(s * n + rank * LOCAL_BATCH, s * n + (rank + 1) * LOCAL_BATCH) for s in range(STEPS)])
    return hot[pick], cold[pick], y[pick]


def _keras_train(name, size, rank, how, config):
    import tensorflow as tf

    import hybridsync.tensorflow as hvd

    model = _keras_model()
    opt = hvd.DistributedOptimizer(_keras_optimizer(name), config=config)
    hot, cold, y = _keras_mine(size, rank)
    if how == "fit":
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        model.fit([hot, cold], y, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0)
    else:
        @tf.function(jit_compile=False)
        def step(h, c, t):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model([h, c]) - t))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

        for s in range(STEPS):
            part = slice(s * LOCAL_BATCH, (s + 1) * LOCAL_BATCH)
            step(hot[part], cold[part], y[part])
    return model, opt


def rank_keras_auto_parity():
    import numpy as np

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()
    for name in ("sgd", "adagrad"):
        want = _keras_reference(name, size)
        for how in ("fit", "tape"):
            model, opt = _keras_train(name, size, rank, how, CONFIG)
            for w, got, v in zip(want, model.get_weights(), model.trainable_variables):
                np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6, err_msg=f"keras {name}/{how} {v.path}")
            plan = opt.plan.by_name()
            hot, cold = plan["hot/embeddings"], plan["cold/embeddings"]
            assert (hot.route.value, cold.route.value) == ("allreduce-as-dense", "ps"), (hot, cold)
            assert hot.auto["switched_at_step"] == cold.auto["switched_at_step"] == AUTO_STEPS
            assert cold.auto["shards"] == 1 and cold.shards == 1 and cold.placement.value == "replicated", cold
            expected = {"ps", "allreduce-as-dense"} | ({"allgather"} if name == "sgd" else set())
            assert set(hot.auto["predicted_ms"]) == expected, hot.auto  # Keras Adagrad: no exact allgather
            if name == "adagrad":  # the server's sums became Keras's accumulator
                acc = opt._accumulators[opt._get_variable_index(model.get_layer("hot").embeddings)]
                assert float(np.min(acc.numpy())) > 0.1, "accumulator never took the server's sums"
            print(f"rank {rank}: keras {name} via {how}: auto switched and matches the one-process run", flush=True)
    # Keras's Adam decays every row's moments on a dense gradient: only the (lazy) PS is exact.
    import keras

    adam = hybridsync.DistributedOptimizer(keras.optimizers.Adam(0.01), config=CONFIG)
    m = _keras_model()
    m.compile(optimizer=adam, loss="mse", jit_compile=False)
    hot, cold, y = _keras_mine(size, rank)
    m.fit([hot, cold], y, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0)
    for v in adam.plan.variables:
        if v.name.endswith("embeddings"):
            assert v.route.value == "ps" and v.auto is None and "only ps" in v.reason, v


def rank_keras_auto_checkpoint(tmp, phase):
    """Keras: saved after auto moved `hot` off the PS; a new run (its plan built by one step of
    its own, as Keras needs) loads it without the JSON plan: the saved decisions are adopted and
    the weights and Adagrad accumulators are the saved ones."""
    import keras
    import numpy as np

    import hybridsync
    import hybridsync.tensorflow as hvd

    rank, size = hybridsync.rank(), hybridsync.size()

    def snapshot(model, opt):
        hot = model.get_layer("hot").embeddings
        return {**{f"w{i}": w for i, w in enumerate(model.get_weights())},
                "hot_accumulator": opt._accumulators[opt._get_variable_index(hot)].numpy()}

    if phase == "save":
        model, opt = _keras_train("adagrad", size, rank, "fit", CONFIG)
        assert opt.plan.by_name()["hot/embeddings"].route.value == "allreduce-as-dense"
        hybridsync.save_checkpoint(f"{tmp}/keras", model, opt)
        if rank == 0:
            np.savez(f"{tmp}/keras.npz", **snapshot(model, opt))
        return
    model = _keras_model()
    opt = hvd.DistributedOptimizer(_keras_optimizer("adagrad"), config=CONFIG)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    hot, cold, y = _keras_mine(size, rank)
    model.fit([hot[:LOCAL_BATCH], cold[:LOCAL_BATCH]], y[:LOCAL_BATCH], batch_size=LOCAL_BATCH, verbose=0)
    hybridsync.load_checkpoint(f"{tmp}/keras", model, opt)
    plan = opt.plan.by_name()
    assert plan["hot/embeddings"].route.value == "allreduce-as-dense", plan["hot/embeddings"]
    assert plan["cold/embeddings"].route.value == "ps", plan["cold/embeddings"]
    assert plan["hot/embeddings"].auto["why"].startswith("from the checkpoint's plan"), plan["hot/embeddings"].auto
    want, got = np.load(f"{tmp}/keras.npz"), snapshot(model, opt)
    for key in want.files:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)
    model.fit([hot, cold], y, batch_size=LOCAL_BATCH, epochs=1, shuffle=False, verbose=0)  # trains on
    assert opt.plan.by_name()["hot/embeddings"].route.value == "allreduce-as-dense"
    print(f"rank {rank}: keras auto decisions adopted from the checkpoint", flush=True)


if __name__ == "__main__":
    rank_main(globals())
