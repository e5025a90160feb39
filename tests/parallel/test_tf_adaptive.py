"""hybridsync.adaptive in Keras under real MPI ranks: the gradient statistics of a Dense layer
and of a PS table (a Keras Embedding, replicated; a hybridsync Embedding, sharded) against the
truth from per-sample gradients (learning rate 0: the model stays put); the linear rule at twice
the base batch trains exactly as plain training at twice the learning rate."""
import pytest

from tests.parallel.harness import rank_main, run_ranks

ROWS, DIM, FEATURES, DATA = 12, 3, 5, 96


def _model(sharded):
    import keras

    import hybridsync.tensorflow as hvd

    keras.utils.set_random_seed(3)
    ids = keras.Input(shape=(), dtype="int64", name="ids")
    x = keras.Input(shape=(FEATURES,), name="x")
    emb = (hvd.Embedding(ROWS, DIM, name="emb", initializer=("uniform", -1.0, 1.0)) if sharded else
           keras.layers.Embedding(ROWS, DIM, name="emb", embeddings_initializer=keras.initializers.RandomUniform(-1, 1)))
    out = keras.ops.sum(emb(ids) * keras.layers.Dense(DIM, name="lin")(x), axis=1)
    return keras.Model([ids, x], out)


def _data():
    import numpy as np

    rng = np.random.default_rng(11)
    ids = (rng.random(DATA) ** 2 * ROWS).astype("int64")
    x = 1.0 + rng.standard_normal((DATA, FEATURES))  # a mean: the Dense layer's |G| well above 0
    return ids, x.astype("float32"), (2.0 + rng.standard_normal(DATA)).astype("float32")


def _truth(trained, sharded):
    """From a plain Keras copy of `trained` (a PS table's rows read from its shards)."""
    import numpy as np
    import tensorflow as tf

    model, (ids, x, y) = _model(False), _data()
    table = trained.get_layer("emb").get_table() if sharded else trained.get_layer("emb").get_weights()[0]
    model.get_layer("emb").set_weights([table])
    model.get_layer("lin").set_weights(trained.get_layer("lin").get_weights())
    per = {}
    for i in range(DATA):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([ids[i:i + 1], x[i:i + 1]]) - y[i:i + 1]))
        for v, g in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
            per.setdefault(v.path.split("/")[0], []).append(np.asarray(tf.convert_to_tensor(g), np.float64).ravel())
    out = {}
    for layer in ("emb", "lin"):
        gs = per[layer]
        if layer == "lin":  # kernel and bias alternate: one vector per sample
            gs = [np.concatenate([gs[2 * i], gs[2 * i + 1]]) for i in range(DATA)]
        g = np.stack(gs)
        mean = g.mean(0)
        out[layer] = (float(mean @ mean), float(((g - mean) ** 2).sum(1).mean()))
    return out


def _stepper(model, opt):
    """One training step, traced once per batch shape (eager Keras steps are slow)."""
    import tensorflow as tf

    @tf.function(reduce_retracing=True)
    def step(ids, x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model([ids, x]) - y))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    return step


def rank_keras_adaptive():
    import keras
    import numpy as np

    import hybridsync.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    ids, x, y = _data()
    batch = 8
    for sharded in (False, True):
        model = _model(sharded)
        truth = _truth(model, sharded)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.0),
                                       adaptive={"local_batch_size": batch, "smoothing": 0.98})
        rng = np.random.default_rng(100 + rank)
        step = _stepper(model, opt)
        for _ in range(300):
            pick = rng.integers(0, DATA, batch)
            step(ids[pick], x[pick], y[pick])
        per = opt.gradient_stats()["by_variable"]
        got = {"emb": [(v["sqr"], v["var"]) for n, v in per.items() if "emb" in n][0],
               "lin": tuple(sum(v[k] for n, v in per.items() if n.startswith("lin")) for k in ("sqr", "var"))}
        for layer in ("emb", "lin"):
            for k, label in enumerate(("|G|^2", "tr(Sigma)")):
                err = abs(got[layer][k] - truth[layer][k]) / truth[layer][k]
                print(f"rank {rank} np {size} sharded={sharded} {layer} {label}: estimated {got[layer][k]:.4g}, "
                      f"true {truth[layer][k]:.4g} ({err:.1%})", flush=True)
                assert err < 0.2, (sharded, layer, label, got[layer][k], truth[layer][k])

    def train(lr, local, adaptive):
        model = _model(False)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), adaptive=adaptive)
        if adaptive:
            opt.adaptive.base_batch = 4 * size
        step = _stepper(model, opt)
        for s in range(5):
            start = (s * size + rank) * local % (DATA - local)
            step(ids[start:start + local], x[start:start + local], y[start:start + local])
        return model.get_weights(), opt

    plain, _ = train(0.05, 4, None)
    off, _ = train(0.05, 4, {"scaling_rule": None, "local_batch_size": 4})
    assert all(np.array_equal(a, b) for a, b in zip(plain, off)), "statistics alone changed the training"
    doubled, _ = train(0.1, 8, None)
    linear, opt = train(0.05, 8, {"scaling_rule": "linear", "local_batch_size": 8})
    assert opt.adaptive.last_factor == 2.0
    assert all(np.array_equal(a, b) for a, b in zip(doubled, linear)), "the linear rule's LR did not reach both paths"

    # AdaptiveDataset: on noise-dominated data the batch grows, the same on every rank.
    rng = np.random.default_rng(5)
    n = 2048
    data = (rng.integers(0, ROWS, n), rng.standard_normal((n, FEATURES)).astype("float32"),
            (200.0 * rng.standard_normal(n)).astype("float32"))
    model = _model(False)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1e-6), adaptive=True)
    dataset = hvd.AdaptiveDataset(data, batch_size=4 * size, optimizer=opt, interval=4, warmup=4)
    dataset.autoscale_batch_size(32 * size, local_bsz_bounds=(2, 32))
    history = []
    step = _stepper(model, opt)
    for batch in dataset:
        step(*batch)
        history.append(opt.adaptive.sizes())
        if len(history) >= 30:
            break
    from hybridsync import allgather_object

    everyone = allgather_object(history)
    assert all(h == everyone[0] for h in everyone), "ranks disagree on the batch size"
    assert opt.adaptive.global_batch() > 4 * size, (dataset.changes, opt.adaptive.summary())


@pytest.mark.parametrize("np_", [2, 3])
def test_keras_noise_scale_and_rules(np_):
    run_ranks(__file__, "rank_keras_adaptive", np_, timeout=300)


if __name__ == "__main__":
    rank_main(globals())
