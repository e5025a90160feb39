"""TensorFlow/Keras parity: N ranks x local batch b give the same variables as one process with
batch N*b (rtol 1e-5) for a Keras model with an Embedding and Dense layers, SGD and Adagrad,
via model.fit and via a tf.GradientTape loop inside tf.function, at -np 2 and -np 3.

The single-process reference densifies the embedding's gradient: Keras's Adagrad on
tf.IndexedSlices squares duplicate rows separately, while the exact math (and the PS, and
torch) sums them first."""
import pytest

from tests.parallel.harness import rank_main, run_scenarios

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
        anchor = model.get_layer("emb").ps_anchor
        weights = [w.numpy() for w in model.weights if w is not anchor]  # the table read from the shards
        assert len(weights) == len(want), (len(weights), len(want))
        for w, got in zip(want, weights):
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


# -- more routes through Keras: Adam beside the PS, all-gather from a YAML file and a tape loop,
#    PS-backed layers on fewer shards than ranks, dense variables on the PS ----------------------

FEATURES = 7


def _dense_model():
    import keras

    keras.utils.set_random_seed(11)
    x = keras.Input(shape=(FEATURES,), name="x")
    h = keras.layers.Dense(6, activation="tanh", name="d0")(x)
    return keras.Model(x, keras.layers.Dense(2, name="d1")(h))


def _dense_data(size):
    import numpy as np

    rng = np.random.default_rng(5)
    n = STEPS * size * LOCAL
    return rng.standard_normal((n, FEATURES)).astype("float32"), rng.standard_normal((n, 2)).astype("float32")


def _mine(arrays, size, rank):
    """This rank's share of every step's global batch (rows rank*LOCAL .. of each step)."""
    import numpy as np

    pick = np.concatenate([np.arange(s * size * LOCAL + rank * LOCAL, s * size * LOCAL + (rank + 1) * LOCAL)
                           for s in range(STEPS)])
    return [a[pick] for a in arrays]


def _train_loop(model, opt, x, y, batch, compiled=True):
    """STEPS steps of a tf.GradientTape loop (inside tf.function unless compiled=False)."""
    import tensorflow as tf

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    if compiled:
        step = tf.function(step, jit_compile=False)
    for s in range(STEPS):
        step(x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch])
    return model


def _assert_same(weights, want, label):
    import numpy as np

    assert len(weights) == len(want), f"{label}: {len(weights)} arrays, want {len(want)}"
    for k, (w, got) in enumerate(zip(want, weights)):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6, err_msg=f"{label} (array {k})")


def _weights(model):
    """Embedding table first (gathered from the shards for a PS-backed layer), then hidden, out."""
    emb = model.get_layer("emb")
    table = emb.get_table() if hasattr(emb, "get_table") else emb.get_weights()[0]
    return [table] + [w for n in ("hidden", "out") for w in model.get_layer(n).get_weights()]


def _lazy_adam_reference(size, start=None, lr=0.05, beta1=0.9, beta2=0.999, eps=1e-7):
    """One process, batch N*b: Keras's Adam on the dense layers, and on the embedding the server's
    lazy Adam (rows of the step's ids move, with the table's step count; untouched rows keep
    their moments) written out in float32 NumPy."""
    import keras
    import numpy as np
    import tensorflow as tf

    model = _model()
    if start is not None:
        model.get_layer("emb").set_weights([start.get_layer("emb").get_table()])
        for layer in ("hidden", "out"):
            model.get_layer(layer).set_weights(start.get_layer(layer).get_weights())
    emb = model.get_layer("emb").embeddings
    dense = [v for v in model.trainable_variables if v is not emb]
    opt = keras.optimizers.Adam(lr, beta_1=beta1, beta_2=beta2, epsilon=eps)
    table = np.array(emb.numpy(), np.float32)
    m, v = np.zeros_like(table), np.zeros_like(table)
    ids, y = _data(size)
    batch = size * LOCAL
    for s in range(STEPS):
        xb, yb = ids[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        g_emb, *g_dense = tape.gradient(loss, [emb] + dense)
        opt.apply_gradients(zip(g_dense, dense))
        t = s + 1
        step_size = np.float32(lr * np.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t))
        rows = np.unique(xb)
        g = tf.convert_to_tensor(g_emb).numpy()[rows]  # duplicates summed, as the shards do
        m[rows] += (g - m[rows]) * np.float32(1 - beta1)
        v[rows] += (g * g - v[rows]) * np.float32(1 - beta2)
        table[rows] -= step_size * (m[rows] / (np.sqrt(v[rows]) + np.float32(eps)))
        emb.assign(table)
    return _weights(model)


