"""The TensorFlow frontend in one process: framework dispatch, clear errors (optimizers the PS
cannot apply, mixed-precision policies it cannot hold, PyTorch-only arguments), and the same
YAML giving the same routes for a PyTorch and a Keras model of the same shapes."""
import numpy as np
import pytest

import keras
import tensorflow as tf  # noqa: F401  (the Keras backend)
import torch

import hybridsync
import hybridsync.tensorflow as htf
import hybridsync.torch as htorch


def keras_model():
    keras.utils.set_random_seed(0)
    ids = keras.Input(shape=(2,), dtype="int64")
    x = keras.layers.Flatten()(keras.layers.Embedding(50, 4, name="emb")(ids))
    x = keras.layers.Dense(3, name="dense")(x)
    return keras.Model(ids, keras.layers.Dense(1, name="head")(x))


def fit_once(optimizer, model=None):
    model = model or keras_model()
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    model.fit(np.array([[1, 2], [3, 1]]), np.zeros((2, 1), "float32"), batch_size=2, epochs=1, verbose=0)
    return model


def test_keras_optimizer_dispatches_to_the_tf_frontend_and_keeps_its_identity():
    opt = keras.optimizers.SGD(0.1)
    wrapped = hybridsync.DistributedOptimizer(opt)
    assert wrapped is opt and isinstance(wrapped, keras.optimizers.SGD)
    with pytest.raises(ValueError, match="already a hybridsync DistributedOptimizer"):
        hybridsync.DistributedOptimizer(opt)


@pytest.mark.parametrize("make, message", [
    (lambda: keras.optimizers.RMSprop(0.1), "variable 'emb/embeddings': RMSprop is not supported"),
    (lambda: keras.optimizers.SGD(0.1, momentum=0.9), "variable 'emb/embeddings': SGD with momentum=0.9"),
    (lambda: keras.optimizers.Adam(0.1, amsgrad=True), "variable 'emb/embeddings': Adam with amsgrad=True"),
    (lambda: keras.optimizers.Adagrad(0.1, clipnorm=1.0), "variable 'emb/embeddings': Adagrad with clipnorm=1.0"),
])
def test_optimizers_the_ps_cannot_apply_are_errors_naming_them_and_the_variable(make, message):
    with pytest.raises(ValueError, match=message):
        fit_once(htf.DistributedOptimizer(make()))


def test_mixed_precision_policy_the_ps_cannot_hold_is_an_error():
    keras.mixed_precision.set_global_policy("float16")
    try:
        model = keras_model()
        with pytest.raises(ValueError, match=r"variable 'emb/embeddings' is float16 \(Keras mixed-precision policy "
                                             r"'float16'\): the parameter server holds float32 rows"):
            fit_once(htf.DistributedOptimizer(keras.optimizers.SGD(0.1)), model)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    keras.mixed_precision.set_global_policy("mixed_float16")  # float32 variables: fine
    try:
        fit_once(htf.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_pytorch_only_arguments_are_errors():
    with pytest.raises(ValueError, match="named_parameters is a PyTorch argument"):
        htf.DistributedOptimizer(keras.optimizers.SGD(0.1), named_parameters=[])
    with pytest.raises(TypeError, match="model must be a Keras model"):  # (model= moves its Keras Embeddings)
        htf.DistributedOptimizer(keras.optimizers.SGD(0.1), model=object())
    with pytest.raises(ValueError, match="backward_passes_per_step must be >= 1"):
        htf.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="backend='mpi'"):
        htf.DistributedOptimizer(keras.optimizers.SGD(0.1), backend="horovod")


