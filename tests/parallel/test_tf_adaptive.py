"""hybridsync.adaptive in Keras under real MPI ranks: the gradient statistics of a Dense layer
and of a PS table (a Keras Embedding, replicated; a hybridsync Embedding, sharded) against the
truth from per-sample gradients (learning rate 0: the model stays put); the linear rule at twice
the base batch trains exactly as plain training at twice the learning rate."""

from tests.parallel.harness import rank_main, run_ranks, run_scenarios
from tests.parallel.step_clock import StepClock

ROWS, DIM, FEATURES, DATA = 12, 3, 5, 96
# What a (micro-)step costs on the AdaptiveDataset scenarios' step clock (step_clock.py): a fixed
# cost that a bigger batch shares, so the batch grows at the same steps on any machine (on wall
# time, a new batch shape's tf.function retrace and the machine's load made its steps look slow).
STEP_COST_S, SAMPLE_COST_S = 0.01, 1e-5


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


def _noisy_dataset(batch_size):
    """A model, its adaptive optimizer and an AdaptiveDataset of noise-dominated data (a big
    batch is nearly free of statistical cost, so the batch should grow)."""
    import keras
    import numpy as np

    import hybridsync.tensorflow as hvd

    rng = np.random.default_rng(5)
    n = 2048
    data = (rng.integers(0, ROWS, n), rng.standard_normal((n, FEATURES)).astype("float32"),
            (200.0 * rng.standard_normal(n)).astype("float32"))
    model = _model(False)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1e-6), adaptive=True)
    return model, opt, hvd.AdaptiveDataset(data, batch_size=batch_size, optimizer=opt, interval=4, warmup=4)


def _check_statistics(accumulation=1):
    """300 steps at LR 0 (the truth stays put) of batch 8 per rank, in `accumulation` micro-steps
    of 8 each (a single rank's statistics come from them); estimates within 20% of the truth."""
    import keras
    import numpy as np

    import hybridsync.tensorflow as hvd

    rank, size = hvd.rank(), hvd.size()
    ids, x, y = _data()
    batch = 8
    for sharded in (False, True):
        model = _model(sharded)
        truth = _truth(model, sharded)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.0),
                                       adaptive={"local_batch_size": batch, "smoothing": 0.98})
        opt.adaptive.set_batch(batch, accumulation)
        rng = np.random.default_rng(100 + rank)
        step = _stepper(model, opt)
        for _ in range(300 * accumulation):
            pick = rng.integers(0, DATA, batch)
            step(ids[pick], x[pick], y[pick])
        assert opt.adaptive.steps == 300 and int(opt.iterations.numpy()) == 300, "a micro-step was applied"
        per = opt.gradient_stats()["by_variable"]
        got = {"emb": [(v["sqr"], v["var"]) for n, v in per.items() if "emb" in n][0],
               "lin": tuple(sum(v[k] for n, v in per.items() if n.startswith("lin")) for k in ("sqr", "var"))}
        for layer in ("emb", "lin"):
            for k, label in enumerate(("|G|^2", "tr(Sigma)")):
                err = abs(got[layer][k] - truth[layer][k]) / truth[layer][k]
                print(f"rank {rank} np {size} sharded={sharded} {layer} {label}: estimated {got[layer][k]:.4g}, "
                      f"true {truth[layer][k]:.4g} ({err:.1%})", flush=True)
                assert err < 0.2, (sharded, layer, label, got[layer][k], truth[layer][k])


def rank_keras_adaptive():
    import keras
    import numpy as np

    import hybridsync.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    ids, x, y = _data()
    _check_statistics()

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
    model, opt, dataset = _noisy_dataset(4 * size)
    dataset.autoscale_batch_size(32 * size, local_bsz_bounds=(2, 32))
    history = []
    step = _stepper(model, opt)
    clock = StepClock.install()
    for batch in dataset:
        clock.spend(STEP_COST_S + SAMPLE_COST_S * len(batch[0]))
        step(*batch)
        history.append(opt.adaptive.sizes())
        if len(history) >= 30:
            break
    from hybridsync import allgather_object

    everyone = allgather_object(history)
    assert all(h == everyone[0] for h in everyone), "ranks disagree on the batch size"
    assert opt.adaptive.global_batch() > 4 * size, (dataset.changes, opt.adaptive.summary())


