"""hybridsync.adaptive under real MPI ranks.

- The gradient statistics of a dense layer and of a PS table (both placements) against the
  truth, computed here from every sample's own gradient: with the learning rate at zero the
  model stays put, so |G|^2 and tr(Sigma) of the sampling distribution are fixed and known.
- Adaptation off (statistics only) trains bit-identically to plain training; the linear rule at
  twice the base batch trains bit-identically to plain training at twice the learning rate --
  the dense update and the server rule on the shards alike.
"""
import pytest

from tests.parallel.harness import rank_main, run_ranks, run_scenarios
from tests.parallel.step_clock import StepClock

ROWS, DIM, FEATURES, DATA = 12, 3, 5, 96
# What a (micro-)step costs on the step clock of the loader scenarios (step_clock.py): a fixed
# cost that a bigger batch shares, so the batch grows at the same steps on any machine.
STEP_COST_S, SAMPLE_COST_S = 0.01, 1e-5


def _model():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
            self.lin = torch.nn.Linear(FEATURES, DIM)

        def forward(self, ids, x):
            return (self.emb(ids) * self.lin(x)).sum(1)

    torch.manual_seed(3)
    return Net()


def _data():
    import torch

    g = torch.Generator().manual_seed(11)
    ids = (torch.rand(DATA, generator=g) ** 2 * ROWS).long()  # skewed: some rows hot
    x = torch.randn(DATA, FEATURES, generator=g)
    y = 2.0 + torch.randn(DATA, generator=g)  # an offset the untrained model misses: |G| > 0
    return ids, x, y


def _truth():
    """Per variable: (|G|^2, tr(Sigma)) over the data set, from each sample's own gradient."""
    import torch

    model, (ids, x, y) = _model(), _data()
    grads = {n: [] for n, _ in model.named_parameters()}
    for i in range(DATA):
        model.zero_grad()
        ((model(ids[i:i + 1], x[i:i + 1]) - y[i:i + 1]) ** 2).mean().backward()
        for n, p in model.named_parameters():
            grads[n].append(p.grad.to_dense().flatten().clone())
    out = {}
    for n, gs in grads.items():
        g = torch.stack(gs).double()
        mean = g.mean(0)
        out[n] = (float(mean @ mean), float(((g - mean) ** 2).sum(1).mean()))
    return out


def _estimated(placement, rank, size, batch, steps, accumulation=1):
    import torch

    import hybridsync.torch as hvd

    model, (ids, x, y) = _model(), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the model stays put: fixed |G| and Sigma
    cfg = {"local_batch_size": batch, "smoothing": 0.98}
    if placement == "sharded":
        opt = hvd.DistributedOptimizer(opt, model=model, adaptive=cfg)
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), adaptive=cfg)
    opt._hs_adaptive.set_batch(batch, accumulation)  # what an AdaptiveDataLoader does
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own i.i.d. draws, with replacement
    for _ in range(steps * accumulation):
        pick = torch.randint(0, DATA, (batch,), generator=g)
        opt.zero_grad()  # (kept between an accumulation's micro-steps)
        ((model(ids[pick], x[pick]) - y[pick]) ** 2).mean().backward()
        opt.step()
    return opt.gradient_stats()


