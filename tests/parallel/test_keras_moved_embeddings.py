"""Plain keras.layers.Embedding tables moved onto the parameter server's shards
(hybridsync.tensorflow.keras_embeddings), at -np 1, 2 and 3.

- Parity: a model with a plain Keras Embedding, its table moved by `DistributedOptimizer(...,
  model=model)` (a tf.function GradientTape loop) or by Horovod's BroadcastGlobalVariablesCallback
  (model.fit, no model=), trains to the weights of the same model built with
  hybridsync.tensorflow.Embedding and of one process with batch N*b (1e-5), starting from rank 0's
  rows although every rank initialised its own.
- Memory: the layer keeps no table-sized TensorFlow variable (its old tf.Variable is gone, a list
  of the model's variables the script held sees an empty one).
- The config decides: a rule routing the variable to allgather, replicated, an explicit
  `sync: auto`, or Horovod's sparse_as_dense keeps the Keras variable; a rule's partitions and
  partition shape the moved table.
- Layers the shards cannot reproduce (a constraint, a subclass) and a loop that shows the
  optimizer the model only inside its traced step keep their variable with a warning naming
  the layer; code reading a moved layer's `.embeddings` gets an error naming it.
- Checkpoints: hybridsync.save_checkpoint / load_checkpoint and Horovod's rank-0
  model.save_weights / load_weights carry the moved table; the weights file loads into a plain
  Keras model. A checkpoint of moved tables loads into a fresh model right after compile()
  (before fit's callback or a step moves its layers), at another world size.
"""
import pytest

from tests.parallel.harness import rank_main, run_ranks, run_scenarios
from tests.parallel.test_tf_parity import DIM, LOCAL, ROWS, STEPS, _data, _my_rows, _optimizer

ROOT_SEED = 100  # rank r initialises its model from seed ROOT_SEED + r: the shards must take rank 0's


def _model(seed, sharded=False, **embedding_args):
    import keras

    import hybridsync.tensorflow as hvd

    keras.utils.set_random_seed(seed)
    ids = keras.Input(shape=(3,), dtype="int64", name="ids")
    layer = hvd.Embedding(ROWS, DIM, name="emb") if sharded else keras.layers.Embedding(ROWS, DIM, name="emb",
                                                                                         **embedding_args)
    x = keras.layers.Dense(5, activation="tanh", name="hidden")(keras.layers.Flatten()(layer(ids)))
    return keras.Model(ids, keras.layers.Dense(1, name="out")(x))


def _weights(model):
    """The table (read from the shards when it lives there), then hidden's and out's weights."""
    emb = model.get_layer("emb")
    table = emb.get_table() if hasattr(emb, "get_table") else emb.get_weights()[0]
    return [table] + [w for n in ("hidden", "out") for w in model.get_layer(n).get_weights()]


def _reference(name, size, initial):
    """One process, batch N*b, from `initial`, the gradients densified (the exact math)."""
    import tensorflow as tf

    model, opt = _model(0), _optimizer(name)
    model.set_weights(initial)
    ids, y = _data(size)
    batch = size * LOCAL
    for s in range(STEPS):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(ids[s * batch:(s + 1) * batch]) - y[s * batch:(s + 1) * batch]))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model.get_weights()


def _loop(model, opt, rank, size):
    """STEPS steps of this rank's share, in a tf.function GradientTape loop."""
    import tensorflow as tf

    ids, y = _my_rows(size, rank)

    @tf.function(jit_compile=False)
    def step(x, t):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - t))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    for s in range(STEPS):
        step(ids[s * LOCAL:(s + 1) * LOCAL], y[s * LOCAL:(s + 1) * LOCAL])


def _same(got, want, label):
    import numpy as np

    assert len(got) == len(want), (label, len(got), len(want))
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{label} (array {k})")


def _emb_row(opt):
    return {v.name: v for v in opt.plan.variables}["emb/embeddings"]


