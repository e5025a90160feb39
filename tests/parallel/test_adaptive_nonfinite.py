"""A non-finite step does not end adaptation (issue 35, item 2), under real MPI ranks.

One rank's gradient turns inf at an early step -- a real one, from backward -- and the training
loop skips that step as a user would: with torch.amp.GradScaler (Horovod's idiom: synchronize,
unscale_, step inside skip_synchronize) or by hand. That step must be left out of the gradient
statistics on every rank, counted once, and shown by explain(); the noise scale stays finite,
the batch choice runs on finite numbers and AdaScale's factor follows the batch. (Before, the step's inf norms
entered the moving averages, which stayed NaN for good: no batch choice, LR factor 1.)
"""
import pytest

from tests.parallel.harness import rank_main, run_ranks

ROWS, DIM, FEATURES, N, INF_STEP = 12, 3, 5, 4096, 2


def _data():
    import torch

    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randint(0, ROWS, (N,), generator=g),
                                          torch.randn(N, FEATURES, generator=g),
                                          200.0 * torch.randn(N, generator=g))  # noise-dominated: the batch grows


def _loader(hvd):
    loader = hvd.AdaptiveDataLoader(_data(), batch_size=12, interval=4, warmup=4)
    loader.autoscale_batch_size(96, local_bsz_bounds=(2, 48))
    return loader


def _check(hvd, opt, loader, what):
    """Every rank left out exactly the one step, and adaptation went on after it."""
    import io
    import math

    import hybridsync

    stats = opt.gradient_stats()
    # Not NaN (what one inf norm in the averages made it for good). inf is a reading, not a
    # failure: this problem's noise scale is far above its batches, where |G|^2's average of the
    # newest step or two may dip below zero -- all noise, as far as can be told (docs/adaptive.md).
    assert not math.isnan(stats["noise_scale"]) and stats["noise_scale"] > 0, (what, stats)
    assert all(math.isfinite(v["sqr"]) and math.isfinite(v["var"]) for v in stats["by_variable"].values()), stats
    # Adaptation goes on on finite numbers: whether the batch grows depends on the step times
    # measured (a loaded machine may keep it), so what is checked is that every input of the
    # choice is finite, and that AdaScale follows whatever batch was chosen.
    summary = opt.adaptive.summary()
    assert math.isfinite(summary["efficiency"]) and math.isfinite(opt.adaptive.last_factor), (what, summary)
    if opt.adaptive.global_batch() > 12:
        assert opt.adaptive.last_factor > 1.0, (what, summary)
    assert stats["nonfinite_steps"] == 1, (what, stats)
    everyone = hvd.allgather_object((stats["nonfinite_steps"], loader.changes, stats["noise_scale"]))
    assert all(e == everyone[0] for e in everyone), (what, everyone)
    text = hybridsync.explain(file=io.StringIO())
    assert "non-finite steps left out of the statistics: 1 " in text, text


def _grad_scaler_run(hvd, rank, size):
    """Dense layers, torch.amp.GradScaler('cpu'): the scaler finds the inf in the all-reduced
    gradients on every rank and skips optimizer.step() there."""
    import torch

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-5),
                                   named_parameters=model.named_parameters(), adaptive={"scaling_rule": "adascale"})
    loader = _loader(hvd)
    scaler = torch.amp.GradScaler("cpu")
    skipped, batches = 0, 0
    for _ids, x, y in loader:
        if batches == INF_STEP and rank == size - 1:  # one rank's input overflows: inf in its gradients
            x = x.clone()
            x[0, 0] = float("inf")
        opt.zero_grad()
        loss = ((model(x).squeeze(1) - y) ** 2).mean()
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        before = opt.adaptive.steps
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        skipped += opt.adaptive.steps == before
        batches += 1
        if opt.adaptive.steps >= 24:
            break
    assert skipped == 1, skipped  # the scaler skipped the overflowed step, and only it
    assert all(torch.isfinite(p).all() for p in model.parameters())
    _check(hvd, opt, loader, "GradScaler")


def _skipped_by_hand_run(hvd, rank, size):
    """A PS table (sharded: its round's statistics come back a step late) beside a dense layer
    whose gradient turns inf on one rank; the loop skips the step when the all-reduced dense
    gradient is not finite. The table's round of that step is left out with it: one step counted."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
            self.lin = torch.nn.Linear(FEATURES, DIM)

        def forward(self, ids, x):
            return (self.emb(ids) + self.lin(x)).sum(1)

    torch.manual_seed(3)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-5), model=model,
                                   adaptive={"scaling_rule": "adascale"})
    inject = {"on": False}
    model.lin.weight.register_hook(lambda g: torch.full_like(g, float("inf")) if inject["on"] else g)
    loader = _loader(hvd)
    batches = 0
    for ids, x, y in loader:
        inject["on"] = batches == INF_STEP and rank == size - 1
        opt.zero_grad()
        ((model(ids, x) - y) ** 2).mean().backward()
        opt.synchronize()
        if all(torch.isfinite(p.grad).all() for p in model.lin.parameters()):
            with opt.skip_synchronize():
                opt.step()
        batches += 1
        if opt.adaptive.steps >= 24:
            break
    assert batches == opt.adaptive.steps + 1
    assert "emb.weight" in opt.gradient_stats()["by_variable"]
    _check(hvd, opt, loader, "by hand, with a PS table")


def rank_nonfinite():
    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    _grad_scaler_run(hvd, rank, size)
    _skipped_by_hand_run(hvd, rank, size)


@pytest.mark.parametrize("np_", [2, 3])
def test_a_skipped_non_finite_step_is_left_out_of_the_statistics_on_every_rank(np_):
    run_ranks(__file__, "rank_nonfinite", np_, timeout=240)


if __name__ == "__main__":
    rank_main(globals())