def rank_noise_scale(accumulation="1"):
    """At np 1 the statistics come from `accumulation` micro-steps per step instead of ranks."""
    import hybridsync.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    accumulation = int(accumulation)
    truth = _truth()
    dense_sqr = truth["lin.weight"][0] + truth["lin.bias"][0]
    dense_var = truth["lin.weight"][1] + truth["lin.bias"][1]
    for placement in ("sharded", "replicated"):
        stats = _estimated(placement, rank, size, batch=8, steps=300, accumulation=accumulation)
        per = stats["by_variable"]
        assert set(per) == {"emb.weight", "lin.weight", "lin.bias"}, per
        got = {"dense": (per["lin.weight"]["sqr"] + per["lin.bias"]["sqr"],
                         per["lin.weight"]["var"] + per["lin.bias"]["var"]),
               "table": (per["emb.weight"]["sqr"], per["emb.weight"]["var"])}
        want = {"dense": (dense_sqr, dense_var), "table": truth["emb.weight"]}
        for what in ("dense", "table"):
            for k, label in enumerate(("|G|^2", "tr(Sigma)")):
                err = abs(got[what][k] - want[what][k]) / want[what][k]
                print(f"rank {rank} np {size} x{accumulation} {placement} {what} {label}: estimated {got[what][k]:.4g}, "
                      f"true {want[what][k]:.4g} ({err:.1%})", flush=True)
                assert err < 0.2, (placement, what, label, got[what][k], want[what][k])
        total_sqr = sum(v[0] for v in truth.values())
        total_var = sum(v[1] for v in truth.values())
        assert stats["noise_scale"] == pytest.approx(total_var / total_sqr, rel=0.35)


def _train(adaptive, lr, local_batch, rank, size, steps=6):
    import torch

    import hybridsync.torch as hvd

    model, (ids, x, y) = _model(), _data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model=model, adaptive=adaptive)
    if adaptive is not None:
        opt.adaptive.base_batch = 4 * size  # the LR was written for 4 samples per rank
    for step in range(steps):
        start = (step * size + rank) * local_batch % (DATA - local_batch)
        part = slice(start, start + local_batch)
        opt.zero_grad()
        ((model(ids[part], x[part]) - y[part]) ** 2).mean().backward()
        opt.step()
    rows = model.emb.table.read()
    return torch.from_numpy(rows.copy()), model.lin.weight.detach().clone(), opt


def rank_rules_reach_both_paths():
    import torch

    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    plain = _train(None, 0.05, 4, rank, size)
    off = _train({"scaling_rule": None, "local_batch_size": 4}, 0.05, 4, rank, size)
    for a, b in zip(plain[:2], off[:2]):
        assert torch.equal(a, b), "statistics alone changed the training"
    assert off[2].gradient_stats()["by_variable"]  # while they were being gathered
    # Twice the base batch under the linear rule = plain training at twice the learning rate.
    doubled = _train(None, 0.05 * 2.0, 8, rank, size)
    linear = _train({"scaling_rule": "linear", "local_batch_size": 8}, 0.05, 8, rank, size)
    for a, b in zip(doubled[:2], linear[:2]):
        assert torch.equal(a, b), "the linear rule's LR did not reach both the dense update and the shards"
    assert linear[2].adaptive.last_factor == 2.0 and linear[2].progress > 0
    assert linear[2].param_groups[0]["lr"] == 0.05  # the schedule still sees the base LR


def rank_accumulation_is_the_mean():
    """Two micro-steps of 4 under the adaptive batch = one step of 8 (same LR: the mean)."""
    import torch

    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    whole = _train(None, 0.05, 8, rank, size)
    for config in (None, {"variables": [{"match": "emb*", "sync": "allgather"}]}):
        model, (ids, x, y) = _model(), _data()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model, config=config,
                                       adaptive={"scaling_rule": None, "local_batch_size": 8})
        opt._hs_adaptive.set_batch(4, 2)
        for step in range(6):
            start = (step * size + rank) * 8 % (DATA - 8)
            for micro in range(2):
                part = slice(start + 4 * micro, start + 4 * micro + 4)
                opt.zero_grad()  # a no-op between micro-steps
                ((model(ids[part], x[part]) - y[part]) ** 2).mean().backward()
                opt.step()
        assert opt.adaptive.steps == 6
        rows = model.emb.weight.detach() if config else torch.from_numpy(model.emb.table.read().copy())
        torch.testing.assert_close(rows, whole[0], rtol=1e-5, atol=1e-6, msg=lambda m: f"{config}: {m}")
        torch.testing.assert_close(model.lin.weight.detach(), whole[1], rtol=1e-5, atol=1e-6)


