"""Dynamic tables keep world-size parity on a workload big enough to grow their shards: sum-bags
of 3 raw int64 ids per sample (duplicate ids inside a bag, hot ids shared across bags and ranks),
server SGD, Adagrad and Adam, compared at -np 1, 2 and 3 with the one-process reference of
tests/dynamic_reference.py (float64, the whole global batch per step).

Each shard stores more than its first arena of 1,024 rows, so the arena grows in the middle of a
round -- at a different step at each world size. That round used to run with a rule made anew,
without the step's constants (SGD's lr read 0: the round's update was lost on every row of that
shard), so -np 2 and 3 drifted from -np 1 and all of them from the reference."""
import pytest

from tests.parallel.harness import rank_main, run_ranks

STEPS, BAGS, DIM, POOL = 5, 600, 2, 5000  # BAGS divides over 1, 2 and 3 ranks
RULES = {
    "sgd_bags": {"name": "sgd", "lr": 0.5},
    "adagrad_bags": {"name": "adagrad", "lr": 0.1, "initial_accumulator_value": 0.1},
    "adam_bags": {"name": "adam", "lr": 0.05},
}


def _pool():
    import numpy as np

    rng = np.random.default_rng(7)
    drawn = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=POOL - 3, dtype=np.int64)
    return np.concatenate([[np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1], drawn]).astype(np.int64)


def _batches():
    """Per step: ids (BAGS, 3) -- a hot id, then two from the whole pool, the last repeating the
    middle one in every fourth bag -- and per-bag weights (BAGS, DIM)."""
    import numpy as np

    pool, rng = _pool(), np.random.default_rng(8)
    out = []
    for _ in range(STEPS):
        ids = np.stack([pool[rng.integers(0, 8, BAGS)], pool[rng.integers(0, POOL, BAGS)],
                        pool[rng.integers(0, POOL, BAGS)]], axis=1)
        ids[::4, 2] = ids[::4, 1]
        out.append((ids, rng.standard_normal((BAGS, DIM)).astype(np.float32)))
    return out


def _global_grads(ids, w):
    """{id: the one-process gradient row}: loss = sum(w * bag sums) / BAGS."""
    import numpy as np

    unique, inverse = np.unique(ids, return_inverse=True)
    sums = np.zeros((len(unique), DIM))
    for column in range(ids.shape[1]):
        np.add.at(sums, inverse.reshape(ids.shape)[:, column], w.astype(np.float64) / BAGS)
    return {int(i): g for i, g in zip(unique, sums)}


def rank_parity():
    import numpy as np
    import torch

    import hybridsync.torch as hvd
    from tests.dynamic_reference import ReferenceTable

    rank, size = hvd.rank(), hvd.size()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name in RULES:
                setattr(self, name, hvd.DynamicEmbedding(DIM, name=name, mode="sum", seed=5))
            self.unused = torch.nn.Linear(1, 1)  # the wrapped optimizer needs a parameter

    model = Net()
    config = {"variables": [{"match": f"{name}.*", "sync": "ps", "optimizer": rule} for name, rule in RULES.items()]}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, config=config)
    refs = {name: ReferenceTable(DIM, shards=size, seed=5, rule=(rule["name"], {k: v for k, v in rule.items()
                                                                                 if k != "name"}))
            for name, rule in RULES.items()}
    for ids, w in _batches():
        mine = slice(rank * BAGS // size, (rank + 1) * BAGS // size)
        opt.zero_grad()
        loss = sum((getattr(model, name)(torch.from_numpy(ids[mine])) * torch.from_numpy(w[mine])).sum()
                   for name in RULES) * size / BAGS  # the ranks' average is the one-process loss
        loss.backward()
        opt.step()
        grads = _global_grads(ids, w)
        for ref in refs.values():
            ref.push(grads)
    pool = _pool()
    for name, ref in refs.items():
        table = getattr(model, name).table
        assert table.stats()["stored"] > 1024, (name, table.stats())  # this shard's arena grew
        np.testing.assert_allclose(table.read_rows(pool), ref.rows(pool), rtol=1e-5, atol=1e-5,
                                   err_msg=f"{name} at {size} ranks")


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_dynamic_sum_bags_match_the_one_process_reference_for_every_server_rule(np_):
    run_ranks(__file__, "rank_parity", np_, timeout=180)


if __name__ == "__main__":
    rank_main(globals())
