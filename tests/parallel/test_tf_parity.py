"""TensorFlow/Keras parity: N ranks x local batch b give the same variables as one process with
batch N*b (rtol 1e-5) for a Keras model with an Embedding and Dense layers, SGD and Adagrad,
via model.fit and via a tf.GradientTape loop inside tf.function, at -np 2 and -np 3.

The single-process reference densifies the embedding's gradient: Keras's Adagrad on
tf.IndexedSlices squares duplicate rows separately, while the exact math (and the PS, and
torch) sums them first."""
import pytest

from tests.parallel.harness import rank_main, run_ranks

ROWS, DIM, LOCAL, STEPS = 30, 4, 6, 6


def _model(sharded=False, partitions=None):
    import keras

    import hybridsync.tensorflow as hvd

    keras.utils.set_random_seed(7)
    ids = keras.Input(shape=(3,), dtype="int64", name="ids")
    layer = (hvd.Embedding(ROWS, DIM, name="emb", partitions=partitions) if sharded
             else keras.layers.Embedding(ROWS, DIM, name="emb"))
    x = layer(ids)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(5, activation="tanh", name="hidden")(x)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def _data(size):
    import numpy as np

    rng = np.random.default_rng(3)
    n = STEPS * size * LOCAL
    ids = np.where(rng.random((n, 3)) < 0.6, rng.integers(0, 4, (n, 3)), rng.integers(0, ROWS, (n, 3))).astype("int64")
    return ids, rng.standard_normal((n, 1)).astype("float32")


def _optimizer(name):
    import keras

    if name == "adam":
        return keras.optimizers.Adam(0.05)
    return keras.optimizers.SGD(0.2) if name == "sgd" else keras.optimizers.Adagrad(0.1)


def _reference(name, size, start=None, densify=True):
    import tensorflow as tf

    model, opt = _model(), _optimizer(name)
    if start is not None:  # start where the model with a PS-backed layer starts
        model.get_layer("emb").set_weights([start.get_layer("emb").get_table()])
        for layer in ("hidden", "out"):
            model.get_layer(layer).set_weights(start.get_layer(layer).get_weights())
    ids, y = _data(size)
    batch = size * LOCAL
    for s in range(STEPS):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(ids[s * batch:(s + 1) * batch]) - y[s * batch:(s + 1) * batch]))
        grads = tape.gradient(loss, model.trainable_variables)
        if densify:  # the exact math; without, Keras applies the IndexedSlices as it would
            grads = [tf.convert_to_tensor(g) for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights()


def _my_rows(size, rank):
    import numpy as np

    ids, y = _data(size)
    pick = np.concatenate([np.arange(s * size * LOCAL + rank * LOCAL, s * size * LOCAL + (rank + 1) * LOCAL)
                           for s in range(STEPS)])
    return ids[pick], y[pick]


def _fit(name, size, rank, sharded=False, config=None, partitions=None):
    import hybridsync.tensorflow as hvd

    model = _model(sharded, partitions)
    model.compile(optimizer=hvd.DistributedOptimizer(_optimizer(name), config=config), loss="mse", jit_compile=False)
    ids, y = _my_rows(size, rank)
    model.fit(ids, y, batch_size=LOCAL, epochs=1, shuffle=False, verbose=0)
    return model


def _tape(name, size, rank):
    import tensorflow as tf

    import hybridsync.tensorflow as hvd

    model = _model()
    opt = hvd.DistributedOptimizer(_optimizer(name))
    ids, y = _my_rows(size, rank)

    @tf.function(jit_compile=False)
    def step(x, t):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - t))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    for s in range(STEPS):
        step(ids[s * LOCAL:(s + 1) * LOCAL], y[s * LOCAL:(s + 1) * LOCAL])
    return model


def rank_parity():
    import numpy as np

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()
    for name in ("sgd", "adagrad"):
        want = _reference(name, size)
        for how, train in (("fit", _fit), ("tape", _tape)):
            model = train(name, size, rank)
            for w, got in zip(want, model.get_weights()):
                np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6, err_msg=f"{name}/{how}")
            rows = {v.name: v for v in model.optimizer.plan.variables} if how == "fit" else None
            if rows:
                assert (rows["emb/embeddings"].route.value, rows["emb/embeddings"].placement.value) == ("ps", "replicated")
                assert rows["hidden/kernel"].route.value == "allreduce"
            print(f"rank {rank}: keras {name} via {how} matches the single-process run", flush=True)