def test_the_same_yaml_gives_the_same_routes_for_torch_and_keras(tmp_path):
    path = tmp_path / "hs.yaml"
    path.write_text("defaults:\n  sparse: {sync: ps, placement: replicated}\n"
                    "variables:\n  - match: 'emb*'\n    sync: ps\n    optimizer: {name: adagrad, lr: 0.2}\n"
                    "  - match: 'dense*'\n    compression: fp16\n  - match: 'head*'\n    sync: ps\n")
    tf_model = fit_once(htf.DistributedOptimizer(keras.optimizers.SGD(0.1), config=str(path)))
    torch_model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(50, 4, sparse=True), "dense": torch.nn.Linear(8, 3),
                                       "head": torch.nn.Linear(3, 1)})
    torch_opt = htorch.DistributedOptimizer(torch.optim.SGD(torch_model.parameters(), lr=0.1),
                                            named_parameters=torch_model.named_parameters(), config=str(path))
    torch_model["emb"](torch.tensor([1, 2])).sum().backward()  # without a model, kinds show at the first backward
    torch_opt.synchronize()
    layer = lambda name: name.replace("/", ".").split(".")[0]
    kind_of = {"embeddings": "weight", "kernel": "weight", "weight": "weight", "bias": "bias"}

    def routes(plan):
        return sorted((layer(v.name), kind_of[v.name.replace("/", ".").split(".")[-1]], v.kind.value, v.route.value,
                       v.placement.value, v.shards, v.compression, (v.optimizer or {}).get("name"))
                      for v in plan.variables)

    assert routes(tf_model.optimizer.plan) == routes(torch_opt.plan)
    assert ("emb", "weight", "sparse", "ps", "replicated", 1, "none", "adagrad") in routes(torch_opt.plan)
    assert ("head", "bias", "dense", "ps", "replicated", 1, "none", "sgd") in routes(torch_opt.plan)
    text = hybridsync.explain(file=open("/dev/null", "w"))
    assert "tensorflow" in text and "torch" in text


def test_ps_backed_keras_layer_trains_and_round_trips_through_save_weights(tmp_path):
    def build(seed):
        keras.utils.set_random_seed(seed)
        ids = keras.Input(shape=(2,), dtype="int64")
        x = keras.layers.Flatten()(htf.Embedding(50, 4, name="table")(ids))
        return keras.Model(ids, keras.layers.Dense(1, name="head")(x))

    model = build(0)
    before = model.get_layer("table").get_table().copy()
    fit_once(htf.DistributedOptimizer(keras.optimizers.Adagrad(0.5)), model)
    trained = model.get_layer("table").get_table()
    assert sorted(np.flatnonzero((trained != before).any(1)).tolist()) == [1, 2, 3]
    row = {v.name: v for v in model.optimizer.plan.variables}["table/embeddings"]
    assert (row.route.value, row.placement.value, row.optimizer["name"]) == ("ps", "sharded", "adagrad")
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    other = build(1)
    assert not np.array_equal(other.get_layer("table").get_table(), trained)
    other.load_weights(path)
    np.testing.assert_array_equal(other.get_layer("table").get_table(), trained)
    np.testing.assert_array_equal(other.get_layer("head").get_weights()[0], model.get_layer("head").get_weights()[0])


# Every public name of Horovod 0.28.1's horovod.tensorflow, horovod.tensorflow.keras (and its
# callbacks and elastic modules) and horovod.keras, as their __init__ files define or import them.
HOROVOD_TENSORFLOW = (
    "elastic Compression allgather_object broadcast_object broadcast_object_fn broadcast_variables allgather "
    "grouped_allgather broadcast broadcast_ _allreduce _grouped_allreduce alltoall _reducescatter "
    "_grouped_reducescatter init shutdown is_initialized start_timeline stop_timeline size local_size cross_size "
    "rank local_rank cross_rank is_homogeneous rank_op local_rank_op size_op local_size_op process_set_included_op "
    "mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built cuda_built "
    "rocm_built ProcessSet global_process_set add_process_set remove_process_set Average Sum Adasum Min Max Product "
    "handle_average_backwards_compatibility check_num_rank_power_of_2 _executing_eagerly _make_subgraph _cache "
    "vars_to_refs refs_to_vars join SyncBatchNormalization LocalGradientAggregationHelper allreduce reducescatter "
    "grouped_allreduce grouped_reducescatter broadcast_global_variables BroadcastGlobalVariablesHook "
    "DistributedOptimizer DistributedGradientTape PartialDistributedGradientTape").split()
HOROVOD_KERAS = (
    "init shutdown is_initialized start_timeline stop_timeline size local_size cross_size rank local_rank "
    "cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built ProcessSet global_process_set "
    "add_process_set remove_process_set nccl_built ddl_built ccl_built cuda_built rocm_built Average Sum Adasum "
    "Compression callbacks elastic DistributedOptimizer PartialDistributedOptimizer broadcast_global_variables "
    "allreduce allgather broadcast reducescatter load_model").split()
