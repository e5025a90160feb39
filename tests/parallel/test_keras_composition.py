"""Every feature the Keras frontend has, at once, on one Keras 3 model, at world sizes 1, 2 and 3.

The Keras twin of test_composition.py. One functional Keras model holds a sharded
`hybridsync.tensorflow.Embedding` (fixed table), a `hybridsync.tensorflow.DynamicEmbedding`
(admission, LRU eviction, TTL expiry, bags with duplicate ids), a second sharded table with
`staleness: 2` and an SGD server rule in the YAML config (its rows mostly in a disk tier), a plain
`keras.layers.Embedding` routed `allreduce-as-dense`, a plain `keras.layers.Embedding` that
`DistributedOptimizer(..., model=model)` moves onto the shards (Keras's default made the sharded
layer) and Dense layers, under one `DistributedOptimizer(keras.optimizers.Adagrad)` with
`adaptive={"scaling_rule": "auto"}`, trained in a `tf.function` GradientTape loop. Job 1
trains it with `AdaptiveDataset` (accumulation allowed), commits and restores an
`hvd.elastic.KerasState`, runs uneven data into `hvd.join()`, trains on adaptively, then saves
`hybridsync.save_checkpoint` and `model.save()` (rank 0, Horovod's idiom). Job 2, at another world
size (1->2, 2->3, 3->1), loads `hvd.load_model()` (the dense weights and every table's rows equal
what job 1 saved) and then `hybridsync.load_checkpoint` (everything equal, bit for bit: every
table's rows and server slots and step, the dynamic table's entries with their counters, the
Keras optimizer's variables; the adaptive statistics, step count and progress), and trains on
with the adaptive dataset. After `join()` every rank's adaptive state is the same.

Parity: a one-process plain-Keras reference (keras.layers.Embedding for the three fixed-size
tables, Keras Adagrad on densified gradients -- which moves exactly the rows a lazy server rule
moves -- and Keras SGD for the stale table; the dict model of tests/dynamic_reference.py for the
dynamic table, on as many shards as the job had) replays the steps both jobs logged -- which
samples each step took and the divisor of their losses -- and every weight, table row, server
slot, optimizer variable and dynamic entry must agree within 1e-5. The stale table takes part:
its gradient does not depend on the rows it reads (they only shift the loss), and its SGD rule
sums pushes in any order, so the bound changes what a pull reads but not where the table ends.

Dense backends: the Keras frontend always all-reduces over MPI (its plan says so; `backend=` other
than 'mpi' is a ValueError), but HYBRIDSYNC_BACKEND=horovod is accepted by a Keras job (it picks
the backend of PyTorch's optimizers), so both settings run here: a Keras job must train the same
under either.

Not here, because the Keras frontend lacks it: skipping a non-finite step (PyTorch's
`synchronize()` / `skip_synchronize()` GradScaler idiom has no Keras counterpart).
"""
from __future__ import annotations

import json
import os

import pytest

from tests.parallel.harness import rank_main, run_ranks

DIM, FIXED_ROWS, STALE_ROWS, SMALL_ROWS = 4, 40, 30, 20
DENSE_IN, SAMPLES, BASE_BATCH = 3, 72, 6  # 6 divides over 1, 2 and 3 ranks
LR, STALE_LR = 0.1, 0.05
DYN = dict(capacity=24, evict="lru", ttl_steps=6, admit_after=2, mode="sum", seed=7)
BAG = 3  # ids per bag
CONFIG = {"variables": [
    {"match": "stale*", "staleness": 2, "optimizer": {"name": "sgd", "lr": STALE_LR}},
    {"match": "small*", "sync": "allreduce-as-dense"},
]}
TABLES = ("fixed", "stale", "moved")  # the sharded fixed-size tables ("moved": a keras.layers.Embedding)
# The stale table keeps only a few rows in memory, the rest in a disk tier (docs/storage.md): the
# same numbers as all in memory, so the parity below covers it (as in test_composition.py).
TIER_DIR = os.path.join(os.environ.get("TMPDIR", "/tmp"), "hybridsync-keras-composition-tiers")
STALE_STORAGE = {"memory_rows": 6, "path": TIER_DIR}