def rank_parity():
    import gc
    import weakref

    import keras
    import numpy as np

    import hybridsync
    import hybridsync.tensorflow.keras as hvd
    from hybridsync.tensorflow import barrier, broadcast_variables
    from hybridsync.tensorflow.keras_embeddings import ShardedKerasEmbedding

    rank, size = hybridsync.rank(), hybridsync.size()
    initial = _model(ROOT_SEED).get_weights()  # rank 0's model, as every rank can rebuild it
    for name in ("sgd", "adagrad"):
        want = _reference(name, size, initial)

        # model=: the table moves at wrap time; the script's loop is unchanged.
        model = _model(ROOT_SEED + rank)
        layer = model.get_layer("emb")
        old = weakref.ref(layer.embeddings.value)  # the layer's tf.Variable
        held = model.trainable_variables  # a list of the model's variables that a script keeps
        opt = hvd.DistributedOptimizer(_optimizer(name), model=model)
        gc.collect()
        assert isinstance(layer, ShardedKerasEmbedding) and isinstance(layer, keras.layers.Embedding)
        assert old() is None, "the moved layer's tf.Variable is still alive"
        assert tuple(held[0].shape) == (0, DIM), held[0].shape  # what the script held keeps no rows
        assert [tuple(v.shape) for v in layer.variables] == [(1,)]  # only its anchor
        assert all(tuple(v.shape) != (ROWS, DIM) for v in model.variables)
        np.testing.assert_array_equal(layer.get_table(), initial[0])  # rank 0's rows, on every rank
        broadcast_variables(model.variables, root_rank=0)  # Horovod's idiom, for the dense layers
        _loop(model, opt, rank, size)
        moved = _weights(model)
        _same(moved, want, f"{name}: moved by model= vs one process")
        row = _emb_row(opt)
        assert (row.route.value, row.placement.value, row.shards) == ("ps", "sharded", size), row
        assert row.reason.startswith("keras.layers.Embedding moved to the shards"), row.reason

        if name != "sgd":
            continue  # (the other paths once: they differ from model= in when the table moves, not in the rule)
        # model.fit with Horovod's callback, no model=: the callback hands the model over at train begin.
        model = _model(ROOT_SEED + rank)
        model.compile(optimizer=hvd.DistributedOptimizer(_optimizer(name)), loss="mse", jit_compile=False)
        ids, y = _my_rows(size, rank)
        model.fit(ids, y, batch_size=LOCAL, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        assert isinstance(model.get_layer("emb"), ShardedKerasEmbedding)
        assert (_emb_row(model.optimizer).route.value, _emb_row(model.optimizer).placement.value) == ("ps", "sharded")
        _same(_weights(model), want, f"{name}: moved by the callback (fit) vs one process")

        # The same model written with hybridsync's sharded layer, from the same start.
        model = _model(ROOT_SEED + rank, sharded=True)
        if rank == 0:
            model.get_layer("emb").set_table(initial[0])  # (one-sided: rank 0 writes every shard)
        barrier()
        for n, k in (("hidden", 1), ("out", 3)):
            model.get_layer(n).set_weights(initial[k:k + 2])
        _loop(model, hvd.DistributedOptimizer(_optimizer(name)), rank, size)
        _same(moved, _weights(model), f"{name}: moved vs hybridsync.tensorflow.Embedding")
        print(f"rank {rank}: a moved keras.layers.Embedding trains as the sharded layer and one process",
              flush=True)


def rank_config_keeps_the_variable(tmp):
    """A config rule (or Horovod's sparse_as_dense) that routes the table elsewhere keeps it a
    TensorFlow variable, without a warning, and the plan honours the rule."""
    import warnings

    import keras

    import hybridsync
    import hybridsync.tensorflow as hvd

    rank, size = hybridsync.rank(), hybridsync.size()
    cases = [({"config": {"variables": [{"match": "emb*", "sync": "allgather"}]}}, ("allgather", "-")),
             ({"config": {"variables": [{"match": "emb*", "placement": "replicated"}]}}, ("ps", "replicated")),
             ({"config": {"variables": [{"match": "emb*", "sync": "auto"}]}}, ("ps", "replicated")),
             ({"sparse_as_dense": True}, ("allreduce-as-dense", "-"))]
    for kwargs, route in cases:
        model = _model(ROOT_SEED)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = hvd.DistributedOptimizer(_optimizer("sgd"), model=model, **kwargs)
            _loop(model, opt, rank, size)
        assert type(model.get_layer("emb")) is keras.layers.Embedding, kwargs
        assert tuple(model.get_layer("emb").embeddings.shape) == (ROWS, DIM)
        row = _emb_row(opt)
        assert (row.route.value, row.placement.value) == route, (kwargs, row)
        assert not [w for w in caught if "stays a TensorFlow variable" in str(w.message)], kwargs

    # A rule that keeps the sharded PS but sets its layout: the moved table is made with it.
    model = _model(ROOT_SEED)
    config = {"variables": [{"match": "emb*", "partitions": 1, "partition": "block"}]}
    opt = hvd.DistributedOptimizer(_optimizer("sgd"), model=model, config=config)
    _loop(model, opt, rank, size)
    assert hasattr(model.get_layer("emb"), "table")
    row = _emb_row(opt)
    assert (row.placement.value, row.shards, row.partition) == ("sharded", 1, "block"), row
    assert model.get_layer("emb").table.layout == (1, "block")

    # A rule's storage (docs/storage.md) likewise: 16-bit rows and a disk tier, from rank 0's rows.
    import os

    import ml_dtypes
    import numpy as np

    model = _model(ROOT_SEED)
    initial = hvd.broadcast_object(model.get_layer("emb").get_weights()[0], root_rank=0)
    tier = os.path.join(tmp, f"rank{rank}", "moved-tier")  # (the test's own directory: nothing left behind)
    config = {"variables": [{"match": "emb*", "storage": {"dtype": "bfloat16", "memory_rows": 2 * size,
                                                          "path": tier}}]}
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.0), model=model, config=config)  # (rows stay put)
    _loop(model, opt, rank, size)
    stats = model.get_layer("emb").table.tier_stats()
    assert stats["dtype"] == "bfloat16" and stats["path"].startswith(tier), stats
    np.testing.assert_array_equal(model.get_layer("emb").get_table(), initial.astype(ml_dtypes.bfloat16).astype(np.float32))


