"""Keras weights of a PS table (issue 23): hybridsync.tensorflow.Embedding's table is among the
layer's `weights` as a Keras embedding's would be, read and written one-sided.

- model.get_weights() (the anchor, then the table) / save_weights() on rank 0 alone, the others going straight on; rank 0
  alone load_weights() then broadcast_variables(); set_weights() on one rank: every rank reads
  the table it wrote.
- Memory: the rank that reads or writes the table holds it once; the others nothing.
- hvd.elastic.KerasState commits and restores the table per shard, the rest by value.
"""

import pytest

from tests.parallel.harness import rank_main, run_ranks
from tests.parallel.memory import peak_mib as _peak_mib, reset_peak as _reset_peak


def _model(rows, dim, name):
    import keras
    import numpy as np

    import hybridsync
    import hybridsync.tensorflow as htf

    keras.utils.set_random_seed(0)
    ids = keras.Input(shape=(2,), dtype="int64")
    x = keras.layers.Flatten()(htf.Embedding(rows, dim, name=name)(ids))
    model = keras.Model(ids, keras.layers.Dense(1, name=f"{name}_out")(x))
    model.compile(optimizer=htf.DistributedOptimizer(keras.optimizers.SGD(0.5)), loss="mse", jit_compile=False)
    _fit(model, rows, hybridsync.rank())
    return model


def _fit(model, rows, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    model.fit(rng.integers(0, rows, (8, 2)), rng.standard_normal((8, 1)), batch_size=8, verbose=0)


def _shards_table(table):
    """The table assembled from every rank's own shard, gathered as objects (a witness)."""
    import numpy as np

    import hybridsync
    from hybridsync.ps.partition import Partition

    shards, kind = table.layout
    mine = ((table.engine.local_values(table.handle, -1), Partition(table.num_rows, shards, kind).rows_of(hybridsync.rank()))
            if hybridsync.rank() < shards else (np.zeros((0, table.dim), np.float32), np.zeros(0, np.int64)))
    full = np.zeros((table.num_rows, table.dim), np.float32)
    for rows, ids in hybridsync.allgather_object(mine):
        full[ids] = rows
    return full


def _one_sided_weights(tmp):
    import numpy as np

    import hybridsync
    import hybridsync.tensorflow as htf

    rank, size = hybridsync.rank(), hybridsync.size()
    rows = 3000
    model = _model(rows, 8, "emb")
    layer, table = model.get_layer("emb"), model.get_layer("emb").table
    assert [tuple(w.shape) for w in model.weights] == [(1,), (rows, 8), (16, 1), (1,)]
    assert model.count_params() == 1 + rows * 8 + 17
    path = f"{tmp}/small.weights.h5"
    if rank == 0:  # the others go straight on
        saved = model.get_weights()
        model.save_weights(path)
    witness = _shards_table(table)
    if rank == 0:
        np.testing.assert_array_equal(saved[1], witness)
    for step in range(2):
        _fit(model, rows, 10 + step + rank)
    assert not np.array_equal(layer.get_table(), witness)
    saved = hybridsync.broadcast_object(saved if rank == 0 else None, 0)
    if rank == 0:  # rank 0 alone loads, then Horovod's broadcast of the variables
        model.load_weights(path)
    htf.broadcast_variables(model.variables, root_rank=0)
    np.testing.assert_array_equal(layer.get_table(), witness)
    for got, want in zip(model.get_weights(), saved):
        np.testing.assert_array_equal(got, want)
    # Every rank has read the table before one rank overwrites it (a one-sided write: without
    # this a slow rank read the new rows in the loaded machine's CI run).
    hybridsync.allgather_object(None)
    if rank == size - 1:  # one rank writes the table through set_weights
        layer.set_weights([np.zeros(1, np.float32), np.full((rows, 8), 0.25, np.float32)])
    hybridsync.allgather_object(None)  # after the write
    np.testing.assert_array_equal(_shards_table(table), 0.25)
    _fit(model, rows, 99)
    print(f"rank {rank}: KERAS-WEIGHTS-OK", flush=True)
    _keras_state(model, rows)


def _keras_state(model, rows):
    """hvd.elastic.KerasState: the table committed and restored per shard, the rest by value."""
    import numpy as np

    import hybridsync
    import hybridsync.tensorflow as htf

    table = model.get_layer("emb").table
    state = htf.elastic.KerasState(model, epoch=hybridsync.rank())
    state.sync()
    assert state.epoch == 0
    _fit(model, rows, 200 + hybridsync.rank())
    state.epoch = 1
    state.commit()
    committed = (_shards_table(table), [np.array(v.numpy()) for v in model.variables + model.optimizer.variables])
    _fit(model, rows, 300 + hybridsync.rank())
    state.epoch = 2
    assert not np.array_equal(_shards_table(table), committed[0])
    state.restore()
    assert state.epoch == 1
    np.testing.assert_array_equal(_shards_table(table), committed[0])
    for v, want in zip(model.variables + model.optimizer.variables, committed[1]):
        np.testing.assert_array_equal(v.numpy(), want, err_msg=v.path)
    _fit(model, rows, 400)
    print(f"rank {hybridsync.rank()}: KERAS-STATE-OK", flush=True)


def _memory(tmp):
    import gc

    import hybridsync

    rank = hybridsync.rank()
    rows, dim = 800_000, 32  # 98 MiB
    table_mib = rows * dim * 4 / 2**20
    model = _model(rows, dim, "big")
    path = f"{tmp}/big.weights.h5"
    grown = {}
    for what in ("get_weights", "save_weights", "load_weights"):
        gc.collect()
        hybridsync.allgather_object(None)
        before = _reset_peak()
        if rank == 0:  # rank 0 alone; the others wait below only to measure at the same point
            if what == "get_weights":
                weights = model.get_weights()
                del weights
            else:
                getattr(model, what)(path)
        gc.collect()
        hybridsync.allgather_object(None)
        grown[what] = _peak_mib() - before
    print(f"KERAS-MEMORY rank={rank} table={table_mib:.1f} MiB "
          + " ".join(f"{k}={v:.1f}" for k, v in grown.items()), flush=True)
    for what, mib in grown.items():
        if rank == 0:
            assert mib < 1.1 * table_mib + 16, (what, grown)
        else:
            assert mib < 0.05 * table_mib, (what, grown)
    _fit(model, rows, 7)


def rank_keras_weights(tmp):
    _one_sided_weights(tmp)
    _memory(tmp)


@pytest.mark.parametrize("np_", [2, 3])
def test_keras_weights_of_a_ps_table_are_one_sided(np_, tmp_path):
    out = run_ranks(__file__, "rank_keras_weights", np_, str(tmp_path), timeout=300,
                    env={"HYBRIDSYNC_TIMEOUT_S": "30"})
    assert out.count("KERAS-WEIGHTS-OK") == np_ and out.count("KERAS-STATE-OK") == np_
    assert out.count("KERAS-MEMORY") == np_


if __name__ == "__main__":
    rank_main(globals())
