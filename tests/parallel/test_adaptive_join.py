"""The adaptive batch with uneven data ending in hvd.join(), under both dense backends.

A rank that ran out of data and joined takes part in the others' per-step statistics exchange
as it does in their all-reduces: it contributes nothing. The statistics then come only from the
ranks that stepped (the estimate stays right, not diluted by the joined rank's zeros), every
rank that stepped reaches the same statistics and the same batch choice, and once every rank
has joined they train on together.
"""
import pytest

from tests.parallel.harness import rank_main, run_ranks

FEATURES, DATA = 6, 4096


def _data():
    import torch

    g = torch.Generator().manual_seed(7)
    x = torch.randn(DATA, FEATURES, generator=g)
    y = x @ torch.arange(1.0, FEATURES + 1) + 3.0 * torch.randn(DATA, generator=g)
    return x, y


def _truth(model, x, y) -> float:
    """The noise scale tr(Sigma) / |G|^2 over the whole data set, from each sample's gradient."""
    import torch

    grads = []
    for i in range(0, DATA, 8):  # every 8th sample: enough for a 35% check
        model.zero_grad()
        ((model(x[i:i + 1]).squeeze(1) - y[i:i + 1]) ** 2).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    g = torch.stack(grads)
    mean = g.mean(0)
    return float(((g - mean) ** 2).sum(1).mean() / (mean @ mean))


def _agree(hvd, value, what):
    """Every rank holds the same `value` (compared after join, where any collective is allowed)."""
    everyone = hvd.allgather_object(value)
    assert all(v == everyone[0] for v in everyone), (what, everyone)


def _uneven_steps_then_join(hvd, rank, size):
    """Rank 0 runs out of data first; at -np 3 the other two go on stepping with it joined."""
    import math

    import torch

    x, y = _data()
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    truth = _truth(model, x, y)
    batch = 16
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),  # fixed |G| and Sigma
                                   named_parameters=model.named_parameters(),
                                   adaptive={"local_batch_size": batch, "smoothing": 0.95})
    g = torch.Generator().manual_seed(100 + rank)
    steps = 3 if rank == 0 else 160  # uneven data: rank 0 has 3 batches, the others 160
    seen = []
    for _ in range(steps):
        pick = torch.randint(0, DATA, (batch,), generator=g)
        opt.zero_grad()
        ((model(x[pick]).squeeze(1) - y[pick]) ** 2).mean().backward()
        opt.step()
        seen.append(opt.gradient_stats()["noise_scale"])
    last = hvd.join()
    assert last == (size - 1 if size > 2 else 1), last
    noise = opt.gradient_stats()["noise_scale"]
    # Every rank that stepped saw the same statistics, step by step.
    stepped = [r for r in range(size) if r != 0]
    everyone = hvd.allgather_object(seen)
    assert all(everyone[r] == everyone[stepped[0]] for r in stepped), "ranks that stepped disagree"
    assert everyone[0] == everyone[stepped[0]][:3], "the first steps, taken by every rank, differ"
    if size > 2:  # two ranks stepped on: their statistics follow the truth, not diluted by zeros
        print(f"rank {rank} np {size}: noise scale {noise:.4g}, true {truth:.4g}", flush=True)
        if rank != 0:
            assert noise == pytest.approx(truth, rel=0.35), (noise, truth)
    else:  # one rank stepped on alone: one gradient says nothing about the noise (kept as it was)
        if rank != 0:
            assert all(v == seen[2] or (math.isnan(v) and math.isnan(seen[2])) for v in seen[3:]), seen[:6]
    # Training goes on together after the join.
    opt.zero_grad()
    ((model(x[:batch]).squeeze(1) - y[:batch]) ** 2).mean().backward()
    opt.step()
    _agree(hvd, [p.detach().tolist() for p in model.parameters()], "parameters")


def _loader_rechooses_while_a_rank_joined(hvd, rank, size):
    """An AdaptiveDataLoader whose batch is re-chosen every 4 steps; rank 0 leaves its loop
    after 6 steps and joins while the others go on: they still re-choose, all alike. Steps are
    timed by a clock the loop advances (step_clock.py): a step costs 10 ms plus 10 us per sample,
    so a bigger batch pays and the batch grows after the join on any machine, loaded or not."""
    import torch

    from tests.parallel.step_clock import StepClock

    x, y = _data()
    y = y + 100.0 * torch.randn(DATA, generator=torch.Generator().manual_seed(3))  # noise-dominated: grows
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6),
                                   named_parameters=model.named_parameters(), adaptive=True)
    loader = hvd.AdaptiveDataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8 * size, interval=4, warmup=4,
                                    optimizer=opt)
    loader.autoscale_batch_size(64 * size, local_bsz_bounds=(4, 64))
    clock = StepClock.install()
    history = []
    for xb, yb in loader:
        opt.zero_grad()
        ((model(xb).squeeze(1) - yb) ** 2).mean().backward()
        clock.spend(0.01 + 1e-5 * len(xb))
        opt.step()
        history.append(opt.adaptive.sizes())
        if len(history) == (6 if rank == 0 else 30):
            break
    hvd.join()
    everyone = hvd.allgather_object(history)
    assert all(everyone[r] == everyone[1] for r in range(1, size)), everyone
    assert everyone[0] == everyone[1][:6], everyone
    changes = hvd.allgather_object(loader.changes)
    assert all(changes[r] == changes[1] for r in range(1, size)), changes
    judged = hvd.allgather_object([j["step"] for j in opt.adaptive.decider.judgements])
    assert all(judged[r] == judged[1] for r in range(1, size)), judged
    assert any(step > 6 for step in judged[1]), ("no re-choice after rank 0 joined", judged, changes)
    assert any(step > 6 for step, _, _ in changes[1]), ("the batch did not change after rank 0 joined", changes)
    print(f"rank {rank} np {size}: batch changes {loader.changes}", flush=True)


def rank_adaptive_join():
    import torch

    import hybridsync.torch as hvd

    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    _uneven_steps_then_join(hvd, rank, size)
    _loader_rechooses_while_a_rank_joined(hvd, rank, size)


@pytest.mark.parametrize("backend", ["mpi", "horovod"])
@pytest.mark.parametrize("np_", [2, 3])
def test_adaptive_statistics_and_loader_with_uneven_data_and_join(np_, backend):
    out = run_ranks(__file__, "rank_adaptive_join", np_, timeout=180, env={"HYBRIDSYNC_BACKEND": backend})
    assert out.count("batch changes") == np_, out


if __name__ == "__main__":
    rank_main(globals())