# -- the model and its data -------------------------------------------------------------------------
def _pool():
    """Raw int64 ids of the dynamic table: the extremes, -1, and hashes from the whole range."""
    import numpy as np

    rng = np.random.default_rng(3)
    drawn = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=37, dtype=np.int64)
    return np.concatenate([[np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1], drawn]).astype(np.int64)


def _data(seed: int, n: int = SAMPLES):
    """(index, dense, fixed id, stale id, small id, dynamic bag, label) columns of n samples."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = _pool()
    bag = pool[np.minimum(rng.zipf(1.3, (n, BAG)) - 1, len(pool) - 1)]
    bag[::5, 1] = bag[::5, 0]  # duplicate ids inside a bag
    return (np.arange(n, dtype=np.int64) + seed * 10_000, rng.standard_normal((n, DENSE_IN)).astype(np.float32),
            rng.integers(0, FIXED_ROWS, n), rng.integers(0, STALE_ROWS, n), rng.integers(0, SMALL_ROWS, n),
            np.ascontiguousarray(bag), rng.standard_normal(n).astype(np.float32))


def _head(keras, parts, stale_rows):
    """The Dense part: an MLP over the concatenated features, and the stale table's shift."""
    x = keras.layers.Concatenate(name="features")(parts)
    out = keras.layers.Dense(1, name="out")(keras.layers.Dense(8, activation="tanh", name="hidden")(x))
    # The stale table's rows shift the loss but never another gradient: its gradient is this
    # frozen kernel, so a pull that misses steps changes nothing it trains.
    shift = keras.layers.Dense(1, use_bias=False, trainable=False, name="stale_weight",
                               kernel_initializer=keras.initializers.RandomNormal(seed=5))(stale_rows)
    return out, shift


def _inputs(keras):
    return (keras.Input((DENSE_IN,), name="dense"), keras.Input((), dtype="int64", name="fixed_ids"),
            keras.Input((), dtype="int64", name="stale_ids"), keras.Input((), dtype="int64", name="small_ids"))


def _model():
    """The model as a Keras user writes it with hybridsync's layers."""
    import keras

    import hybridsync.tensorflow as htf

    keras.utils.set_random_seed(0)
    dense, fixed, stale, small = _inputs(keras)
    bag = keras.Input((BAG,), dtype="int64", name="bag")
    uniform = ("uniform", -1.0, 1.0)
    parts = [dense, htf.Embedding(FIXED_ROWS, DIM, name="fixed", initializer=uniform)(fixed),
             keras.layers.Embedding(SMALL_ROWS, DIM, name="small",
                                    embeddings_initializer=keras.initializers.RandomUniform(-1, 1))(small),
             # A plain Keras table (on the fixed table's ids) that the optimizer moves to the shards.
             keras.layers.Embedding(FIXED_ROWS, DIM, name="moved",
                                    embeddings_initializer=keras.initializers.RandomUniform(-1, 1))(fixed),
             htf.DynamicEmbedding(DIM, name="dyn", **DYN)(bag)]
    os.makedirs(TIER_DIR, exist_ok=True)
    stale_table = htf.Embedding(STALE_ROWS, DIM, name="stale", initializer=uniform, storage=STALE_STORAGE)
    out, shift = _head(keras, parts, stale_table(stale))
    return keras.Model([dense, fixed, stale, small, bag], [out, shift])