def rank_sharded_parity():
    """The PS-backed Keras layer (rows only on the shards) trains like one process too."""
    import numpy as np

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()
    for name in ("sgd", "adagrad"):
        want = _reference(name, size, start=_model(sharded=True))
        model = _fit(name, size, rank, sharded=True)
        table = model.get_layer("emb").get_table()
        np.testing.assert_allclose(table, want[0], rtol=1e-5, atol=1e-6, err_msg=f"{name} table")
        dense = [w for w in model.get_weights() if w.shape != (1,)]  # all but the layer's anchor
        for w, got in zip(want[1:], dense):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6, err_msg=name)
        rows = {v.name: v for v in model.optimizer.plan.variables}
        assert (rows["emb/embeddings"].route.value, rows["emb/embeddings"].placement.value) == ("ps", "sharded")
        print(f"rank {rank}: PS-backed keras layer, {name}: matches the single-process run", flush=True)


def rank_more_routes():
    """The routes torch's parity tests cover, through Keras: Adam on the dense all-reduce, the
    embedding all-gathered (Horovod's way), and tables on fewer shards than ranks."""
    import numpy as np

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()

    def same(model, want, label):
        weights = model.get_weights()
        if hasattr(model.get_layer("emb"), "get_table"):  # rows on the shards, not its anchor
            weights = [model.get_layer("emb").get_table()] + [w for n in ("hidden", "out")
                                                               for w in model.get_layer(n).get_weights()]
        assert len(weights) == len(want), label
        for w, got in zip(want, weights):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6, err_msg=label)
        print(f"rank {rank}: keras {label} matches the single-process run", flush=True)
        return {v.name: v for v in model.optimizer.plan.variables}

    # Keras Adam, every variable all-reduced (the embedding as dense): Keras's own dense Adam.
    rows = same(_fit("adam", size, rank, config={"variables": [{"match": "emb*", "sync": "allreduce"}]}),
                _reference("adam", size), "adam/allreduce")
    assert rows["emb/embeddings"].route.value == "allreduce-as-dense" and rows["hidden/kernel"].route.value == "allreduce"
    # All-gather: every rank's rows, applied by Keras as IndexedSlices (so Adagrad squares each
    # occurrence, as the single process applying its own IndexedSlices does).
    for name in ("sgd", "adagrad"):
        rows = same(_fit(name, size, rank, config={"variables": [{"match": "emb*", "sync": "allgather"}]}),
                    _reference(name, size, densify=False), f"{name}/allgather")
        assert rows["emb/embeddings"].route.value == "allgather"
    # Fewer shards than ranks: replicated on 1 (and 2) shards, the PS-backed layer on 1.
    for partitions in sorted({1, min(2, size - 1)}):
        for name in ("sgd", "adagrad"):
            config = {"variables": [{"match": "emb*", "sync": "ps", "placement": "replicated", "partitions": partitions}]}
            rows = same(_fit(name, size, rank, config=config), _reference(name, size), f"{name}/replicated/{partitions} shards")
            assert rows["emb/embeddings"].shards == partitions
    start = _model(sharded=True, partitions=1)
    rows = same(_fit("adagrad", size, rank, sharded=True, partitions=1), _reference("adagrad", size, start=start),
                "adagrad/sharded/1 shard")
    assert (rows["emb/embeddings"].placement.value, rows["emb/embeddings"].shards) == ("sharded", 1)


def rank_distributed_tape():
    import numpy as np
    import tensorflow as tf

    import hybridsync.tensorflow as hvd

    rank, size = hvd.rank(), hvd.size()
    model, opt = _model(), _optimizer("sgd")
    ids, y = _my_rows(size, rank)
    for s in range(STEPS):
        with hvd.DistributedGradientTape(tf.GradientTape()) as tape:
            loss = tf.reduce_mean(tf.square(model(ids[s * LOCAL:(s + 1) * LOCAL]) - y[s * LOCAL:(s + 1) * LOCAL]))
        grads = tape.gradient(loss, model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)  # the embedding's rows were all-gathered
        opt.apply_gradients(zip(grads, model.trainable_variables))
    for w, got in zip(_reference("sgd", size), model.get_weights()):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("np_", [2, 3])
def test_keras_parity_fit_and_tape(np_):
    run_ranks(__file__, "rank_parity", np_, timeout=420)


@pytest.mark.parametrize("np_", [2, 3])
def test_keras_sharded_layer_parity(np_):
    run_ranks(__file__, "rank_sharded_parity", np_, timeout=300)


@pytest.mark.parametrize("np_", [2, 3])
def test_keras_adam_allgather_and_fewer_partitions(np_):
    run_ranks(__file__, "rank_more_routes", np_, timeout=420)


def test_distributed_gradient_tape():
    run_ranks(__file__, "rank_distributed_tape", 2, timeout=240)


if __name__ == "__main__":
    rank_main(globals())
