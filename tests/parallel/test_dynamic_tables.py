"""Dynamic tables on real MPI ranks: parity at -np 1, 2, 3 with a one-process reference (a dict
of rows with the same per-shard rules, tests/dynamic_reference.py) for SGD, Adagrad and Adam with
raw ids from the whole int64 range, admission, and LRU / LFU eviction with expiry; bad input
raising on every rank; checkpoints saved at 2 ranks and loaded at 3 and 1; the export; hvd.join()
with uneven batches (a joined rank serves its shard and pushes nothing) at -np 2 and 3."""
import pytest

from tests.parallel.harness import rank_main, run_ranks, run_scenarios

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


def _parity(model, opt, rank, size):
    """Trains and compares every id's row and the counters with the reference."""
    import numpy as np

    import hybridsync.torch as hvd

    refs = _references(size)
    _train(model, opt, rank, size, refs)
    pool = _pool()
    for name, _, _ in TABLES:
        table = getattr(model, name).table
        got = table.read_rows(pool)  # one-sided: every shard answers
        want = np.stack([refs[name].row(int(i)) for i in pool])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{name} at {size} ranks")
        stats = hvd.allgather_object(table.stats())
        stored = sum(s["stored"] for s in stats)
        assert stored == len(refs[name].stored_ids()), (name, stored, refs[name].stored_ids())
        for key in ("admitted", "evicted", "expired"):
            assert sum(s[key] for s in stats) == getattr(refs[name], key), (name, key, stats)
    # The rules were exercised: rows waited for admission, and bounded tables evicted and expired.
    assert refs["lru_emb"].evicted > 0 and refs["lfu_emb"].evicted > 0 and refs["sgd_emb"].expired > 0
    assert len(refs["sgd_emb"].stored_ids()) < len(set(np.concatenate([b[0].ravel() for b in _batches()])))
    # explain() shows this rank's shards: stored / share, and the newest step's counters.
    import io

    import hybridsync

    text = hybridsync.explain(file=io.StringIO())
    s = model.lru_emb.stats()
    section = text.split("dynamic tables (this rank's shards):")[1]
    line = next(x for x in section.splitlines() if x.startswith("lru_emb.weight "))
    assert f"{s['stored']}/{s['capacity']}" in line and f"{s['admitted']}/{s['evicted']}/{s['expired']}" in line, text


def _wrapped():
    import torch

    import hybridsync.torch as hvd

    model = _model()
    return model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, config=_config())


def _bad_input():
    """Rank 1's bad ids raise on every rank (its own error there, 'failed on rank 1' elsewhere),
    nothing hangs, and the engine stays in step."""
    import numpy as np
    import torch

    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    emb = hvd.DynamicEmbedding(2, name="bad", seed=1)
    bag = hvd.DynamicEmbedding(2, name="bags", mode="mean", seed=1)
    ids = torch.tensor([0.5, 1.0]) if rank == 1 else torch.tensor([3, -4])  # rank 1: not integers
    with pytest.raises((ValueError, RuntimeError), match="ids must be integers|failed on rank 1"):
        emb(ids)
    flat = torch.tensor([1, 2, 3]) if rank == 1 else torch.tensor([[1, 2]])  # rank 1: 1-D bags, no offsets
    with pytest.raises((ValueError, RuntimeError), match="takes 2-D ids|failed on rank 1"):
        bag(flat)
    with pytest.raises(ValueError, match=f"capacity {size - 1} is below one row per shard"):
        hvd.DynamicEmbedding(2, name="tiny", capacity=size - 1, evict="lru")
    with pytest.raises(ValueError, match="evict must be None, 'lru' or 'lfu'"):
        hvd.DynamicEmbedding(2, name="x", capacity=10, evict="fifo")  # local, before any collective
    out = emb(torch.tensor([[7, 8]]))
    assert out.shape == (1, 2, 2)
    np.testing.assert_allclose(out[0, 0].detach().numpy(), emb.table.read_rows(np.array([7]))[0])


def rank_scenario(path, role):
    """Every role: parity with the reference at this world size. save: then a checkpoint and an
    export; load: a fresh model loads it and sees the same state; corrupt: a damaged shard file is
    an error naming it, on every rank."""
    import shutil

    import hybridsync
    import hybridsync.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model, opt = _wrapped()
    _parity(model, opt, rank, size)
    if role == "save":
        _save(path, model, opt)
    else:
        _load(path)
    if role == "corrupt":
        from hybridsync.checkpoint import CheckpointError

        damaged = f"{path}.damaged"
        if rank == 0:
            shutil.copytree(path, damaged)
            shard = f"{damaged}/table-4-shard-1.safetensors"
            data = bytearray(open(shard, "rb").read())
            data[-5] ^= 0xFF
            open(shard, "wb").write(bytes(data))
        hvd.allgather_object(0)
        model, opt = _wrapped()
        with pytest.raises(CheckpointError, match="table-4-shard-1.safetensors is corrupt"):
            hybridsync.load_checkpoint(damaged, model, opt)
    if size > 1:
        _bad_input()
    hvd.shutdown()