def rank_adam_beside_allreduce():
    """Keras Adam on the dense all-reduce route: a model of Dense layers only (fit, and a
    GradientTape loop in tf.function), and the Dense part of a wide&deep model whose embedding
    stays on the PS (replicated Keras Embedding, and the PS-backed layer), where the server
    applies lazy Adam to the rows."""
    import keras

    import hybridsync
    import hybridsync.tensorflow as hvd

    rank, size = hybridsync.rank(), hybridsync.size()
    x, y = _dense_data(size)
    reference = _dense_model()
    want = _train_loop(reference, keras.optimizers.Adam(0.05), x, y, size * LOCAL, compiled=False).get_weights()
    mx, my = _mine((x, y), size, rank)

    model = _dense_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.05)), loss="mse", jit_compile=False)
    model.fit(mx, my, batch_size=LOCAL, epochs=1, shuffle=False, verbose=0)
    _assert_same(model.get_weights(), want, "dense-only adam/fit")
    assert {v.route.value for v in model.optimizer.plan.variables} == {"allreduce"}
    # Keras's own state (iterations, moments) advanced exactly as in the single process.
    assert int(model.optimizer.iterations.numpy()) == STEPS

    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05))
    _assert_same(_train_loop(_dense_model(), opt, mx, my, LOCAL).get_weights(), want, "dense-only adam/tape")
    print(f"rank {rank}: keras adam on a dense model (fit, tape) matches the single-process run", flush=True)

    # Wide & deep: the Dense layers all-reduced under Keras's Adam, the embedding on the PS.
    model = _fit("adam", size, rank)
    rows = {v.name: v for v in model.optimizer.plan.variables}
    assert (rows["emb/embeddings"].route.value, rows["emb/embeddings"].placement.value) == ("ps", "replicated")
    assert rows["emb/embeddings"].optimizer["name"] == "adam"
    assert rows["hidden/kernel"].route.value == rows["out/bias"].route.value == "allreduce"
    _assert_same(_weights(model), _lazy_adam_reference(size), "wide&deep adam, replicated embedding")
    model = _fit("adam", size, rank, sharded=True)
    want = _lazy_adam_reference(size, start=_model(sharded=True))
    _assert_same(_weights(model), want, "wide&deep adam, PS-backed embedding")
    table = model.get_layer("emb").table
    if rank == 0:  # shard 0 counts the table's steps (the bias correction's t)
        assert table.engine.step(table.handle) == STEPS, table.engine.step(table.handle)
    print(f"rank {rank}: keras adam beside a PS embedding (lazy adam on the rows) matches", flush=True)


def rank_allgather_more():
    """The all-gather route asked for by `defaults.sparse.sync: allgather` in a YAML file, in a
    GradientTape loop inside tf.function (SGD, Adagrad), and Keras's Adam on gathered rows (fit).

    The reference applies the whole batch's IndexedSlices unsummed, as Keras applies the gathered
    ones: every rank's (ids, rows) concatenated in rank order -- the global batch's order -- and
    divided by N. Keras's Adagrad and Adam square an IndexedSlices' values before duplicates are
    summed (Adagrad's accumulator gets g1^2 + g2^2, not (g1 + g2)^2), so densifying the
    reference's gradient would not be the same math."""
    import os
    import tempfile

    import hybridsync
    import hybridsync.tensorflow as hvd

    rank, size = hybridsync.rank(), hybridsync.size()
    path = os.path.join(tempfile.mkdtemp(prefix=f"hs-rank{rank}-"), "allgather.yaml")
    with open(path, "w") as f:
        f.write("defaults:\n  sparse:\n    sync: allgather\n")
    ids, y = _my_rows(size, rank)
    for name in ("sgd", "adagrad"):
        opt = hvd.DistributedOptimizer(_optimizer(name), config=path)
        model = _train_loop(_model(), opt, ids, y, LOCAL)
        rows = {v.name: v for v in opt.plan.variables}
        assert rows["emb/embeddings"].route.value == "allgather", rows["emb/embeddings"]
        assert rows["emb/embeddings"].reason.startswith("config defaults.sparse"), rows["emb/embeddings"].reason
        assert rows["hidden/kernel"].route.value == "allreduce"
        _assert_same(model.get_weights(), _reference(name, size, densify=False), f"{name}/allgather/tape")
        print(f"rank {rank}: {name}, all-gather from the YAML defaults, tape loop: matches", flush=True)
    model = _fit("adam", size, rank, config=path)
    assert {v.name: v for v in model.optimizer.plan.variables}["emb/embeddings"].route.value == "allgather"
    _assert_same(model.get_weights(), _reference("adam", size, densify=False), "adam/allgather/fit")
    print(f"rank {rank}: adam on all-gathered rows (fit) matches", flush=True)