HOROVOD_KERAS_CALLBACKS = ("BroadcastGlobalVariablesCallback MetricAverageCallback LearningRateScheduleCallback "
                           "LearningRateWarmupCallback BestModelCheckpoint").split()
HOROVOD_KERAS_ELASTIC = "KerasState CommitStateCallback UpdateBatchStateCallback UpdateEpochStateCallback run".split()


def test_every_public_name_of_horovods_tensorflow_and_keras_modules_is_here():
    import inspect

    import hybridsync.keras
    import hybridsync.tensorflow.keras as htk

    missing = [n for n in HOROVOD_TENSORFLOW if not hasattr(htf, n)]
    missing += [f"keras.{n}" for n in HOROVOD_KERAS for module in (htk, hybridsync.keras) if not hasattr(module, n)]
    missing += [f"keras.callbacks.{n}" for n in HOROVOD_KERAS_CALLBACKS if not hasattr(htk.callbacks, n)]
    missing += [f"keras.elastic.{n}" for n in HOROVOD_KERAS_ELASTIC if not hasattr(htk.elastic, n)]
    missing += [f"elastic.{n}" for n in ("TensorFlowKerasState", "TensorFlowState", "run") if not hasattr(htf.elastic, n)]
    assert not missing
    assert htf.util._executing_eagerly() and hybridsync.keras.callbacks.BestModelCheckpoint is htk.callbacks.BestModelCheckpoint

    def positional(fn):
        return [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]

    # Horovod's arguments in Horovod's order; hybridsync's own are keyword-only after them.
    assert positional(htk.DistributedOptimizer) == [
        "optimizer", "name", "device_dense", "device_sparse", "compression", "sparse_as_dense",
        "gradient_predivide_factor", "op", "backward_passes_per_step", "average_aggregated_gradients", "num_groups",
        "groups", "process_set", "scale_local_gradients"]
    assert positional(htf.DistributedOptimizer) == [
        "optimizer", "name", "use_locking", "device_dense", "device_sparse", "compression", "sparse_as_dense",
        "backward_passes_per_step", "op", "gradient_predivide_factor", "average_aggregated_gradients", "num_groups",
        "groups", "process_set", "scale_local_gradients"]
    assert positional(htf.DistributedGradientTape) == [
        "gradtape", "device_dense", "device_sparse", "compression", "sparse_as_dense", "op",
        "gradient_predivide_factor", "num_groups", "groups", "process_set", "scale_local_gradients"]
    assert positional(htk.load_model) == ["filepath", "custom_optimizers", "custom_objects", "compression",
                                          "legacy_opts"]
    assert positional(htk.callbacks.LearningRateWarmupCallback.__init__)[1:] == [
        "initial_lr", "warmup_epochs", "momentum_correction", "steps_per_epoch", "verbose"]


def test_horovod_names_keras_3_cannot_honour_say_why():
    import hybridsync.tensorflow.keras as htk

    with pytest.raises(NotImplementedError, match="backward_passes_per_step"):
        htf.LocalGradientAggregationHelper(2, None, False, False)
    with pytest.raises(NotImplementedError, match="TensorFlow 1 optimizer"):
        htf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(RuntimeError, match="does not support eager execution"):
        htf.broadcast_global_variables(0)
    with pytest.raises(NotImplementedError, match="keras.optimizers.legacy"):
        htk.load_model("unused.keras", legacy_opts=True)
    with pytest.raises(ValueError, match="does not support fused=True"):
        htf.SyncBatchNormalization(fused=True)
    with pytest.raises(ValueError, match="set its filepath"):
        htk.callbacks.BestModelCheckpoint().on_train_begin()


def test_keras_2_idioms_of_horovods_examples_work_on_keras_3():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", experimental_run_tf_function=False)  # Horovod's examples pass it
    with pytest.raises(TypeError, match="unexpected keyword"):
        model.compile(optimizer="sgd", loss="mse", not_a_keyword=1)
    opt = keras.optimizers.SGD(0.1)
    assert opt.variables() == opt.variables and isinstance(opt.variables, list)
    v = model.trainable_weights[0]
    assert v.ref() == v.ref() and v.ref().deref() is v and {v.ref(): 1}[model.trainable_weights[0].ref()] == 1


