"""model.save() / keras.models.load_model() and hvd.load_model() with hybridsync's Keras layers
and optimizer, on real ranks: rank 0 saves (Horovod's idiom), every rank loads. The PS table's
rows come back from the file to the shards, the dynamic table's stored rows too, the dense
weights and the wrapped optimizer's class, settings and state (its slots for the variables that
are not on the parameter server) are those saved; hvd.load_model wraps a saved plain Keras
optimizer. Before Keras serialization was registered, loading failed with "Could not locate
class 'Embedding'" (and then the optimizer's class)."""
import pytest

from tests.parallel.harness import rank_main, run_ranks


def _build(keras, htf):
    ids = keras.Input(shape=(2,), dtype="int64", name="ids")
    raw = keras.Input(shape=(2,), dtype="int64", name="raw")
    table = keras.layers.Flatten()(htf.Embedding(40, 4, name="table")(ids))
    dynamic = keras.layers.Flatten()(htf.DynamicEmbedding(3, name="dynamic")(raw))
    dense = keras.layers.Dense(3, name="dense")(keras.layers.Concatenate()([table, dynamic]))
    return keras.Model([ids, raw], keras.layers.Dense(1, name="head")(dense))


def _data(np, rank):
    rng = np.random.RandomState(rank)
    return [rng.randint(0, 40, (8, 2)), rng.randint(0, 2**40, (8, 2))], rng.rand(8, 1).astype("float32")


def rank_save_and_load():
    import keras
    import numpy as np

    import hybridsync.tensorflow as htf
    import hybridsync.tensorflow.keras as hvd

    rank = hvd.rank()
    keras.utils.set_random_seed(0)
    model = _build(keras, htf)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adagrad(0.1), compression=hvd.Compression.fp16,
                                   gradient_predivide_factor=2.0)
    model.compile(optimizer=opt, loss="mse", experimental_run_tf_function=False)
    x, y = _data(np, rank)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    raw_ids = np.unique(np.concatenate(htf.allgather_object(x[1])))
    path = htf.broadcast_object(__import__("tempfile").mkdtemp() if rank == 0 else None) + "/model.keras"
    if rank == 0:
        model.save(path)
    htf.barrier()

    def same_as_saved(loaded):
        np.testing.assert_array_equal(loaded.get_layer("table").get_table(), model.get_layer("table").get_table())
        for name in ("dense", "head"):
            for a, b in zip(loaded.get_layer(name).get_weights(), model.get_layer(name).get_weights()):
                np.testing.assert_array_equal(a, b)
        dynamic, saved = loaded.get_layer("dynamic").table, model.get_layer("dynamic").table
        np.testing.assert_array_equal(dynamic.read_rows(raw_ids), saved.read_rows(raw_ids))
        assert sum(htf.allgather_object(dynamic.stats()["stored"])) == len(raw_ids)

    loaded = keras.models.load_model(path)
    same_as_saved(loaded)
    restored = loaded.optimizer
    assert type(restored).__name__ == "Adagrad" and hasattr(restored, "_hs_settings")
    assert restored._hs_settings.compression == "fp16" and restored._hs_settings.gradient_predivide_factor == 2.0
    assert [v.path for v in restored.variables] == [v.path for v in opt.variables]  # no slot for a PS anchor
    for a, b in zip(restored.variables, opt.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    loaded.fit(x, y, batch_size=4, epochs=1, verbose=0)  # trains on: the plan and the tables work
    assert restored.plan.variables and int(restored.iterations.numpy()) == 4

    again = hvd.load_model(path, compression=hvd.Compression.none)
    same_as_saved(again)
    assert again.optimizer._hs_settings.compression == "none"

    # A model saved with a plain Keras optimizer: Keras loads it plain, hvd.load_model wraps it.
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    plain.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    plain.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    plain_path = path.replace("model.keras", "plain.keras")
    if rank == 0:
        plain.save(plain_path)
    htf.barrier()
    assert not hasattr(keras.models.load_model(plain_path).optimizer, "_hs_settings")
    wrapped = hvd.load_model(plain_path)
    assert hasattr(wrapped.optimizer, "_hs_settings")
    np.testing.assert_array_equal(wrapped.optimizer.variables[-1].numpy(), plain.optimizer.variables[-1].numpy())
    with pytest.raises(NotImplementedError, match="Keras 3"):
        hvd.load_model(plain_path, legacy_opts=True)
    print(f"rank {rank}: save / load round trip passed", flush=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_save_and_load_model_with_ps_tables_and_a_distributed_optimizer(np_):
    out = run_ranks(__file__, "rank_save_and_load", np_, timeout=240)
    assert out.count("save / load round trip passed") == np_, out


if __name__ == "__main__":
    rank_main(globals())
