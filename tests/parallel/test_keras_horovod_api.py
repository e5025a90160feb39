"""horovod.tensorflow.keras's surface on real ranks (hybridsync.tensorflow.keras and
hybridsync.keras): the DistributedOptimizer with Horovod's arguments -- accumulation over
backward_passes_per_step (summed or averaged), local variables and PartialDistributedOptimizer,
_compute_gradients, process sets, get_config / from_config -- Horovod's callbacks in model.fit
(the calls of Horovod's tensorflow2_keras_mnist.py: Keras 2's compile keyword included),
the Keras values API, elastic state and its callbacks. One job per world size runs them all."""
import pytest

from tests.parallel.harness import rank_main, run_ranks


def _close(a, b, tol=1e-5):
    import numpy as np

    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


def _everyone(obj) -> list:
    import hybridsync.tensorflow as htf

    return htf.allgather_object(obj)


class _Gradient:
    """Builds a Keras 3 optimizer whose update adds the gradient (what Horovod's
    test_gradient_aggregation checks with): variables show exactly what was applied."""

    @staticmethod
    def make(keras):
        class AddGradient(keras.optimizers.Optimizer):
            def __init__(self, name="add_gradient", **kwargs):
                super().__init__(learning_rate=0.1, name=name, **kwargs)

            def update_step(self, gradient, variable, learning_rate):
                variable.assign_add(gradient)

        return AddGradient()


def check_accumulation(hvd, keras, tf, np, rank, size):
    """backward_passes_per_step=4: gradients summed locally, exchanged and applied every 4th
    call (the others count an iteration only), their mean with average_aggregated_gradients."""
    for average in (True, False):
        opt = hvd.DistributedOptimizer(_Gradient.make(keras), backward_passes_per_step=4,
                                       average_aggregated_gradients=average, sparse_as_dense=True)
        x, y = tf.Variable([0.0]), tf.Variable([1.0, 2.0])

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(x - float(rank + 1) * tf.gather(y, [0]))  # dy: IndexedSlices, densified
            opt.apply_gradients(zip(tape.gradient(loss, [x, y]), [x, y]))

        for call in range(10):
            step()
            applied = (call + 1) // 4
            passes = 1 if average else 4
            _close(x.numpy(), [applied * passes * 1.0])
            _close(y.numpy(), [1.0 - applied * passes * (size + 1) / 2, 2.0])  # averaged over ranks
            assert int(opt.iterations.numpy()) == call + 1


def check_local_variables(hvd, keras, tf, np, rank, size):
    opt = hvd.DistributedOptimizer(_Gradient.make(keras))
    shared, mine = tf.Variable([0.0]), tf.Variable([0.0])
    opt.register_local_var(mine)
    opt.apply_gradients([(tf.constant([float(rank)]), shared), (tf.constant([float(rank)]), mine)])
    _close(shared.numpy(), [(size - 1) / 2])  # averaged
    _close(mine.numpy(), [rank / size])  # its own, / size (scale_local_gradients, Horovod's default)
    with pytest.raises(ValueError, match="before training"):
        opt.register_local_var(shared)
    # PartialDistributedOptimizer and _compute_gradients (Horovod's test_partial_distributed_optimizer).
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(rank)),
                              keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(rank))])
    x = tf.constant(np.ones((1, 3)), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(x))
    own = tape.gradient(loss, model.trainable_weights)
    partial = hvd.PartialDistributedOptimizer(keras.optimizers.Adam(), local_layers=model.layers[0])
    pairs = partial._compute_gradients(loss, model.trainable_weights, tape=tape)
    everyone = _everyone([g.numpy() for g in own])
    _close(pairs[0][0], own[0].numpy() / size)  # local: its own / size
    _close(pairs[2][0], np.mean([e[2] for e in everyone], axis=0))  # shared: averaged
    weights = [w.numpy() for w in model.trainable_weights]
    partial.apply_gradients(pairs)  # applied as they are (no second exchange)
    assert int(partial.iterations.numpy()) == 1
    assert not np.allclose(model.trainable_weights[2].numpy(), weights[2])
    del tape


def check_process_set_optimizer(hvd, keras, tf, np, rank, size):
    members = [0, size - 1] if size > 2 else [size - 1]  # (a set of every rank is the global one)
    pair = hvd.add_process_set(members)
    opt = hvd.DistributedOptimizer(_Gradient.make(keras), op=hvd.Sum, process_set=pair)
    v = tf.Variable([0.0])
    opt.apply_gradients([(tf.constant([float(rank + 1)]), v)])
    _close(v.numpy(), [sum(r + 1 for r in members)] if rank in members else [rank + 1.0])
    hvd.remove_process_set(pair)