def test_gradient_tape_keeps_horovods_class_and_local_sources_in_a_world_of_one():
    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x * x)
    dtape = htf.DistributedGradientTape(tape, compression=htf.Compression.fp16, sparse_as_dense=True)
    assert isinstance(dtape, tf.GradientTape)
    dtape.register_local_source(x)
    np.testing.assert_allclose(dtape.gradient(loss, [x])[0].numpy(), [2.0, 4.0])


@pytest.mark.parametrize("config", [{"variables": [{"match": "kst*", "storage": {"dtype": "float16"}}]},
                                    {"defaults": {"sparse": {"storage": {"dtype": "bfloat16"}}}}])
def test_a_config_storage_other_than_a_keras_ps_layers_is_an_error(config):
    """A Keras PS layer's table exists (in its graph) before the plan, so the config cannot give
    it another storage: an error naming the rule or defaults.sparse, not a plan that says float16
    over a table that stores float32."""
    keras.utils.set_random_seed(0)
    ids = keras.Input(shape=(2,), dtype="int64")
    x = keras.layers.Flatten()(htf.Embedding(20, 4, name="kst")(ids))
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(x))
    with pytest.raises(hybridsync.ConfigError, match=r"storage: variable 'kst.*': a Keras PS layer's table exists"):
        fit_once(htf.DistributedOptimizer(keras.optimizers.SGD(0.1), config=config), model)


def test_a_checkpoints_keras_names_are_matched_without_the_numbers_keras_adds():
    """A model built again in one process gets other Keras numbers ('sequential_1/dense_1/...',
    'adagrad_1/...'): the checkpoint's names map onto this model's position by position -- its
    plan, its tables and the adaptive batch's statistics -- even where a saved name exists here
    on another layer; where the sequences differ beyond the numbers nothing is renamed."""
    import copy

    from hybridsync.tensorflow import checkpointing

    assert checkpointing._unnumbered("adagrad_2/sequential_1_dense_12_kernel_accumulator") == \
        "adagrad/sequential_dense_kernel_accumulator"
    assert checkpointing._unnumbered("model.3.block_2/conv_3x3/kernel") == "model.3.block/conv_3x3/kernel"

    def build():
        model = keras.Sequential([keras.layers.Embedding(10, 4), keras.layers.Dense(3), keras.layers.Dense(2)])
        model.build((None, 2))
        return model

    saved_model, model = build(), build()
    saved = [v.path for v in saved_model.trainable_variables]
    mine = [v.path for v in model.trainable_variables]
    assert saved != mine  # (Keras numbered the second model's layers)

    def manifest_of(names):
        return {"plan": {"variables": [{"name": n, "auto": {"route": "ps"}} for n in names]},
                "tables": [{"variable": names[0]}],
                "dense": {"meta": {"adaptive": {"stats": {"by_variable": {n: k for k, n in enumerate(names)},
                                                          "steady": {names[1]: 1}},
                                                "rows": {"counts": {names[0]: {}}, "duplicates": {names[0]: 2.0}}}}}}

    manifest = manifest_of(saved)
    checkpointing._rename_as_saved(model, manifest)
    assert [v["name"] for v in manifest["plan"]["variables"]] == mine
    assert [t["variable"] for t in manifest["tables"]] == [mine[0]]
    state = manifest["dense"]["meta"]["adaptive"]
    assert state["stats"]["by_variable"] == {n: k for k, n in enumerate(mine)}
    assert state["stats"]["steady"] == {mine[1]: 1} and state["rows"]["duplicates"] == {mine[0]: 2.0}

    # The saving process had built more layers first: its second Dense has the name this model's
    # first Dense has. Position decides, not the name.
    layers = [name.split("/")[1] for name in mine]  # embedding, dense, dense, dense', dense'
    as_saved = {layers[1]: layers[3], layers[3]: "dense_999"}
    shifted = [name.replace(f"/{layers[i]}/", f"/{as_saved.get(layers[i], layers[i])}/") for i, name in enumerate(mine)]
    assert shifted[1] == mine[3] and shifted != mine
    manifest = manifest_of(shifted)
    checkpointing._rename_as_saved(model, manifest)
    assert [v["name"] for v in manifest["plan"]["variables"]] == mine

    # Another model (one variable more): nothing renamed, the load reports what differs.
    manifest = manifest_of(saved + ["sequential/dense_9/kernel"])
    before = copy.deepcopy(manifest)
    checkpointing._rename_as_saved(model, manifest)
    assert manifest == before