def snapshot(tables):
    """Per table ({name: DynamicTable}): every stored id (sorted), its row and slots, counts, last
    touches and pending ids, gathered from every shard (PyTorch and Keras alike)."""
    import numpy as np

    from hybridsync import comm

    out = {}
    for name, table in tables.items():
        parts = comm.objects().allgather_object(table.shard_state(), name="test.snapshot")
        ids = np.concatenate([p["ids"] for p in parts])
        order = np.argsort(ids)
        out[f"{name}.ids"] = ids[order]
        for key in ("counts", "last_touch"):
            out[f"{name}.{key}"] = np.concatenate([p[key] for p in parts])[order]
        out[f"{name}.pending"] = np.sort(np.concatenate([p["pending_ids"] for p in parts]))
        out[f"{name}.rows"] = table.read_rows(ids[order])  # through the engine, as lookups see them
        for k, slot in enumerate(table.slot_names):
            out[f"{name}.slot.{slot}"] = table.read_rows(ids[order], slot=k)
    return out


def _everything(model):
    return snapshot({name: getattr(model, name).table for name, _, _ in TABLES})


def _save(path, model, opt):
    import numpy as np

    import hybridsync
    import hybridsync.torch as hvd
    from hybridsync.ps.dynamic import read_export

    hybridsync.save_checkpoint(path, model, opt)
    state = _everything(model)
    if hvd.rank() == 0:
        np.savez(f"{path}.expected.npz", **state)
    # The export: every stored (id, row) pair in one file, each rank writing its own shard's.
    total = model.lfu_emb.export(f"{path}.export")
    ids, rows = read_export(f"{path}.export")
    order = np.argsort(ids)
    assert total == len(state["lfu_emb.ids"]) > 0
    np.testing.assert_array_equal(ids[order], state["lfu_emb.ids"])
    np.testing.assert_array_equal(rows[order], state["lfu_emb.rows"])


def _load(path):
    """A fresh model loads the checkpoint: every stored id's row and slots, counts, last
    touches and pending ids are those saved (at another world size: re-hashed)."""
    import numpy as np

    import hybridsync

    model, opt = _wrapped()
    hybridsync.load_checkpoint(path, model, opt)
    got, want = _everything(model), np.load(f"{path}.expected.npz")
    assert set(got) == set(want.files)
    for key in want.files:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert model.sgd_emb.table.step == STEPS


def rank_join():
    """hvd.join() with dynamic tables: rank r has 2 + 2r batches; a rank that ran out joins, its
    shards keep serving the others and it pushes nothing, the average still divides by the world
    size (Horovod's join). The tables match the reference fed each step's active ranks only;
    then every rank trains on together."""
    import numpy as np
    import torch

    import hybridsync.torch as hvd
    from tests.dynamic_reference import ReferenceTable

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    options = dict(capacity=8, evict="lru", admit_after=2, ttl_steps=2)
    emb = hvd.DynamicEmbedding(DIM, name="joined", seed=5, **options)
    model = torch.nn.ModuleDict({"emb": emb, "unused": torch.nn.Linear(1, 1)})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, config={
        "variables": [{"match": "emb.*", "sync": "ps", "optimizer": {"name": "sgd", "lr": 0.5}}]})
    ref = ReferenceTable(DIM, shards=size, seed=5, rule=("sgd", {"lr": 0.5}), **options)  # SGD: sees the scale
    pool = _pool()

    def batch(r, step):
        rng = np.random.default_rng(1000 * r + step)
        return pool[rng.integers(0, len(pool), size=6)], rng.standard_normal((6, DIM)).astype(np.float32)

    def train(step, active):
        if rank in active:
            ids, w = batch(rank, step)
            opt.zero_grad()
            (emb(torch.from_numpy(ids)) * torch.from_numpy(w)).sum().backward()
            opt.step()
        grads = {}
        for r in active:
            ids, w = batch(r, step)
            for i, g in zip(ids, w):
                grads[int(i)] = grads.get(int(i), 0) + g.astype(np.float64) / size
        ref.push(grads)

    steps_of = [2 + 2 * r for r in range(size)]
    for step in range(max(steps_of)):
        train(step, [r for r in range(size) if step < steps_of[r]])
    assert hvd.join() == size - 1
    for step in range(100, 102):  # together again after the join
        train(step, range(size))
    np.testing.assert_allclose(emb.table.read_rows(pool), np.stack([ref.row(int(i)) for i in pool]), rtol=1e-5,
                               atol=1e-5)
    stats = hvd.allgather_object(emb.stats())
    for key in ("stored", "admitted", "evicted", "expired"):
        want = len(ref.stored_ids()) if key == "stored" else getattr(ref, key)
        assert sum(s[key] for s in stats) == want, (key, stats)
    assert ref.evicted > 0 and ref.expired > 0
    hvd.join()  # every rank at once
    hvd.shutdown()


def test_dynamic_tables_parity_at_2_3_1_ranks_checkpoint_across_them_bad_input_and_join(tmp_path):
    """One job per world size (each start costs seconds): 2 trains, checks and saves; 3 and 1
    train, check and load it; 1 also meets a corrupt shard file; 2 and 3 check bad input, then
    join with uneven batches and a dynamic table (a rank waiting on another's program order
    fails in 60 s)."""
    path, env = str(tmp_path / "ckpt"), {"HYBRIDSYNC_TIMEOUT_S": "60"}
    run_scenarios(__file__, 2, ("rank_scenario", path, "save"), "rank_join", timeout=400, env=env)
    run_scenarios(__file__, 3, ("rank_scenario", path, "load"), "rank_join", timeout=400, env=env)
    run_ranks(__file__, "rank_scenario", 1, path, "corrupt", timeout=240)


if __name__ == "__main__":
    rank_main(globals())
