"""Dynamic tables on real MPI ranks: parity at -np 1, 2, 3 with a one-process reference (a dict
of rows with the same per-shard rules, tests/dynamic_reference.py) for SGD, Adagrad and Adam with
raw ids from the whole int64 range, admission, and LRU / LFU eviction with expiry; bad input
raising on every rank; checkpoints saved at 2 ranks and loaded at 3 and 1; the export."""
import pytest

from tests.parallel.harness import rank_main, run_ranks

STEPS, BATCH, DIM = 8, 12, 3  # BATCH divides over 1, 2 and 3 ranks
# (module name, server optimizer, constructor options); "lru" / "lfu" get theirs from the config.
TABLES = [
    ("sgd_emb", {"name": "sgd", "lr": 0.5}, dict(admit_after=2, ttl_steps=2)),
    ("adagrad_emb", {"name": "adagrad", "lr": 0.3, "initial_accumulator_value": 0.1}, dict(mode="sum")),
    ("adam_emb", {"name": "adam", "lr": 0.05}, dict(admit_after=2, initializer=("uniform", -0.1, 0.1))),
    ("lru_emb", {"name": "adam", "lr": 0.05}, dict()),
    ("lfu_emb", {"name": "adagrad", "lr": 0.3}, dict(capacity=9, evict="lfu", admit_after=2, ttl_steps=4)),
]
LRU_RULE = {"capacity": 10, "evict": "lru", "ttl_steps": 3, "admit_after": 1}


def _pool():
    """Raw ids: the int64 extremes, -1 and hashes from the whole range."""
    import numpy as np

    rng = np.random.default_rng(0)
    drawn = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=27, dtype=np.int64, endpoint=True)
    return np.concatenate([[np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1], drawn]).astype(np.int64)


def _batches():
    """Per step: ids (BATCH, 2) -- a few hot ids and a tail -- and per-position weights."""
    import numpy as np

    pool, rng = _pool(), np.random.default_rng(1)
    out = []
    for _ in range(STEPS):
        hot = pool[rng.integers(0, 4, size=(BATCH, 1))]
        tail = pool[rng.integers(0, len(pool), size=(BATCH, 1))]
        out.append((np.concatenate([hot, tail], axis=1), rng.standard_normal((BATCH, 2, DIM)).astype(np.float32)))
    return out


def _model():
    import torch

    import hybridsync.torch as hvd

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name, _, kw in TABLES:
                setattr(self, name, hvd.DynamicEmbedding(DIM, name=name, seed=11, **kw))
            self.unused = torch.nn.Linear(1, 1)  # the wrapped optimizer needs a parameter

    return Net()


def _config():
    rules = [{"match": f"{name}.*", "sync": "ps", "optimizer": rule} for name, rule, _ in TABLES]
    rules[3]["dynamic"] = LRU_RULE
    return {"variables": rules}


def _references(size):
    from tests.dynamic_reference import ReferenceTable

    out = {}
    for name, rule, kw in TABLES:
        kw = dict(kw, **(LRU_RULE if name == "lru_emb" else {}))
        kw.pop("mode", None)
        hp = {k: v for k, v in rule.items() if k != "name"}
        out[name] = ReferenceTable(DIM, shards=size, seed=11, rule=(rule["name"], hp), **kw)
    return out


def _train(model, opt, rank, size, references=None):
    """STEPS steps; rank r takes rows r::size of each global batch; loss = sum(w * rows) / BATCH,
    so the average over ranks is the one-process loss."""
    import numpy as np
    import torch

    for ids, w in _batches():
        mine = slice(rank, BATCH, size)
        opt.zero_grad()
        loss = 0
        for name, _, kw in TABLES:
            emb = getattr(model, name)
            x = torch.from_numpy(ids[mine])
            if kw.get("mode") == "sum":  # one bag per row: the bag's rows share the weight of column 0
                loss = loss + (emb(x) * torch.from_numpy(w[mine, 0])).sum() * size / BATCH
            else:
                loss = loss + (emb(x) * torch.from_numpy(w[mine])).sum() * size / BATCH
        loss.backward()
        opt.step()
        if references is None:
            continue
        for name, _, kw in TABLES:  # the one-process gradients: sums over the global batch
            grads = {}
            for b in range(BATCH):
                for c in range(2):
                    g = w[b, 0] if kw.get("mode") == "sum" else w[b, c]
                    grads[int(ids[b, c])] = grads.get(int(ids[b, c]), 0) + g.astype(np.float64) / BATCH
            references[name].push(grads)


def rank_parity(size_s):
    import numpy as np
    import torch

    import hybridsync.torch as hvd

    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    assert size == int(size_s)
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, config=_config())
    refs = _references(size)
    _train(model, opt, rank, size, refs)
    pool = _pool()
    for name, _, _ in TABLES:
        table = getattr(model, name).table
        got = table.read_rows(pool)  # one-sided: every shard answers
        want = np.stack([refs[name].row(int(i)) for i in pool])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{name} at {size} ranks")
        stats = hvd.allgather_object(table.stats())
        stored = sum(s["stored"] for s in stats)
        assert stored == len(refs[name].stored_ids()), (name, stored, refs[name].stored_ids())
        for key in ("admitted", "evicted", "expired"):
            assert sum(s[key] for s in stats) == getattr(refs[name], key), (name, key, stats)
    # The rules were exercised: rows waited for admission, and bounded tables evicted and expired.
    assert refs["lru_emb"].evicted > 0 and refs["lfu_emb"].evicted > 0 and refs["sgd_emb"].expired > 0
    assert len(refs["sgd_emb"].stored_ids()) < len(set(np.concatenate([b[0].ravel() for b in _batches()])))
    hvd.shutdown()


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_dynamic_tables_match_a_one_process_reference(np_):
    run_ranks(__file__, "rank_parity", np_, str(np_), timeout=240)


def rank_bad_input():
    import numpy as np
    import torch

    import hybridsync.torch as hvd

    hvd.init()
    rank = hvd.rank()
    emb = hvd.DynamicEmbedding(2, name="bad", seed=1)
    bag = hvd.DynamicEmbedding(2, name="bags", mode="mean", seed=1)
    ids = torch.tensor([3, -4]) if rank == 0 else torch.tensor([0.5, 1.0])  # rank 1: not integers
    with pytest.raises((ValueError, RuntimeError), match="ids must be integers|failed on rank 1"):
        emb(ids)
    flat = torch.tensor([1, 2, 3]) if rank == 1 else torch.tensor([[1, 2]])  # rank 1: 1-D bags, no offsets
    with pytest.raises((ValueError, RuntimeError), match="takes 2-D ids|failed on rank 1"):
        bag(flat)
    with pytest.raises(ValueError, match="capacity 1 is below one row per shard"):
        hvd.DynamicEmbedding(2, name="tiny", capacity=1, evict="lru")
    with pytest.raises(ValueError, match="evict must be None, 'lru' or 'lfu'"):
        hvd.DynamicEmbedding(2, name="x", capacity=10, evict="fifo")  # local, before any collective
    # Nothing hangs and the engine is still in step: a good lookup works everywhere.
    out = emb(torch.tensor([[7, 8]]))
    assert out.shape == (1, 2, 2)
    np.testing.assert_allclose(out[0, 0].detach().numpy(), emb.table.read_rows(np.array([7]))[0])
    hvd.shutdown()


def test_bad_input_raises_on_every_rank_and_nothing_hangs():
    run_ranks(__file__, "rank_bad_input", 2, timeout=120)


if __name__ == "__main__":
    rank_main(globals())