def rank_efficiency_model_is_everyones():
    """The efficiency model, fixed when the optimizer is wrapped: the square root for Adagrad
    (its tables on the PS's adagrad rule) at its unscaled LR, the goodput formula for SGD and for
    Adagrad under a scaling rule -- the same on every rank, and named by explain()."""
    import io
    import json

    import torch

    import hybridsync
    import hybridsync.torch as hvd

    models = {}
    for name, make, cfg in (("adagrad", torch.optim.Adagrad, {"local_batch_size": 4}),
                            ("adagrad-sqrt", torch.optim.Adagrad, {"local_batch_size": 4, "scaling_rule": "sqrt"}),
                            ("sgd", torch.optim.SGD, {"local_batch_size": 4})):
        model = _model()
        opt = hvd.DistributedOptimizer(make(model.parameters(), lr=0.05), model=model, adaptive=cfg)
        models[name] = (opt.adaptive.efficiency_model, opt.adaptive.efficiency_reason)
        plans = json.loads(hybridsync.explain(file=io.StringIO(), as_json=True))  # (one per optimizer)
        shown = [(p["adaptive"]["efficiency_model"], p["adaptive"]["efficiency_reason"]) for p in plans if "adaptive" in p]
        assert models[name] in shown, (models[name], shown)
    assert {k: m for k, (m, _) in models.items()} == {"adagrad": "sqrt", "adagrad-sqrt": "goodput", "sgd": "goodput"}
    everyone = hvd.allgather_object(models)
    assert all(e == everyone[0] for e in everyone), everyone


def rank_stats_and_rules():
    rank_noise_scale()
    rank_rules_reach_both_paths()
    rank_accumulation_is_the_mean()
    rank_efficiency_model_is_everyones()


def _noisy_data():
    """4,096 samples whose labels are noise far above the signal: a big batch is nearly free of
    statistical cost, so the adaptive batch grows."""
    import torch

    g = torch.Generator().manual_seed(5)
    n = 4096
    return torch.utils.data.TensorDataset(torch.randint(0, ROWS, (n,), generator=g), torch.randn(n, FEATURES, generator=g),
                                          200.0 * torch.randn(n, generator=g))


def rank_loader(mode, path):
    """AdaptiveDataLoader on noise-dominated data (a big batch is nearly free of statistical
    cost): the batch grows past the base, by accumulation beyond local_bsz_bounds, the same on
    every rank; saved with a checkpoint ('save'), and restored at another world size ('load')."""
    import io

    import torch

    import hybridsync
    import hybridsync.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = _model()
    data = _noisy_data()
    # (a short `sync: auto` phase: the batch is decided only once the routes have settled)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-5), model=model, adaptive=True,
                                   config={"auto_steps": 4, "auto_trial_steps": 3})
    loader = hvd.AdaptiveDataLoader(data, batch_size=12, interval=4, warmup=4)
    loader.autoscale_batch_size(96, local_bsz_bounds=(2, 12), gradient_accumulation=True)
    if mode == "load":
        hybridsync.load_checkpoint(path, model, opt)
        kept = abs(opt.adaptive.global_batch() - int(open(f"{path}.batch").read()))
        assert kept <= size * opt.adaptive.accumulation, ("the global batch was not kept", opt.adaptive.sizes())
        assert opt.progress == pytest.approx(float(open(f"{path}.progress").read()))
        assert opt.adaptive.world == size
    history, first_step = [], opt.adaptive.steps
    clock = StepClock.install()
    for ids, x, y in loader:
        opt.zero_grad()
        ((model(ids, x) - y) ** 2).mean().backward()
        clock.spend(STEP_COST_S + SAMPLE_COST_S * len(x))
        opt.step()
        history.append(opt.adaptive.sizes())
        if opt.adaptive.steps - first_step >= 24:  # steps, not micro-steps: re-chosen at least twice
            break
    everyone = hvd.allgather_object(history)
    assert all(h == everyone[0] for h in everyone), "ranks disagree on the batch size"
    local, accumulation = opt.adaptive.sizes()
    assert 2 <= local <= 12 and opt.adaptive.global_batch() <= 96, (history, loader.changes, opt.adaptive.choice)
    assert opt.adaptive.global_batch() > 12, (loader.changes, opt.adaptive.summary())
    if mode == "load":  # chosen again from this world size's own step times
        assert opt.adaptive.choice is not None and opt.adaptive.choice.world == size, opt.adaptive.choice
    text = io.StringIO()
    hybridsync.explain(file=text)
    assert "noise scale" in text.getvalue() and f"batch {opt.adaptive.global_batch()}" in text.getvalue()
    if mode == "save":
        hybridsync.save_checkpoint(path, model, opt)
        if rank == 0:
            open(f"{path}.batch", "w").write(str(opt.adaptive.global_batch()))
            open(f"{path}.progress", "w").write(repr(opt.progress))
    print(f"rank {rank} np {size} {mode}: batch changes {loader.changes}", flush=True)


