"""Tables whose rows the shards store in 16 bits (storage: {dtype: float16 | bfloat16}) on real
MPI ranks: every row, pulled and read back, equals a one-process float32 reference that rounds
the same way (tests/storage_reference.py), bit for bit, at -np 1, 2 and 3 -- fixed and dynamic
tables, SGD / Adagrad / Adam, round-to-nearest-even and seeded stochastic rounding (which
depends only on (seed, id, step), so the world size changes nothing). Plus: the torch modules'
storage= argument and a YAML rule's storage:, checkpoints keeping 16-bit tables exactly, and
bad storage options raising errors that name the table and key."""
import os

import pytest

from tests.parallel.harness import rank_main, run_scenarios

ROWS, DIM, STEPS, BATCH = 23, 4, 5, 12  # BATCH divides over 1, 2 and 3 ranks
RULES = [("sgd", {"lr": 0.5}), ("adagrad", {"lr": 0.3, "initial_accumulator_value": 0.1}),
         ("adam", {"lr": 0.05})]


def _batches(pool, seed):
    """Per step: ids (BATCH,) from `pool` with duplicates, and gradient rows that are multiples
    of 1/64 (their sums are exact in float32 in any order, so the ranks' split is no factor)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(pool[rng.integers(0, len(pool), size=BATCH)],
             (rng.integers(-64, 65, size=(BATCH, DIM)) / 64.0).astype(np.float32)) for _ in range(STEPS)]


def _train(table, reference, batches, fixed_ids):
    """Pushes each step's batch, split over the ranks; checks pulls and the rows against the
    reference after every step."""
    import numpy as np

    from hybridsync.ps import client
    from hybridsync.ps.table import pull

    engine = client.engine()
    rank, size = engine.rank, engine.size
    for ids, grads in batches:
        mine = slice(rank, None, size)
        engine.push([table.handle], [ids[mine]], [grads[mine]])  # (lr: the rule's)
        reference.push(ids, grads)
        (unique, inverse, rows), = pull([table], [ids[mine]])
        np.testing.assert_array_equal(rows[inverse], reference.table(ids[mine]),
                                      err_msg=f"{table.name}: pulled rows")
    engine.barrier("storage-test")
    np.testing.assert_array_equal(table.read_rows(fixed_ids), reference.table(fixed_ids), err_msg=table.name)


def rank_fixed_half_rows():
    import numpy as np

    import hybridsync
    from hybridsync.ps.table import PSTable
    from tests.storage_reference import HalfReference

    hybridsync.init()
    ids = np.arange(ROWS, dtype=np.int64)
    for dtype in ("float16", "bfloat16"):
        for rounding in ("nearest", "stochastic"):
            for name, hp in RULES:
                tag = f"{dtype}_{rounding}_{name}"
                rule = {"name": name, **hp}
                plain = PSTable(f"plain_{tag}", ROWS, DIM, rule=rule)
                half = PSTable(f"half_{tag}", ROWS, DIM, rule=rule,
                               storage={"dtype": dtype, "rounding": rounding, "seed": 99})
                for t in (plain, half):
                    t.initialize(("normal", 0.0, 0.5), 7)
                # initialize() is local and read_rows() one-sided: without a barrier this rank may
                # read another's shard before that rank has filled it (zeros, under load).
                half.engine.barrier(f"initialized {tag}")
                assert half.engine.spec(half.handle)["storage"]["dtype"] == dtype
                ref = HalfReference(dtype, name, hp, rounding, seed=99)
                ref.add(ids, plain.read_rows(ids))
                np.testing.assert_array_equal(half.read_rows(ids), ref.table(ids), err_msg=f"{tag}: initial rows")
                _train(half, ref, _batches(ids, seed=len(tag)), ids)
                plain.drop()
                half.drop()


def rank_dynamic_half_rows():
    import numpy as np

    import hybridsync
    from hybridsync.ps import dynamic_options as dyn
    from hybridsync.ps.dynamic import DynamicTable
    from tests.storage_reference import HalfReference

    hybridsync.init()
    pool = np.array([np.iinfo(np.int64).min, -1, 0, 5, 17, 2**40 + 3, np.iinfo(np.int64).max, 123456789],
                    np.int64)
    for dtype, rounding, (name, hp) in [("float16", "nearest", RULES[2]), ("bfloat16", "stochastic", RULES[1]),
                                        ("bfloat16", "nearest", RULES[0])]:
        tag = f"{dtype}_{rounding}_{name}"
        opts = dyn.options(tag, seed=5, initializer=("normal", 0.0, 0.5))
        plain = DynamicTable(f"dplain_{tag}", DIM, opts, rule={"name": name, **hp})
        half = DynamicTable(f"dhalf_{tag}", DIM, opts, rule={"name": name, **hp},
                            storage={"dtype": dtype, "rounding": rounding, "seed": 3})
        ref = HalfReference(dtype, name, hp, rounding, seed=3)
        ref.add(pool, plain.read_rows(pool))  # (a stored id's first row: its seeded value, rounded)
        _train(half, ref, _batches(pool, seed=len(tag) + 1), pool)
        plain.drop()
        half.drop()


def _torch_model():
    import torch

    import hybridsync.torch as hvd

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.h16 = hvd.Embedding(30, 4, name="h16", seed=1, storage={"dtype": "float16"})
            self.bag = hvd.EmbeddingBag(30, 4, mode="sum", name="bag", seed=2)  # bfloat16 by the rule
            self.wrapped = torch.nn.Embedding(30, 4, sparse=True)  # float16 by the rule
            self.dyn = hvd.DynamicEmbedding(4, name="dyn", seed=3, storage={"dtype": "bfloat16", "rounding": "stochastic"})
            self.out = torch.nn.Linear(16, 1)

        def forward(self, ids):
            return self.out(torch.cat([self.h16(ids[:, 0]), self.bag(ids[:, :2]), self.wrapped(ids[:, 1]),
                                       self.dyn(ids[:, 2] * 1000003)], 1)).squeeze(1)

    model = Net()
    config = {"variables": [{"match": "bag.weight", "sync": "ps", "storage": {"dtype": "bfloat16"}},
                            {"match": "wrapped.weight", "sync": "ps", "placement": "sharded",
                             "storage": {"dtype": "float16"}}]}
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model=model, config=config)
    return model, opt


def _torch_steps(model, opt, steps):
    import torch

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()
    for step in steps:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 30, (BATCH, 3), generator=g)
        y = torch.randn(BATCH, generator=g)
        mine = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids[mine]), y[mine]).backward()
        opt.step()


def _torch_rows(model):
    import numpy as np

    ids = np.arange(30, dtype=np.int64)
    return {"h16": model.h16.table.read_rows(ids), "bag": model.bag.table.read_rows(ids),
            "wrapped": model.wrapped.table.read_rows(ids), "dyn": model.dyn.table.read_rows(ids * 1000003)}


def rank_torch_storage(tmp):
    import numpy as np

    import hybridsync
    from hybridsync.ps.storage import round_rows

    model, opt = _torch_model()
    dtypes = {"h16": "float16", "bag": "bfloat16", "wrapped": "float16", "dyn": "bfloat16"}
    for name, dtype in dtypes.items():
        table = getattr(model, name).table
        assert table.engine.spec(table.handle)["storage"]["dtype"] == dtype, name
    assert model.bag.table.optimizer == "adagrad" and model.wrapped.table.optimizer == "adagrad"
    _torch_steps(model, opt, range(3))
    rows = _torch_rows(model)
    for name, dtype in dtypes.items():  # every row is a value of its type, and training moved them
        np.testing.assert_array_equal(rows[name], round_rows(rows[name], dtype), err_msg=name)
    with open(os.devnull, "w") as sink:
        text = hybridsync.explain(file=sink)
    for name in ("h16.weight: float16", "bag.weight: bfloat16", "wrapped.weight: float16",
                 "dyn.weight: bfloat16 (stochastic rounding"):
        assert name in text, (name, text)
    hybridsync.save_checkpoint(f"{tmp}/ckpt", model, opt)
    import json

    from hybridsync.checkpoint import MANIFEST
    with open(f"{tmp}/ckpt/{MANIFEST}") as f:
        saved = {t["variable"]: t["row_dtype"] for t in json.load(f)["tables"]}
    assert saved == {f"{name}.weight": dtype for name, dtype in dtypes.items()}, saved
    _torch_steps(model, opt, range(3, 5))
    want = _torch_rows(model)
    model, opt = _torch_model()
    hybridsync.load_checkpoint(f"{tmp}/ckpt", model, opt)
    np.testing.assert_array_equal(_torch_rows(model)["h16"], rows["h16"])
    _torch_steps(model, opt, range(3, 5))
    got = _torch_rows(model)
    for name in dtypes:  # the checkpoint kept every 16-bit row (and its float32 slots) exactly
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def rank_bad_storage():
    import torch

    import hybridsync
    import hybridsync.torch as hvd
    from hybridsync.config import ConfigError
    from hybridsync.ps.dynamic import DynamicTable
    from hybridsync.ps import dynamic_options as dyn

    hybridsync.init()
    cases = [({"dtype": "fp8"}, "table 'bad0': storage.dtype must be one of float32, float16, bfloat16, got 'fp8'"),
             ({"rounding": "up"}, "table 'bad1': storage.rounding must be one of nearest, stochastic"),
             ({"dtpye": "float16"}, "table 'bad2': storage: unknown key 'dtpye'"),
             ({"memory_rows": 4}, "table 'bad3': storage.memory_rows and disk_rows need storage.path"),
             ({"path": "/tmp"}, "table 'bad4': storage.path needs storage.memory_rows"),
             ("float16", "table 'bad5': storage must be a dict")]
    for k, (storage, message) in enumerate(cases):
        try:
            hvd.Embedding(10, 2, name=f"bad{k}", storage=storage)
        except ValueError as exc:
            assert message in str(exc), (str(exc), message)
        else:
            raise AssertionError(f"storage {storage!r} was accepted")
    try:
        DynamicTable("dbad", 2, dyn.options("dbad", capacity=10),
                     storage={"dtype": "float16", "memory_rows": 4, "path": "/tmp/hs-storage-test"})
    except ValueError as exc:  # (raised by the engine on every rank: the collective agreed)
        assert "table 'dbad'" in str(exc) and "capacity" in str(exc), str(exc)
    else:
        raise AssertionError("a dynamic table with both a capacity and a disk tier was accepted")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                 config={"variables": [{"match": "0.weight", "storage": {"dtype": "float16"}}]})
    except ConfigError as exc:
        assert "storage" in str(exc) and "'0.weight'" in str(exc), str(exc)
    else:
        raise AssertionError("storage on a dense variable was accepted")


def rank_keras_storage(tmp):
    import os

    import keras
    import numpy as np

    import hybridsync
    import hybridsync.tensorflow as htf
    from hybridsync.ps.storage import round_rows

    keras.utils.set_random_seed(0)
    ids = keras.Input(shape=(2,), dtype="int64")
    emb = htf.Embedding(30, 4, name="kemb", storage={"dtype": "float16"})
    dyn = htf.DynamicEmbedding(4, name="kdyn", storage={"dtype": "bfloat16"})
    tiered = htf.DynamicEmbedding(4, name="ktier", evict="lru",
                                  storage={"memory_rows": 2, "path": f"{tmp}/rank{hybridsync.rank()}"})
    x = keras.layers.Concatenate()([keras.layers.Flatten()(layer(ids)) for layer in (emb, dyn, tiered)])
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    model.compile(optimizer=htf.DistributedOptimizer(keras.optimizers.Adagrad(0.1)), loss="mse", jit_compile=False)
    rng = np.random.default_rng(hybridsync.rank())
    model.fit(rng.integers(0, 30, (32, 2)), rng.standard_normal((32, 1)), batch_size=8, epochs=1, verbose=0)
    for layer, dtype in ((emb, "float16"), (dyn, "bfloat16")):
        assert layer.table.engine.spec(layer.table.handle)["storage"]["dtype"] == dtype
        assert layer.get_config()["storage"] == {"dtype": dtype}
        rows = layer.table.read_rows(np.arange(30))
        np.testing.assert_array_equal(rows, round_rows(rows, dtype), err_msg=layer.name)
    with open(os.devnull, "w") as sink:
        text = hybridsync.explain(file=sink)
    assert "kemb" in text and ": float16" in text and ": bfloat16" in text, text
    assert tiered.get_config()["storage"]["memory_rows"] == 2
    stats = hybridsync.allgather_object(tiered.table.tier_stats())
    assert sum(s["bytes_written"] for s in stats) > 0 and sum(s["disk_rows"] for s in stats) > 0, stats


# The scenarios share one launch per world size (a launch starts ranks that import torch and
# TensorFlow: seconds on 2 cores); each has its own tables and directory, and a failure names
# its sub-case. Keras goes first: its explain() check reads the plans of the live optimizers.

def test_half_rows_at_two_ranks_keras_and_torch_storage_checkpoints_and_bad_options(tmp_path):
    """Keras layers store half rows and spill to disk; torch modules and rules store half rows and
    checkpoints keep them; bad storage options name the table and key; fixed and dynamic tables
    with half rows match the reference."""
    (tmp_path / "keras").mkdir(), (tmp_path / "torch").mkdir()
    run_scenarios(__file__, 2, ("rank_keras_storage", tmp_path / "keras"), ("rank_torch_storage", tmp_path / "torch"),
                  "rank_bad_storage", "rank_fixed_half_rows", "rank_dynamic_half_rows", timeout=360)


@pytest.mark.parametrize("np_", [1, 3])
def test_fixed_and_dynamic_tables_with_half_rows_match_the_reference(np_):
    run_scenarios(__file__, np_, "rank_fixed_half_rows", "rank_dynamic_half_rows")


if __name__ == "__main__":
    rank_main(globals())