def _wrap(model):
    import keras

    import hybridsync.tensorflow.keras as hvd
    from hybridsync.tensorflow.keras_embeddings import ShardedKerasEmbedding

    opt = hvd.DistributedOptimizer(keras.optimizers.Adagrad(LR), config=CONFIG, adaptive={"scaling_rule": "auto", "rescale_accumulators": "auto"},
                                   model=model)
    assert isinstance(model.get_layer("moved"), ShardedKerasEmbedding)
    assert type(model.get_layer("small")) is keras.layers.Embedding  # its config rule keeps it (allreduce-as-dense)
    # Keras's Adagrad at its unscaled LR ('auto') gets the square-root statistical efficiency too
    assert opt.adaptive.efficiency_model == "sqrt", opt.adaptive.efficiency_reason
    model.compile(optimizer=opt)  # (so that model.save() keeps the optimizer)
    return opt


def _stepper(model, opt):
    """One apply() of a (micro-)batch, loss = (sum of its samples' losses) / divisor; traced once
    per batch shape."""
    import tensorflow as tf

    @tf.function(reduce_retracing=True)
    def step(dense, fixed, stale, small, bag, label, divisor):
        with tf.GradientTape() as tape:
            out, shift = model([dense, fixed, stale, small, bag])
            loss = (tf.reduce_sum(tf.square(out[:, 0] - label)) + tf.reduce_sum(shift)) / divisor
        variables = model.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    return lambda batch, divisor: step(*batch[1:], tf.constant(divisor, tf.float32))


# -- what a run logs, and the snapshot of everything it holds ------------------------------------------
class Log:
    """Per optimizer step: the global sample indices it took and the divisor of their losses."""

    def __init__(self, steps=None):
        self.steps = steps or []

    def add(self, my_indices, divisor, ranks=None, rescale=None):
        """rescale: the factor the step rescaled the Adagrad accumulators by (a batch change)."""
        import hybridsync.tensorflow as htf

        everyone = htf.allgather_object([int(i) for i in my_indices])
        self.steps.append({"indices": sorted(i for part in everyone for i in part), "divisor": float(divisor),
                           "world": htf.size(), "ranks": ranks or htf.size(),
                           **({"rescale": rescale} if rescale is not None else {})})


def _gather_shards(table):
    """A dynamic table's stored entries from every shard, by id (world-size independent)."""
    import hybridsync.tensorflow as htf

    out = {}
    for part in htf.allgather_object({k: v.tolist() for k, v in table.shard_state().items()}):
        for n, i in enumerate(part["ids"]):
            out[f"row.{i}"] = part["rows"][n]
            out[f"count.{i}"] = part["counts"][n]
            out[f"last.{i}"] = part["last_touch"][n]
            for key in part:
                if key.startswith("slot."):
                    out[f"{key}.{i}"] = part[key][n]
        for n, i in enumerate(part["pending_ids"]):
            out[f"pending.{i}"] = (part["pending_counts"][n], part["pending_last"][n])
    return out


def _snapshot(model, opt, dynamic=True) -> dict:
    """Every model and optimizer variable, every sharded table's rows, server slots and step, and
    the dynamic table's entries with their counters (collective)."""
    import numpy as np

    import hybridsync.tensorflow.keras as hvd

    hvd.barrier()  # the bounded table's pushes still in flight land first (docs/staleness.md)
    snap = {f"param.{v.path}": np.array(v.numpy()) for v in model.variables}
    snap.update({f"opt.{v.path}": np.array(v.numpy()) for v in opt.variables})
    for name in TABLES:
        table = model.get_layer(name).table
        snap[f"table.{name}.rows"] = table.read()
        for k, slot in enumerate(table.slot_names):
            snap[f"table.{name}.slot.{slot}"] = table.read(k)
        snap[f"table.{name}.step"] = np.asarray(table.step)
    if dynamic:
        dyn = model.get_layer("dyn").table
        snap.update({f"dyn.{key}": np.asarray(value) for key, value in _gather_shards(dyn).items()})
        snap["dyn.step"] = np.asarray(dyn.step)
    return snap