def _sharded_model(partitions, partition):
    import keras

    import hybridsync.tensorflow as hvd

    keras.utils.set_random_seed(7)
    ids = keras.Input(shape=(3,), dtype="int64", name="ids")
    x = hvd.Embedding(ROWS, DIM, name="emb", partitions=partitions, partition=partition)(ids)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(5, activation="tanh", name="hidden")(x)
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def rank_fewer_shards():
    """Tables on fewer shards than ranks: the PS-backed layer on 1 and 2 shards (cyclic and
    block), SGD and Adagrad; with Adagrad, a replicated Keras Embedding on 2 block shards beside
    the dense layers themselves on the PS (replicated: the server applies Keras's Adagrad, epsilon
    inside the square root, to every row of a dense gradient)."""
    import hybridsync
    import hybridsync.tensorflow as hvd

    rank, size = hybridsync.rank(), hybridsync.size()
    # (rank_more_routes has Adagrad on 1 shard.) At -np 2 only 1 shard is fewer than the ranks.
    layouts = {"sgd": [(1, "cyclic"), (2, "block")], "adagrad": [(2, "cyclic")]} if size > 2 else \
        {"sgd": [(1, "cyclic")], "adagrad": [(1, "block")]}
    for name in ("sgd", "adagrad"):
        for partitions, partition in layouts[name]:
            label = f"{name}/sharded/{partitions} {partition} shards"
            model = _sharded_model(partitions, partition)
            want = _reference(name, size, start=model)
            model.compile(optimizer=hvd.DistributedOptimizer(_optimizer(name)), loss="mse", jit_compile=False)
            ids, y = _my_rows(size, rank)
            model.fit(ids, y, batch_size=LOCAL, epochs=1, shuffle=False, verbose=0)
            _assert_same(_weights(model), want, label)
            table = model.get_layer("emb").table
            row = {v.name: v for v in model.optimizer.plan.variables}["emb/embeddings"]
            assert (row.placement.value, row.shards, row.partition) == ("sharded", partitions, partition), row
            # Only the first `partitions` ranks hold rows.
            held = table.engine.shard_rows(table.handle)
            assert (held > 0) == (rank < partitions), (label, rank, held)
            print(f"rank {rank}: keras {label} matches (this rank holds {held} rows)", flush=True)
    name = "adagrad"  # (SGD's server rule on a dense variable adds nothing to check)
    partitions = min(2, size - 1)
    config = {"variables": [{"match": "emb*", "sync": "ps", "placement": "replicated", "partitions": partitions,
                             "partition": "block"},
                            {"match": "hidden/*", "sync": "ps", "partitions": 1},
                            {"match": "out/kernel", "sync": "ps"}]}
    model = _fit(name, size, rank, config=config)
    _assert_same(model.get_weights(), _reference(name, size), f"{name}/replicated block + dense on the PS")
    rows = {v.name: (v.route.value, v.placement.value, v.shards) for v in model.optimizer.plan.variables}
    assert rows["emb/embeddings"] == ("ps", "replicated", partitions), rows
    assert rows["hidden/kernel"] == rows["hidden/bias"] == ("ps", "replicated", 1), rows
    assert rows["out/kernel"] == ("ps", "replicated", size) and rows["out/bias"][0] == "allreduce", rows
    print(f"rank {rank}: keras {name}, replicated block table and dense layers on the PS: matches", flush=True)


# Several scenarios share one mpirun launch per world size: starting ranks that import
# TensorFlow costs seconds each time, the scenarios need nothing of each other (each builds its
# own models and tables), and a failing one is named by its traceback and its last printed line.

def rank_parity_and_tape():
    rank_parity()
    rank_distributed_tape()


def rank_sharded_adam_allgather_and_fewer_shards():
    rank_sharded_parity()
    rank_adam_beside_allreduce()
    rank_allgather_more()
    rank_fewer_shards()


@pytest.mark.parametrize("np_", [2, 3])
def test_keras_parity_routes_sharded_layer_and_fewer_shards(np_):
    """In one launch per world size: fit and tape parity and the distributed gradient tape; Adam,
    the all-gather and fewer partitions; the sharded PS-backed layer's parity, Adam on the dense
    all-reduce beside the PS, the all-gather from YAML defaults with a tape loop and Adam, and
    PS-backed layers on fewer shards than ranks with dense variables on the PS."""
    run_scenarios(__file__, np_, "rank_parity_and_tape", "rank_more_routes",
                  "rank_sharded_adam_allgather_and_fewer_shards", timeout=1200)


if __name__ == "__main__":
    rank_main(globals())