def rank_kept_with_a_warning():
    """What the shards cannot do exactly keeps its variable, and rank 0 is told which layer and why."""
    import warnings

    import keras
    import numpy as np
    import pytest
    import tensorflow as tf

    import hybridsync
    import hybridsync.tensorflow as hvd

    rank, size = hybridsync.rank(), hybridsync.size()

    class Scaled(keras.layers.Embedding):  # a subclass: its lookup may differ
        def call(self, inputs):
            return 2.0 * super().call(inputs)

    def kept(make, why, model_arg=True):
        model = make()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = hvd.DistributedOptimizer(_optimizer("sgd"), **({"model": model} if model_arg else {}))
            _loop(model, opt, rank, size)
        assert not hasattr(model.get_layer("emb"), "table"), why
        said = [str(w.message) for w in caught if "stays a TensorFlow variable" in str(w.message)]
        if rank == 0:
            assert len(said) == 1 and "'emb'" in said[0] and why in said[0], (why, said)
        else:
            assert not said, said

    kept(lambda: _model(ROOT_SEED, embeddings_constraint="non_neg"), "embeddings_constraint")
    keras.utils.set_random_seed(1)
    ids = keras.Input(shape=(3,), dtype="int64", name="ids")
    kept(lambda: keras.Model(ids, keras.layers.Dense(1, name="out")(keras.layers.Flatten()(
        Scaled(ROWS, DIM, name="emb")(ids)))), "subclass")
    # A custom loop that never shows the optimizer the model: told at the first step.
    kept(lambda: _model(ROOT_SEED), "traced step", model_arg=False)

    # A moved layer: its variable is gone, and code reading it is told so; mask_zero still masks.
    model = _model(ROOT_SEED, mask_zero=True)
    hvd.DistributedOptimizer(_optimizer("sgd"), model=model)
    layer = model.get_layer("emb")
    with pytest.raises(AttributeError, match="layer 'emb'.*parameter server"):
        layer.embeddings
    ids = tf.constant([[0, 3, 5]], tf.int64)
    np.testing.assert_array_equal(layer.compute_mask(ids).numpy(), [[False, True, True]])
    np.testing.assert_array_equal(layer(ids).numpy()[0], layer.get_table()[[0, 3, 5]])
    with pytest.raises(TypeError, match="layer 'emb'.*SparseTensor"):
        layer.call(tf.SparseTensor([[0, 0]], tf.constant([1], tf.int64), [1, 3]))


def rank_checkpoints(tmp):
    """hybridsync's checkpoint and Horovod's rank-0 save_weights / load_weights carry the table."""
    import os

    import numpy as np

    import hybridsync
    import hybridsync.tensorflow as hvd

    rank, size = hybridsync.rank(), hybridsync.size()
    model = _model(ROOT_SEED + rank)
    opt = hvd.DistributedOptimizer(_optimizer("adagrad"), model=model)
    hvd.broadcast_variables(model.variables, root_rank=0)
    _loop(model, opt, rank, size)
    saved = _weights(model)
    slot = model.get_layer("emb").table.read(0)  # the server's Adagrad sums

    hybridsync.save_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
    weights_file = os.path.join(tmp, "model.weights.h5")
    if rank == 0:
        model.save_weights(weights_file)
    hvd.barrier()
    _loop(model, opt, rank, size)  # the table moves on
    assert not np.allclose(_weights(model)[0], saved[0])

    hybridsync.load_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
    _same(_weights(model), saved, "load_checkpoint")
    np.testing.assert_array_equal(model.get_layer("emb").table.read(0), slot)

    _loop(model, opt, rank, size)
    if rank == 0:  # Horovod's idiom: rank 0 loads, then the dense weights are broadcast
        model.load_weights(weights_file)
    hvd.barrier()
    hvd.broadcast_variables(model.variables, root_rank=0)
    _same(_weights(model), saved, "load_weights")

    plain = _model(0)  # the file is a Keras Embedding's: a model without hybridsync loads it
    plain.load_weights(weights_file)
    _same(_weights(plain), saved, "a plain Keras model loading the weights file")