def rank_keras_accumulation():
    """Accumulation micro-steps (AdaptiveDataset(..., gradient_accumulation=True)): k micro-steps
    of b train as one step of k b (SGD; Adam: no moment moves on a micro-step), a Dense layer and
    both PS placements, and the all-gather route; on one rank they are where the statistics come from, and the dataset
    starts with two of them so a choice can be made."""
    import keras
    import numpy as np

    import hybridsync.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    ids, x, y = _data()
    allgather = {"variables": [{"match": "emb*", "sync": "allgather"}]}
    auto = {"auto_steps": 2, "variables": [{"match": "emb*", "sync": "auto"}]}  # decides after 2 of the 4 steps
    for sharded, make, config in ((False, keras.optimizers.SGD, None), (True, keras.optimizers.SGD, None),
                                  (False, keras.optimizers.SGD, allgather), (False, keras.optimizers.Adam, None),
                                  (True, keras.optimizers.Adam, None), (False, keras.optimizers.SGD, auto)):
        def train(local, k):
            model = _model(sharded)
            opt = hvd.DistributedOptimizer(make(0.05), config=config, adaptive={"scaling_rule": None})
            opt.adaptive.set_batch(local, k)
            step = _stepper(model, opt)
            for s in range(4):
                for m in range(k):
                    start = ((s * size + rank) * local * k + m * local) % (DATA - local)
                    step(ids[start:start + local], x[start:start + local], y[start:start + local])
            if config is auto:  # several ranks: measured for 2 steps, then on the route chosen; one rank: the PS
                emb = [v for v in opt.plan.variables if v.name.startswith("emb")]
                assert len(emb) == 1 and (bool(emb[0].auto) if size > 1 else "one rank" in emb[0].reason), emb
            table = model.get_layer("emb").get_table() if sharded else model.get_layer("emb").get_weights()[0]
            return [table, *model.get_layer("lin").get_weights()], int(opt.iterations.numpy())

        whole, whole_steps = train(8, 1)
        micro, micro_steps = train(4, 2)
        assert whole_steps == micro_steps == 4, (whole_steps, micro_steps)
        for a, b in zip(whole, micro):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=f"sharded={sharded} {make.__name__} {config}")
    if size == 1:
        _check_statistics(accumulation=3)
        model, opt, dataset = _noisy_dataset(8)
        dataset.autoscale_batch_size(64, local_bsz_bounds=(2, 32), gradient_accumulation=True)
        step = _stepper(model, opt)
        clock = StepClock.install()
        for i, batch in enumerate(dataset):
            if i == 0:
                assert opt.adaptive.sizes() == (4, 2), opt.adaptive.sizes()
            clock.spend(STEP_COST_S + SAMPLE_COST_S * len(batch[0]))
            step(*batch)
            if opt.adaptive.steps >= 24:
                break
        assert opt.adaptive.stats.ready() and opt.adaptive.global_batch() > 8, (dataset.changes, opt.adaptive.summary())
        assert opt.adaptive.accumulation >= 2  # one rank keeps measuring


def test_keras_accumulation_micro_steps_at_one_rank():
    run_ranks(__file__, "rank_keras_accumulation", 1, timeout=300)


def test_keras_accumulation_micro_steps_noise_scale_and_rules_at_two_ranks():
    run_scenarios(__file__, 2, "rank_keras_accumulation", "rank_keras_adaptive", timeout=500)


def test_keras_noise_scale_and_rules_at_three_ranks():
    run_ranks(__file__, "rank_keras_adaptive", 3, timeout=300)


if __name__ == "__main__":
    rank_main(globals())