def _assert_same(got: dict, want: dict, what: str, exact=True, keys=None):
    import numpy as np

    if keys is None:
        assert sorted(got) == sorted(want), (what, "only got:", sorted(set(got) - set(want))[:8],
                                             "only wanted:", sorted(set(want) - set(got))[:8])
    for key in keys or want:
        if exact:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")
        else:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"{what}: {key}")


# -- the reference --------------------------------------------------------------------------------
def _samples():
    """Every sample any job draws, by its index."""
    out = {}
    for seed, n in ((1, SAMPLES), (3, 2 * 2 * 3 * 3), (4, SAMPLES), (6, SAMPLES // 2)):
        cols = _data(seed, n)
        for pos in range(n):
            out[int(cols[0][pos])] = tuple(c[pos] for c in cols)
    return out


def _reshard(table, shards):
    """The reference dynamic table's entries moved to `shards` shards (a load at another world size)."""
    from hybridsync.ps import dynamic_options as dyn
    from tests.dynamic_reference import ReferenceTable

    new = ReferenceTable(table.dim, shards, table.capacity, table.admit_after, table.evict, table.ttl, table.seed,
                         table.initializer, (table.rule, table.hp))
    new.step = table.step
    for old in table.shard:
        for key in ("rows", "slots", "count", "last", "pending"):
            for i, value in old[key].items():
                new.shard[int(dyn.hash_shard([i], shards)[0])][key][i] = value
    return new


def _plain_model():
    """The reference: plain keras.layers.Embedding for every fixed-size table, the dynamic
    table's bags an input (their rows come from the dict model)."""
    import keras

    dense, fixed, stale, small = _inputs(keras)
    bags = keras.Input((DIM,), name="bag_rows")
    parts = [dense, keras.layers.Embedding(FIXED_ROWS, DIM, name="fixed")(fixed),
             keras.layers.Embedding(SMALL_ROWS, DIM, name="small")(small),
             keras.layers.Embedding(FIXED_ROWS, DIM, name="moved")(fixed), bags]
    out, shift = _head(keras, parts, keras.layers.Embedding(STALE_ROWS, DIM, name="stale")(stale))
    return keras.Model([dense, fixed, stale, small, bags], [out, shift])


def _replay(initial: dict, steps: list):
    """One process replays the logged steps: (plain Keras model, its Adagrad, the dynamic table)."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tests.dynamic_reference import ReferenceTable

    ref = _plain_model()
    for v in ref.variables:
        v.assign(initial[v.path])
    adagrad, sgd = keras.optimizers.Adagrad(LR, name="adagrad"), keras.optimizers.SGD(STALE_LR)  # (named: the same paths)
    rule = ("adagrad", {"lr": LR, "initial_accumulator_value": adagrad.initial_accumulator_value,
                        "eps": adagrad.epsilon})  # (Keras puts eps inside the root: 1e-7 of a root >= 0.3)
    options = {k: v for k, v in DYN.items() if k in ("capacity", "evict", "ttl_steps", "admit_after", "seed")}
    table, samples = None, _samples()
    for step in steps:
        if table is None or table.shards != step["world"]:
            table = (ReferenceTable(DIM, step["world"], rule=rule, **options) if table is None
                     else _reshard(table, step["world"]))
        _, dense, fixed, stale, small, bag, label = (np.stack([samples[i][c] for i in step["indices"]])
                                                     for c in range(7))
        unique, inverse = np.unique(bag, return_inverse=True)
        rows = tf.Variable(table.rows(unique).astype(np.float32))
        with tf.GradientTape() as tape:
            bags = tf.reduce_sum(tf.gather(rows, inverse.reshape(bag.shape)), axis=1)
            out, shift = ref([tf.constant(dense), tf.constant(fixed), tf.constant(stale), tf.constant(small), bags])
            loss = (tf.reduce_sum(tf.square(out[:, 0] - label)) + tf.reduce_sum(shift)) / step["divisor"]
        trained = ref.trainable_variables
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, trained + [rows])]  # densified
        stale_at = [n for n, v in enumerate(trained) if v.path.startswith("stale/")]
        if "rescale" in step:  # a batch change took effect: what was accumulated above the initial value
            f, init = np.float32(step["rescale"]), np.float32(adagrad.initial_accumulator_value)
            adagrad.build([v for n, v in enumerate(trained) if n not in stale_at])
            for acc in adagrad._accumulators:
                v = acc.numpy()
                acc.assign(np.where(v == init, v, (v - init) * f + init))
            for shard in table.shard:
                for slots in shard["slots"].values():
                    slots[0] = np.where(slots[0] == init, slots[0], (slots[0] - init) * f + init)
        adagrad.apply_gradients([(g, v) for n, (g, v) in enumerate(zip(grads, trained)) if n not in stale_at])
        sgd.apply_gradients([(grads[n], trained[n]) for n in stale_at])
        table.push({int(i): grads[-1][n].numpy().astype(np.float64) for n, i in enumerate(unique)})
    return ref, adagrad, table


def _check_parity(initial: dict, steps: list, snap: dict) -> None:
    """Everything the distributed run holds equals the one-process replay of its steps."""
    import numpy as np

    ref, adagrad, table = _replay(initial, steps)
    want = {}
    for v in ref.variables:
        name = v.path.split("/")[0]
        if name in TABLES:
            want[f"table.{name}.rows"] = v.numpy()
            want[f"param.{name}/ps_anchor"] = np.zeros(1, np.float32)  # the anchors never move
        else:
            want[f"param.{v.path}"] = v.numpy()
    want["param.dyn/ps_anchor"] = np.zeros(1, np.float32)
    for v in adagrad.variables:
        if v.path in ("adagrad/fixed_embeddings_accumulator", "adagrad/moved_embeddings_accumulator"):
            want[f"table.{v.path.split('/')[1].split('_')[0]}.slot.sum"] = v.numpy()
        elif v.path == "adagrad/iteration":
            want["opt.adagrad/iteration"] = np.asarray(len(steps))
        else:
            want[f"opt.{v.path}"] = v.numpy()
    want["table.fixed.step"] = want["table.moved.step"] = np.asarray(len(steps))
    # A bounded table's rule applies each rank's push on its own: its step counts pushes.
    want["table.stale.step"] = np.asarray(sum(step["ranks"] for step in steps))
    want["dyn.step"] = np.asarray(table.step)
    for shard in table.shard:
        for i, row in shard["rows"].items():
            want[f"dyn.row.{i}"] = row
            want[f"dyn.slot.sum.{i}"] = shard["slots"][i][0]
            want[f"dyn.count.{i}"] = np.asarray(shard["count"][i])
            want[f"dyn.last.{i}"] = np.asarray(shard["last"][i])
        for i, pending in shard["pending"].items():
            want[f"dyn.pending.{i}"] = np.asarray(pending)
    _assert_same(snap, want, f"parity with one process after {len(steps)} steps", exact=False)


# -- the jobs ---------------------------------------------------------------------------------------
def _adaptive_epoch(model, opt, step, data, log, seed):
    """One epoch of the AdaptiveDataset (accumulation allowed); every step logged."""
    import hybridsync.tensorflow as htf

    dataset = htf.AdaptiveDataset(data, batch_size=BASE_BATCH, optimizer=opt, seed=seed, interval=2, warmup=2)
    dataset.autoscale_batch_size(4 * BASE_BATCH, local_bsz_bounds=(1, BASE_BATCH), gradient_accumulation=True,
                                 max_accumulation=2)
    taken, micro, steps = [], 0, opt.adaptive.steps
    for batch in dataset:
        b = len(batch[0])
        step(batch, b)  # a micro-batch's mean: the optimizer averages micro-steps and ranks
        taken += batch[0].tolist()
        micro += 1
        if opt.adaptive.steps != steps:  # the step's last micro-step
            # (the rescale a batch change applied at this step, if any: the replay applies it too)
            rescale = [r["factor"] for r in opt.adaptive.accumulators.log if r["step"] == steps and r["applied"]]
            steps = opt.adaptive.steps
            log.add(taken, b * micro * htf.size(), rescale=rescale[0] if rescale else None)
            taken, micro = [], 0
    assert not taken, "the adaptive epoch ended inside a step"
    assert opt.adaptive.accumulators.enabled  # Keras Adagrad at an unscaled LR: batch changes rescale
    if htf.rank() == 0:  # (what the batch did: the controller decides from measured times)
        print(f"adaptive batch: (step, local batch, micro-steps) changes {dataset.changes}; rescales "
              f"{[(r['step'], r['from'], r['to'], r['factor']) for r in opt.adaptive.accumulators.log]}", flush=True)


def _elastic_round_trip(model, opt, step):
    import hybridsync.tensorflow.keras as hvd

    rank, size = hvd.rank(), hvd.size()
    state = hvd.elastic.KerasState(model, opt, batch=0)
    state.commit()
    committed = _snapshot(model, opt)
    extra = _data(seed=2, n=4 * size * opt.adaptive.accumulation)
    for s in range(2 * opt.adaptive.accumulation):  # two whole steps
        step([c[s * 2 * size + rank * 2: s * 2 * size + rank * 2 + 2] for c in extra], 2)
    assert _snapshot(model, opt, dynamic=False)["table.fixed.step"] != committed["table.fixed.step"]
    state.restore()
    _assert_same(_snapshot(model, opt), committed, "elastic restore")


def rank_job1(tmp):
    import numpy as np

    import hybridsync
    import hybridsync.tensorflow as htf

    rank, size = htf.rank(), htf.size()
    model = _model()
    opt = _wrap(model)
    htf.broadcast_variables(model.variables, root_rank=0)
    if rank == 0:  # what the one-process reference starts from
        initial = {v.path: v.numpy() for v in model.variables}
        initial.update({f"{name}/embeddings": model.get_layer(name).get_table() for name in TABLES})
        np.savez(os.path.join(tmp, "initial.npz"), **initial)
    step = _stepper(model, opt)
    log = Log()

    # 1. The adaptive batch, with accumulation allowed, over one epoch.
    _adaptive_epoch(model, opt, step, _data(seed=1), log, seed=5)

    # 2. An elastic commit, more training, a restore: everything is back at the commit.
    _elastic_round_trip(model, opt, step)

    # 3. Uneven data: rank r has r + 1 more steps, then joins; the last rank takes every step. Each
    #    step is as many micro-batches as the adaptive batch has.
    k = opt.adaptive.accumulation
    uneven = _data(seed=3, n=2 * 2 * 3 * 3)  # enough for 3 ranks and 2 micro-steps
    at = lambda s, r, m: (((s * size + r) * k + m) * 2)  # the first sample of a micro-batch
    for s in range(rank + 1):
        for m in range(k):
            step([c[at(s, rank, m):at(s, rank, m) + 2] for c in uneven], 2)
    last = int(htf.join())
    assert last == size - 1, last
    for s in range(size):  # step s took the batches of the ranks still stepping; joined ones count as zeros
        rows = [at(s, r, m) + j for r in range(size) if s < r + 1 for m in range(k) for j in range(2)]
        log.steps.append({"indices": [int(uneven[0][i]) for i in rows], "divisor": float(2 * k * size), "world": size,
                          "ranks": sum(s < r + 1 for r in range(size))})
    htf.broadcast_variables(model.variables + opt.variables, root_rank=last)  # the joined ranks' lag
    everyone = htf.allgather_object(opt.adaptive.state_dict())
    assert all(state == everyone[0] for state in everyone), "join() left the ranks' adaptive states apart"

    # 4. The adaptive dataset goes on after the join (its re-choices at the same steps everywhere).
    _adaptive_epoch(model, opt, step, _data(seed=6, n=SAMPLES // 2), log, seed=7)

    # 5. Saved both ways: hybridsync's checkpoint, and Horovod's Keras idiom (rank 0 saves).
    hybridsync.save_checkpoint(os.path.join(tmp, "ckpt"), model, opt, extra={"steps": len(log.steps)})
    snap = _snapshot(model, opt)
    if rank == 0:
        model.save(os.path.join(tmp, "model.keras"))
        np.savez(os.path.join(tmp, "job1.npz"), **snap)
        with open(os.path.join(tmp, "job1.json"), "w") as fh:
            json.dump({"steps": log.steps, "adaptive": opt.adaptive.state_dict()}, fh)
        _check_parity(dict(np.load(os.path.join(tmp, "initial.npz"))), log.steps, snap)
    htf.barrier()


def rank_job2(tmp):
    import numpy as np

    import hybridsync
    import hybridsync.tensorflow.keras as hvd
    from hybridsync.tensorflow.keras_embeddings import ShardedKerasEmbedding

    want = dict(np.load(os.path.join(tmp, "job1.npz")))
    with open(os.path.join(tmp, "job1.json")) as fh:
        saved = json.load(fh)
    log = Log(saved["steps"])

    # Horovod's Keras idiom, saved by rank 0 of job 1, loaded by every rank at another world size:
    # the dense weights and every table's rows are in the file (the server slots and the dynamic
    # table's counters are not: load_checkpoint below brings them).
    model = hvd.load_model(os.path.join(tmp, "model.keras"))
    opt = model.optimizer
    # The moved table was saved as a Keras Embedding and loads as one; the loaded optimizer moves it again.
    assert isinstance(model.get_layer("moved"), ShardedKerasEmbedding)
    got = _snapshot(model, opt)
    in_file = [k for k in want if k.startswith("param.") or k.endswith(".rows") or k.startswith("dyn.row.")]
    _assert_same(got, want, "hvd.load_model", keys=in_file)
    assert sorted(k for k in got if k.startswith("dyn.row.")) == sorted(k for k in want if k.startswith("dyn.row."))

    # The checkpoint, over whatever the model holds now: everything job 1 had.
    extra = hybridsync.load_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
    assert extra == {"steps": len(log.steps)}, extra
    _assert_same(_snapshot(model, opt), want, "hybridsync.load_checkpoint")
    adaptive = opt.adaptive.state_dict()  # the statistics, step count and progress (the batch: re-fitted to this size)
    for key in ("stats", "steps", "progress", "base_batch"):
        assert json.loads(json.dumps(adaptive[key])) == saved["adaptive"][key], (key, adaptive[key], saved["adaptive"][key])

    # Training goes on, with the adaptive batch restored at this world size.
    _adaptive_epoch(model, opt, _stepper(model, opt), _data(seed=4), log, seed=6)
    snap = _snapshot(model, opt)
    if hvd.rank() == 0:
        _check_parity(dict(np.load(os.path.join(tmp, "initial.npz"))), log.steps, snap)


# The Keras frontend all-reduces over MPI whatever the dense backend: HYBRIDSYNC_BACKEND=horovod
# is checked to be accepted once, the world sizes under mpi.
@pytest.mark.parametrize("backend,np_,resume_np", [("mpi", 1, 2), ("mpi", 2, 3), ("mpi", 3, 1), ("horovod", 2, 3)])
def test_keras_everything_at_once(tmp_path, backend, np_, resume_np):
    env = {"HYBRIDSYNC_BACKEND": backend}
    run_ranks(__file__, "rank_job1", np_, str(tmp_path), env=env, timeout=240)
    run_ranks(__file__, "rank_job2", resume_np, str(tmp_path), env=env, timeout=240)


if __name__ == "__main__":
    rank_main(globals())
