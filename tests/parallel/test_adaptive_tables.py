"""The adaptive batch's per-table row counts under real MPI ranks, at 2 and 3 ranks.

A model with two sharded PS tables -- one of 200,000 rows hit uniformly (a batch hits each
row about once: its row updates average nothing more at a bigger batch) and one of 4 rows
(every batch hits every row) -- and a dense layer, trained with Adam (the square-root rule) by
an AdaptiveDataLoader whose batch grows (the last rank is slow, so there is an optimum; each
rank's steps are timed on a clock it advances by its own cost, step_clock.py, so the batch grows
at the same steps on a loaded machine as on an idle one). Each
rank reads its own samples, and its shards report their own rounds. Every rank must model the
same row counts, give each table the same learning-rate factor, log the same decisions with the
same per-table numbers; and the learning rate each push carries is the table's own factor times
the base LR: ~1 for the rare table, the dense factor sqrt(batch / base) for the hot one.
"""
import pytest

from tests.parallel.harness import rank_main, run_ranks

RARE, HOT, DIM, FEATURES, DATA, LR = 200_000, 4, 4, 6, 1 << 17, 1e-3


def rank_tables():
    import math

    import torch

    import hybridsync.sync.ps_routes as ps_routes
    import hybridsync.torch as hvd
    from tests.parallel.step_clock import StepClock

    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rare = torch.nn.Embedding(RARE, DIM, sparse=True)
            self.hot = torch.nn.Embedding(HOT, DIM, sparse=True)
            self.lin = torch.nn.Linear(FEATURES, DIM)

        def forward(self, rare, hot, x):
            return ((self.rare(rare) + self.hot(hot)) * self.lin(x)).sum(1)

    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(3)
    rare = torch.randint(0, RARE, (DATA,), generator=g)
    hot = torch.randint(0, HOT, (DATA,), generator=g)
    x = torch.randn(DATA, FEATURES, generator=g)
    y = x @ torch.arange(1.0, FEATURES + 1) + 30.0 * torch.randn(DATA, generator=g)  # noisy: big batches pay
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR), model=model,
                                   adaptive={"min_gain": 1.02})
    short = lambda name: "rare" if name.startswith("rare") else "hot"  # noqa: E731  (variable or table name)

    pushed = []  # each push's learning rate per table, as the route hands them to the shards
    real_push = ps_routes.push

    def recording_push(tables, ids, grads, scale, lrs, return_updates):
        pushed.append({short(t.name): lr for t, lr in zip(tables, lrs)})
        return real_push(tables, ids, grads, scale, lrs, return_updates)

    ps_routes.push = recording_push
    loader = hvd.AdaptiveDataLoader(torch.utils.data.TensorDataset(rare, hot, x, y), batch_size=8 * size,
                                    interval=4, warmup=4)
    loader.autoscale_batch_size(512 * size, local_bsz_bounds=(4, 512))
    adaptive = opt.adaptive
    factors, checked = [], 0
    clock = StepClock.install()
    for r, h, xb, yb in loader:
        opt.zero_grad()
        ((model(r, h, xb) - yb) ** 2).mean().backward()
        # the slow rank: 3 ms per step plus 10 us per sample; the others 1 ms plus 1 us per sample
        clock.spend(0.003 + 1e-5 * len(xb) if rank == size - 1 else 0.001 + 1e-6 * len(xb))
        opt.step()
        step_factors = {short(n): f for n, f in opt._hs_sync.ctx.table_lr_factors.items()}  # this step's
        factors.append((adaptive.global_batch(), adaptive.last_factor, step_factors))
        if step_factors:  # the push carried each table's own factor times the base LR
            assert pushed[-1] == pytest.approx({k: LR * f for k, f in step_factors.items()}, rel=1e-6), \
                (pushed[-1], step_factors)
            checked += 1
        if adaptive.steps >= 50:
            break
    ps_routes.push = real_push
    tables = {short(n): t for n, t in adaptive.summary()["tables"].items()}
    decider = adaptive.decider
    state = {"rows": adaptive.rows.state_dict(), "factors": factors, "log": decider.log,
             "changes": loader.changes, "duplicates": {k: t["duplicates"] for k, t in tables.items()},
             "efficiency": {k: t["efficiency"] for k, t in tables.items()}}
    everyone = hvd.allgather_object(state)
    for key in state:
        assert all(s[key] == everyone[0][key] for s in everyone), (key, [s[key] for s in everyone])
    assert checked > 40 and len(decider.log) >= 1, (checked, decider.log)
    batch, factor, last = factors[-1]
    scale = batch / (8 * size)
    assert scale > 2 and factor == pytest.approx(math.sqrt(scale)), (factors[-1], decider.log)
    assert 1.0 <= last["rare"] < 1.1, factors[-1]  # hit ~once per batch at any size: its LR stays
    assert last["hot"] == pytest.approx(factor, rel=0.05), factors[-1]  # every row in every batch: the dense factor
    assert tables["rare"]["duplicates"] == pytest.approx(1.0, abs=0.05) and tables["hot"]["duplicates"] == pytest.approx(size, rel=0.1)
    assert {short(n) for n in decider.log[-1].get("tables", {})} == {"rare", "hot"}, decider.log  # d, efficiency
    if rank == 0:
        from hybridsync.adaptive.report import describe

        print("\n".join(describe(adaptive.summary())), flush=True)
    print(f"rank {rank} np {size}: changes {loader.changes}, batch {batch}, LR factors dense {factor:.3f} rare {last['rare']:.3f} "
          f"hot {last['hot']:.3f}; decisions {[(e['kind'], e['from'], e['to']) for e in decider.log]}", flush=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_every_rank_models_the_same_row_counts_and_table_learning_rates(np_):
    run_ranks(__file__, "rank_tables", np_, timeout=240)


if __name__ == "__main__":
    rank_main(globals())
