"""Adagrad's accumulators across a batch change in Keras, under real mpirun at 2 and 3 ranks
(docs/adaptive.md, "Adagrad's accumulators across a batch change").

A Keras model as a user writes it -- a plain keras.layers.Embedding (moved onto the PS shards by
DistributedOptimizer(..., model=model)) and a Dense layer -- under keras.optimizers.Adagrad (its
default initial_accumulator_value 0.1, so the rescale must keep the initial part) trains with
the AdaptiveDataset on noise-dominated data until the controller itself decides to grow the
batch (a step clock makes the decision the same on every run: tests/parallel/step_clock.py).
The step that change takes effect in runs with its loss multiplied by 0, so it adds nothing to
any accumulator and what it leaves is the rescale alone: every rank's Keras accumulators and
every shard's Adagrad sums are init + f (before - init), f the same bits on every rank and the
one accumulator_factor gives for the change and the noise scale logged with it; rows never
touched keep their initial sum. With rescale_accumulators=False the same step moves nothing.
"""

from tests.parallel.harness import rank_main, run_ranks, run_scenarios
from tests.parallel.step_clock import StepClock

ROWS, DIM, FEATURES, DATA = 40, 3, 4, 4096
UNTOUCHED = 5  # rows ROWS-5.. are never looked up
# The step clock's cost of a step: mostly fixed, so a bigger batch is cheaper per sample and,
# on noise-dominated data, the controller grows the batch at its first decision.
STEP_COST_S, SAMPLE_COST_S = 0.01, 1e-5
INIT = 0.1  # keras.optimizers.Adagrad's initial_accumulator_value


def rank_keras_rescale(setting):
    import json

    import keras
    import numpy as np
    import tensorflow as tf

    import hybridsync.tensorflow as hvd
    from hybridsync.adaptive.scaling import accumulator_factor

    setting = json.loads(setting)
    hvd.init()
    size = hvd.size()
    keras.utils.set_random_seed(3)
    ids_in = keras.Input(shape=(), dtype="int64", name="ids")
    x_in = keras.Input(shape=(FEATURES,), name="x")
    out = keras.ops.sum(keras.layers.Embedding(ROWS, DIM, name="emb")(ids_in) *
                        keras.layers.Dense(DIM, name="lin")(x_in), axis=1)
    model = keras.Model([ids_in, x_in], out)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adagrad(0.01), model=model,
                                   adaptive={"rescale_accumulators": setting})
    rng = np.random.default_rng(5)
    data = (rng.integers(0, ROWS - UNTOUCHED, DATA), rng.standard_normal((DATA, FEATURES)).astype("float32"),
            (50.0 * rng.standard_normal(DATA)).astype("float32"))  # noise-dominated: a big batch is nearly free
    dataset = hvd.AdaptiveDataset(data, batch_size=4 * size, optimizer=opt, interval=4, warmup=4)
    dataset.autoscale_batch_size(32 * size, local_bsz_bounds=(2, 32))

    @tf.function(reduce_retracing=True)
    def step(ids, x, y, weight):
        with tf.GradientTape() as tape:
            loss = weight * tf.reduce_mean(tf.square(model([ids, x]) - y))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    table = model.get_layer("emb").table

    def state():
        """This rank's Keras accumulators; the table's Adagrad sums from every shard."""
        return [keras.ops.convert_to_numpy(a) for a in opt._accumulators], table.read(table.slot_names.index("sum"))

    clock = StepClock.install()
    checked = False
    for batch in dataset:
        clock.spend(STEP_COST_S + SAMPLE_COST_S * len(batch[0]))
        planned = opt.adaptive.accumulators.pending  # a change planned between steps: this step applies it
        if not dataset.changes:  # (step, local batch, micro-steps) of each change the controller decided
            assert planned is None, (opt.adaptive.steps, planned)
            step(*batch, tf.constant(1.0))
            continue
        if setting is not False:
            assert planned is not None and planned["to"] > planned["from"] == 4 * size, planned
        else:
            assert planned is None, planned
        dense_before, table_before = state()
        step(*batch, tf.constant(0.0))  # adds nothing to any sum: what moves is the rescale
        dense_after, table_after = state()
        if setting is False:
            for a, b in zip(dense_before + [table_before], dense_after + [table_after]):
                assert np.array_equal(a, b)
            assert not opt.adaptive.accumulators.log
        else:
            entry = opt.adaptive.accumulators.log[-1]
            f = entry["factor"]
            assert entry["applied"] and entry["to"] == dataset.current_batch_size == \
                dataset.current_local_bsz * dataset.accumulation_steps * size, entry
            assert f == accumulator_factor(entry["from"], entry["to"], entry["noise_scale"]) and 0 < f < 1, entry
            assert hvd.allgather_object(f) == [f] * size, "ranks rescaled by different factors"
            f32, init = np.float32(f), np.float32(INIT)
            assert dense_before, "no Keras accumulator to check"
            for a, b in zip(dense_before + [table_before], dense_after + [table_after]):
                assert (a != init).any(), "nothing accumulated before the change"
                np.testing.assert_allclose(b, (a - init) * f32 + init, rtol=1e-6)
                assert np.array_equal(b[a == init], a[a == init])
            assert (table_after[ROWS - UNTOUCHED:] == init).all()  # never touched: still the initial sum
            everyone = hvd.allgather_object([a.tolist() for a in dense_after])
            assert all(e == everyone[0] for e in everyone), "ranks hold different Keras accumulators"
        checked = True
        break
    assert checked, f"the batch never changed: {dataset.changes}, {opt.adaptive.summary()}"


def test_a_keras_batch_change_rescales_every_adagrad_accumulator_alike_and_rescale_off_leaves_them_at_two_ranks():
    run_scenarios(__file__, 2, ("rank_keras_rescale", '"auto"'), ("rank_keras_rescale", "false"), timeout=400)


def test_a_keras_batch_change_rescales_every_adagrad_accumulator_alike_at_three_ranks():
    run_ranks(__file__, "rank_keras_rescale", 3, '"auto"', timeout=240)


if __name__ == "__main__":
    rank_main(globals())