def check_config_and_errors(hvd, keras, tf, np, rank, size):
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), name="dist", compression=hvd.Compression.fp16,
                                   backward_passes_per_step=2)
    config = opt.get_config()
    assert abs(config["learning_rate"] - 0.01) < 1e-6 and config["hybridsync"]["compression"] == "fp16"
    copy = opt.from_config(config)
    assert copy is not opt and type(copy).__name__ == "Adam" and copy.get_config() == config
    assert type(opt).from_config(config).get_config() == config
    assert opt.variables() == opt.variables  # Keras 2's call, as Horovod's examples make it
    import hybridsync.tensorflow as htf

    with pytest.raises(ValueError, match="op currently only supports Average and Sum"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), op=htf.Max)
    with pytest.raises(ValueError, match="not supported yet with Keras"):
        htf.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Adasum)
    with pytest.raises(ValueError, match="groups should be"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(), groups=-1)
    with pytest.raises(NotImplementedError, match="TensorFlow 1 optimizer"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(RuntimeError, match="does not support eager"):
        hvd.broadcast_global_variables(0)
    # Keras values (horovod.keras's allreduce, allgather, broadcast, reducescatter).
    _close(hvd.allreduce(float(rank), op=hvd.Sum), sum(range(size)))
    _close(hvd.allgather([rank]), list(range(size)))
    _close(hvd.broadcast(np.full(2, rank, np.float32), root_rank=size - 1), [size - 1] * 2)
    _close(hvd.reducescatter(np.ones((size, 2), np.float32), op=hvd.Sum), [[size, size]])


def check_fit_with_horovod_callbacks(hvd, keras, tf, np, rank, size):
    """tensorflow2_keras_mnist.py's calls, on a small dense model: every rank starts from rank 0's
    weights, trains on its own data, logs the averaged loss, and warms the rate up to the target."""
    keras.utils.set_random_seed(rank)  # different starting weights: the callback must broadcast them
    model = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(3)])  # built at fit
    scaled_lr = 0.01 * size
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(scaled_lr, momentum=0.5), backward_passes_per_step=1,
                                   average_aggregated_gradients=True)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=opt,
                  metrics=["accuracy"], experimental_run_tf_function=False)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append((float(self.model.optimizer.learning_rate.numpy()), logs["loss"], logs["lr"]))

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
                 hvd.callbacks.LearningRateScheduleCallback(initial_lr=scaled_lr, multiplier=lambda e: 0.25, start_epoch=2),
                 Record()]
    rng = np.random.RandomState(rank)
    x, y = rng.rand(24, 5).astype("float32"), rng.randint(0, 3, 24)
    model.fit(x, y, batch_size=4, epochs=3, steps_per_epoch=3, callbacks=callbacks, verbose=0)
    everyone = _everyone(seen)
    assert all(e == everyone[0] for e in everyone), everyone  # averaged metrics: the same on every rank
    warm_end = scaled_lr / size * (2 * (size - 1) / 2 + 1)  # Horovod's warmup multiplier at its last batch
    _close(seen[1][0], warm_end)
    _close(seen[2][0], scaled_lr * 0.25)  # the schedule from epoch 2: initial_lr * multiplier(epoch)
    weights = _everyone([w.numpy() for w in model.weights])
    for a, b in zip(weights[0], weights[-1]):
        _close(a, b, tol=1e-6)


def check_elastic(hvd, keras, tf, np, rank, size):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    v = 1.0 if rank == 0 else 2.0
    model.set_weights([np.full((2, 2), v, np.float32), np.full(2, v, np.float32)])
    state = hvd.elastic.KerasState(model, keras.optimizers.Adam(0.001), batch=20 + rank, epoch=10 + rank)
    state.sync()
    assert state.batch == 20 and state.epoch == 10
    for w in model.get_weights():
        _close(w, np.ones_like(w))
    model.set_weights([np.zeros((2, 2), np.float32), np.zeros(2, np.float32)])
    state.batch = 21
    state.restore()
    assert state.batch == 20
    _close(model.get_weights()[0], np.ones((2, 2)))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    batch_state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(batch_state, batches_per_commit=2),
                 hvd.elastic.UpdateBatchStateCallback(batch_state), hvd.elastic.UpdateEpochStateCallback(batch_state)]
    model.fit(np.ones((8, 2), np.float32), np.ones((8, 2), np.float32), batch_size=2, epochs=2, callbacks=callbacks,
              verbose=0)
    assert batch_state.epoch == 2 and batch_state.batch == 0
    assert hvd.elastic.run is not None and hvd.callbacks.BestModelCheckpoint is not None


def rank_horovod_keras():
    import keras
    import numpy as np
    import tensorflow as tf

    import hybridsync.keras as hvd_keras
    import hybridsync.tensorflow.keras as hvd

    assert hvd_keras.DistributedOptimizer is hvd.DistributedOptimizer
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for check in (check_accumulation, check_local_variables, check_process_set_optimizer, check_config_and_errors,
                  check_fit_with_horovod_callbacks, check_elastic):
        check(hvd, keras, tf, np, rank, size)
    print(f"rank {rank}: horovod.tensorflow.keras checks passed", flush=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_horovod_keras_surface(np_):
    out = run_ranks(__file__, "rank_horovod_keras", np_, timeout=300)
    assert out.count("horovod.tensorflow.keras checks passed") == np_, out


if __name__ == "__main__":
    rank_main(globals())
