"""The adaptive batch's decisions are the same on every rank, at 2 and 3 ranks.

Each rank's steps take a different time (the last rank is the slow one, and its time grows with
the batch, so there is an optimum to find) and each rank reads different samples, so their
gradients differ. The steps are timed by a clock each rank advances by its own cost
(step_clock.py), so the decisions are the same on a loaded machine as on an idle one. The decision state -- the batch, every decision with its kind, gain and
threshold, and the hysteresis it leaves (sizes barred, direction, a probe under way) -- must
still be identical everywhere: every rank proposes from the gathered statistics and step times,
and the exchange makes the lowest stepping rank's proposal everyone's.
"""
import pytest

from tests.parallel.harness import rank_main, run_ranks

FEATURES, DATA = 6, 1 << 15


def rank_decisions():
    import torch

    import hybridsync.torch as hvd
    from tests.parallel.step_clock import StepClock

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(DATA, FEATURES, generator=g)
    y = x @ torch.arange(1.0, FEATURES + 1) + 30.0 * torch.randn(DATA, generator=g)  # noisy: big batches pay
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4), model=model,
                                   adaptive={"min_gain": 1.02})
    loader = hvd.AdaptiveDataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8 * size, interval=4, warmup=4)
    loader.autoscale_batch_size(1024 * size, local_bsz_bounds=(4, 1024))
    clock = StepClock.install()
    history = []
    for xb, yb in loader:
        opt.zero_grad()
        ((model(xb).squeeze(1) - yb) ** 2).mean().backward()
        # the slow rank: 3 ms per step plus 10 us per sample; the others 1 ms plus 1 us per sample
        clock.spend(0.003 + 1e-5 * len(xb) if rank == size - 1 else 0.001 + 1e-6 * len(xb))
        opt.step()
        history.append(opt.adaptive.sizes())
        if opt.adaptive.steps >= 60:
            break
    decider = opt.adaptive.decider
    state = {"history": history, "changes": loader.changes, "log": decider.log, "floor": decider.floor,
             "ceiling": decider.ceiling, "direction": decider.direction, "probe": decider.probe,
             "last_change_step": decider.last_change_step, "choice": opt.adaptive.choice}
    everyone = hvd.allgather_object(state)
    for key in state:
        assert all(s[key] == everyone[0][key] for s in everyone), (key, [s[key] for s in everyone])
    assert len(decider.log) >= 2 and opt.adaptive.global_batch() > 8 * size, (decider.log, loader.changes)
    print(f"rank {rank} np {size}: decisions {[(e['kind'], e['from'], e['to']) for e in decider.log]}", flush=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_every_rank_takes_the_same_decisions(np_):
    run_ranks(__file__, "rank_decisions", np_, timeout=240)


if __name__ == "__main__":
    rank_main(globals())