def _fit_model(rank):
    """Horovod's Keras idiom: no model=, compile, the tables move when fit's callback runs."""
    import hybridsync.tensorflow as hvd

    model = _model(ROOT_SEED + rank)
    opt = hvd.DistributedOptimizer(_optimizer("adagrad"))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    return model, opt


def _fit(model, rank, size):
    import hybridsync.tensorflow as hvd

    ids, y = _my_rows(size, rank)
    model.fit(ids, y, batch_size=LOCAL, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])


def rank_save_fitted(tmp):
    """Trains with fit (tables moved by the callback), saves the checkpoint and its weights."""
    import os

    import numpy as np

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()
    model, opt = _fit_model(rank)
    _fit(model, rank, size)
    assert hasattr(model.get_layer("emb"), "ps_anchor")  # moved by the callback
    hybridsync.save_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
    if rank == 0:
        np.savez(os.path.join(tmp, "saved.npz"), *_weights(model))

    # A custom loop without model= keeps its table a variable (with a warning): so does its checkpoint.
    import warnings

    kept, opt = _fit_model(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _loop(kept, opt, rank, size)
    assert not hasattr(kept.get_layer("emb"), "ps_anchor")
    hybridsync.save_checkpoint(os.path.join(tmp, "kept"), kept, opt)
    if rank == 0:
        np.savez(os.path.join(tmp, "kept.npz"), *_weights(kept))


def rank_load_into_fresh_model(tmp):
    """A new process builds the same script's model and loads the checkpoint right after
    compile(), as docs/checkpoints-and-elastic.md says works: its layers are still plain Keras
    Embeddings, so the load moves those the checkpoint holds on the shards, as the callback
    would, then fills them; a table the saving run kept as a variable stays one."""
    import os

    import numpy as np

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()
    model, opt = _fit_model(rank)
    hybridsync.load_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
    saved = np.load(os.path.join(tmp, "saved.npz"))
    _same(_weights(model), [saved[f"arr_{k}"] for k in range(len(saved.files))], "load into a fresh model")
    _fit(model, rank, size)  # and training goes on from there

    kept, opt = _fit_model(rank)  # a checkpoint whose table stayed a variable: it stays one
    hybridsync.load_checkpoint(os.path.join(tmp, "kept"), kept, opt)
    assert not hasattr(kept.get_layer("emb"), "ps_anchor")
    saved = np.load(os.path.join(tmp, "kept.npz"))
    _same(_weights(kept), [saved[f"arr_{k}"] for k in range(len(saved.files))], "load of a kept table")


def rank_parity_what_stays_and_checkpoints(tmp):
    """At 2 ranks, one launch (starting ranks that import TensorFlow costs seconds each time):
    the parity, then what the config rules and warnings keep, then the checkpoints (re-sharding
    across world sizes: test_keras_composition.py). Each builds its own models."""
    rank_parity()
    rank_config_keeps_the_variable(tmp)
    rank_kept_with_a_warning()
    rank_checkpoints(tmp)


def test_moved_embedding_parity_at_one_rank():
    run_ranks(__file__, "rank_parity", 1)


def test_moved_embedding_parity_what_stays_checkpoints_and_a_fresh_model_at_another_world_size(tmp_path):
    """At 2 ranks: parity, what stays a Keras variable, checkpoints; then a fitted model saved. At
    3 ranks: parity, then the checkpoint loaded into a fresh model. Each launch builds models and
    optimizers before the save and the load, so Keras numbers their layers and optimizers
    differently in the two processes ('adagrad_2/...' saved, 'adagrad_4/...' loading): the load
    matches them without the numbers."""
    (tmp_path / "rules").mkdir()
    run_scenarios(__file__, 2, ("rank_parity_what_stays_and_checkpoints", str(tmp_path / "rules")),
                  ("rank_save_fitted", str(tmp_path)), timeout=400)
    run_scenarios(__file__, 3, "rank_parity", ("rank_load_into_fresh_model", str(tmp_path)), timeout=400)


if __name__ == "__main__":
    rank_main(globals())