def rank_resume_at_one(path):
    """The 2-rank checkpoint resumed at 1 rank. Without accumulation allowed nothing measures the
    noise any more: the restored statistics stay frozen, and the batch is kept (docs/adaptive.md)
    instead of growing on them. With accumulation allowed, micro-steps measure and choose."""
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    hvd.init()
    g = torch.Generator().manual_seed(5)
    n = 4096
    data = torch.utils.data.TensorDataset(torch.randint(0, ROWS, (n,), generator=g), torch.randn(n, FEATURES, generator=g),
                                          200.0 * torch.randn(n, generator=g))
    for accumulate in (False, True):
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-5), model=model, adaptive=True)
        loader = hvd.AdaptiveDataLoader(data, batch_size=12, interval=4, warmup=4)
        loader.autoscale_batch_size(384, local_bsz_bounds=(2, 384), gradient_accumulation=accumulate)
        hybridsync.load_checkpoint(path, model, opt)
        restored, first_step, history = opt.adaptive.stats.observations, opt.adaptive.steps, []
        clock = StepClock.install()
        for ids, x, y in loader:
            opt.zero_grad()
            ((model(ids, x) - y) ** 2).mean().backward()
            clock.spend(STEP_COST_S + SAMPLE_COST_S * len(x))
            opt.step()
            if opt.adaptive.partial_step_of is None:  # (an epoch's remainder is one smaller step of its own)
                history.append(opt.adaptive.sizes())
            if opt.adaptive.steps - first_step >= 16:  # re-chosen at least 3 times
                break
        measured = opt.adaptive.stats.observations - restored
        if not accumulate:
            assert measured == 0 and loader.changes == [], (measured, loader.changes, opt.adaptive.choice)
            assert set(history) == {history[0]}, history
        else:  # micro-steps measure, and their statistics choose
            assert measured > 0 and opt.adaptive.measured_here() and loader.changes, (measured, loader.changes)
            assert all(k >= 2 for _, k in history), history
        print(f"np 1 resumed, accumulation {accumulate}: batch changes {loader.changes}, {measured} steps measured",
              flush=True)


def rank_batch_waits_for_the_routes():
    """`sync: auto` and the adaptive batch together: while auto measures and tries routes, the
    batch is not decided (a batch changed mid-trial would make auto compare batch sizes, not
    routes) and no step is timed for the throughput model (a trial's step is another route's);
    once the routes settle, the batch grows from step times of the final routes only."""
    import io
    import json

    import torch

    import hybridsync
    import hybridsync.torch as hvd

    hvd.init()
    size = hvd.size()
    model = _model()
    data = _noisy_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-5), model=model, adaptive=True,
                                   config={"auto_steps": 6, "auto_trial_steps": 3})
    loader = hvd.AdaptiveDataLoader(data, batch_size=12, interval=2, warmup=2)
    loader.autoscale_batch_size(96, local_bsz_bounds=(2, 12), gradient_accumulation=True)
    history = []
    clock = StepClock.install()
    for ids, x, y in loader:
        opt.zero_grad()
        ((model(ids, x) - y) ** 2).mean().backward()
        clock.spend(STEP_COST_S + SAMPLE_COST_S * len(x))
        opt.step()
        history.append(opt.adaptive.sizes())
        if opt.adaptive.steps >= 40:
            break
    plans = json.loads(hybridsync.explain(file=io.StringIO(), as_json=True))  # (one per optimizer: this one last)
    auto = next(v["auto"] for v in plans[-1]["variables"] if v["name"] == "emb.weight")
    settled_at = auto["switched_at_step"]
    judged = [j["step"] for j in opt.adaptive.decider.judgements]
    assert judged and min(judged) > settled_at, (settled_at, judged, auto.get("trials"))
    assert all(step > settled_at for step, _, _ in loader.changes), (settled_at, loader.changes)
    timed = len(opt.adaptive.throughput.state_dict()["samples"].get(str(size), []))  # steps timed, every size
    assert 0 < timed <= opt.adaptive.steps - settled_at - 1, (timed, opt.adaptive.steps, settled_at)
    assert opt.adaptive.global_batch() > 12, (loader.changes, opt.adaptive.summary())
    everyone = hvd.allgather_object((history, judged))
    assert all(e == everyone[0] for e in everyone), "ranks disagree on the batch size or when it was judged"
    print(f"np {size}: routes settled at step {settled_at}, first judged at {min(judged)}, "
          f"changes {loader.changes}", flush=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_noise_scale_rules_and_accumulation_and_the_batch_decided_only_once_sync_auto_has_settled(np_):
    """The statistics of a dense layer and a PS table within 20% of the truth; adaptation off is
    bit-identical to plain training; the linear rule reaches the shards; accumulation averages.
    Then, in the same launch: no batch judged and no step timed while `sync: auto` measures and
    tries routes; the batch grows afterwards, the same on every rank
    (rank_batch_waits_for_the_routes)."""
    run_scenarios(__file__, np_, "rank_stats_and_rules", "rank_batch_waits_for_the_routes", timeout=500)


def test_single_rank_statistics_from_accumulation_micro_steps():
    """One rank, 3 micro-steps per step: each micro-step's gradient against their mean gives the
    statistics (dense layer and PS table, both placements) within 20% of the truth."""
    run_ranks(__file__, "rank_noise_scale", 1, "3", timeout=300)


def test_loader_chooses_the_same_batch_everywhere_and_restarts_at_another_size(tmp_path):
    """Saved at 2 ranks; resumed at 3 (chosen again from its own step times) and at 1, where
    frozen statistics choose nothing (rank_resume_at_one)."""
    import json

    path, trace = str(tmp_path / "ckpt"), tmp_path / "trace.json"
    run_ranks(__file__, "rank_loader", 2, "save", path, timeout=240, env={"HYBRIDSYNC_TIMELINE": str(trace)})
    run_ranks(__file__, "rank_loader", 3, "load", path, timeout=240)
    run_ranks(__file__, "rank_resume_at_one", 1, path, timeout=240)
    counters = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "adaptive"]
    for rank in (0, 1):  # one per step (a rank's last buffered events may miss the merge)
        assert len([e for e in counters if e["pid"] == rank]) >= 20, (rank, len(counters))
    assert {"noise_scale", "global_batch", "gain", "lr_factor"} <= set(counters[-1]["args"])
    assert max(e["args"]["global_batch"] for e in counters) > 12


if __name__ == "__main__":
    rank_main(globals())
