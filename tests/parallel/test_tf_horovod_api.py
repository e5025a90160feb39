"""horovod.tensorflow's surface on real ranks (hybridsync.tensorflow): the collectives as
TensorFlow ops -- eagerly, in tf.function and in a TF1 graph -- with Horovod's arithmetic,
errors and gradients, process sets, objects, join, DistributedGradientTape with Horovod's
arguments, and the calls Horovod's tensorflow2_synthetic_benchmark.py makes (a tape in a
tf.function, then broadcast_variables(opt.variables()) after the first step). One job per world
size runs every check (jobs are what costs time on 2 cores)."""
import pytest

from tests.parallel.harness import rank_main, run_ranks


def _close(a, b, tol=1e-5):
    import numpy as np

    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


def check_reductions(hvd, tf, np, rank, size):
    x = tf.constant([1.0, -2.0, 3.0 + rank, 0.5 * (rank + 1)])
    per_rank = np.stack([[1.0, -2.0, 3.0 + r, 0.5 * (r + 1)] for r in range(size)])
    pre, post = 2.0, 3.0
    expect = {hvd.Sum: (per_rank * pre).sum(0) * post, hvd.Average: (per_rank * pre).mean(0) * post,
              hvd.Min: (per_rank * pre).min(0) * post, hvd.Max: (per_rank * pre).max(0) * post,
              hvd.Product: (per_rank * pre).prod(0) * post}
    for op, want in expect.items():
        _close(hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post), want)
    # Integers: scaled per rank and truncated toward zero, as Horovod does; the deprecated flag.
    ints = tf.constant([1, 2, 3 + rank, -5, -4 + rank], tf.int32)
    per_int = np.stack([[1, 2, 3 + r, -5, -4 + r] for r in range(size)]).astype(np.float64)
    got = hvd.allreduce(ints, op=hvd.Sum, prescale_factor=0.5)
    assert got.dtype == tf.int32 and got.numpy().tolist() == np.trunc(per_int * 0.5).sum(0).astype(int).tolist()
    assert hvd.allreduce(x, average=False).numpy().tolist() == per_rank.sum(0).astype(np.float32).tolist()
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    # tf.IndexedSlices: values and indices all-gathered (Sum, Average), other ops refused.
    slices = tf.IndexedSlices(tf.fill([2, 3], float(rank)), tf.constant([rank, rank + 1]), tf.constant([size + 1, 3]))
    gathered = hvd.allreduce(slices, op=hvd.Average)
    assert gathered.indices.numpy().tolist() == [i for r in range(size) for i in (r, r + 1)]
    _close(gathered.values, np.repeat([[r / size] * 3 for r in range(size)], 2, axis=0))
    with pytest.raises(NotImplementedError, match="Only Sum and Average"):
        hvd.allreduce(slices, op=hvd.Max)
    with pytest.raises(NotImplementedError, match="Pre/postscale"):
        hvd.allreduce(slices, op=hvd.Sum, prescale_factor=2.0)
    # grouped: dense and sparse together, each as if alone.
    dense, sparse = hvd.grouped_allreduce([x, slices], op=hvd.Sum)
    _close(dense, per_rank.sum(0))
    assert isinstance(sparse, tf.IndexedSlices) and sparse.values.shape[0] == 2 * size
    # fp16 compression: sent as float16, handed back in the input's type.
    half = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert half.dtype == tf.float32
    _close(half, per_rank.sum(0), tol=1e-2)
    compressed, ctx = hvd.Compression.fp16.compress(tf.ones(3, tf.int32))
    assert compressed.dtype == tf.int32 and hvd.Compression.fp16.decompress(compressed, ctx).dtype == tf.int32


def check_gather_broadcast_alltoall_scatter(hvd, tf, np, rank, size):
    rows = tf.fill([rank + 1, 2], float(rank))
    _close(hvd.allgather(rows), np.concatenate([np.full((r + 1, 2), float(r)) for r in range(size)]))
    a, b = hvd.grouped_allgather([rows, tf.constant([rank], tf.int64)])
    assert a.shape == (size * (size + 1) // 2, 2) and b.numpy().tolist() == list(range(size))
    _close(hvd.broadcast(tf.fill([3], float(rank)), root_rank=size - 1), [size - 1.0] * 3)
    var = tf.Variable(tf.fill([2, 2], rank), dtype=tf.int32)
    flags = tf.Variable([rank % 2 == 0, True])
    out, out_flags = hvd.broadcast_([var, flags], root_rank=1)
    assert var.numpy().tolist() == [[1, 1], [1, 1]] == out.numpy().tolist()
    assert flags.numpy().tolist() == [False, True] == out_flags.numpy().tolist()
    # alltoall: rank r sends r+1 rows to each rank; equal splits when none are given.
    sent = tf.concat([tf.fill([rank + 1, 2], float(10 * rank + dest)) for dest in range(size)], 0)
    received, counts = hvd.alltoall(sent, splits=tf.constant([rank + 1] * size, tf.int32))
    assert counts.numpy().tolist() == [r + 1 for r in range(size)]
    _close(received, np.concatenate([np.full((r + 1, 2), 10.0 * r + rank) for r in range(size)]))
    even = hvd.alltoall(tf.range(size * 2, dtype=tf.float32))
    _close(even, np.concatenate([[2.0 * rank, 2.0 * rank + 1]] * size))
    with pytest.raises(tf.errors.InvalidArgumentError, match="must divide evenly"):
        hvd.alltoall(tf.ones([size + 1]))
    # reducescatter: uneven first dimension, the first ranks get a row more.
    full = tf.reshape(tf.range((size + 1) * 2, dtype=tf.float32), [size + 1, 2]) * (rank + 1)
    mine = hvd.reducescatter(full, op=hvd.Sum)
    total = np.arange((size + 1) * 2, dtype=np.float64).reshape(size + 1, 2) * sum(r + 1 for r in range(size))
    start = sum(2 if r < (size + 1) % size else 1 for r in range(rank)) if size > 1 else 0
    _close(mine, total[start:start + mine.shape[0]])
    first, second = hvd.grouped_reducescatter([full, full * 2], op=hvd.Average)
    _close(second, 2 * first.numpy())


def check_errors_and_job(hvd, tf, np, rank, size):
    with pytest.raises(tf.errors.FailedPreconditionError, match="allreduce"):
        hvd.allreduce(tf.ones([3 + rank]))  # shapes differ between ranks: every rank raises
    with pytest.raises(tf.errors.FailedPreconditionError):
        hvd.allgather(tf.ones([2], tf.int32 if rank == 0 else tf.float32))
    assert int(hvd.rank_op()) == rank and int(hvd.size_op()) == size
    assert int(hvd.local_rank_op()) == hvd.local_rank() and int(hvd.local_size_op()) == hvd.local_size()
    assert int(hvd.process_set_included_op()) == 1
    assert hvd.cross_size() * hvd.local_size() == size and hvd.is_initialized()
    assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_built() and hvd.nccl_built() == 0
    assert hvd.check_num_rank_power_of_2(4) and not hvd.check_num_rank_power_of_2(3)
    assert hvd.broadcast_object({"r": rank} if rank == 0 else None, root_rank=0) == {"r": 0}
    assert hvd.broadcast_object_fn(root_rank=size - 1)(rank) == size - 1
    assert hvd.allgather_object(rank * 10) == [r * 10 for r in range(size)]
    assert hvd.util._executing_eagerly()
    hvd.barrier()
    with pytest.raises(RuntimeError, match="does not support eager"):
        hvd.broadcast_global_variables(0)
    with pytest.raises(NotImplementedError, match="backward_passes_per_step"):
        hvd.LocalGradientAggregationHelper(2, None, False, False)
    # join with uneven work: rank 0 stops early, the others all-reduce without it.
    if rank == 0:
        last = int(hvd.join())
    else:
        _close(hvd.allreduce(tf.ones(2), op=hvd.Sum), [size - 1.0] * 2)
        last = int(hvd.join())
    assert last != 0 and hvd.allgather_object(last) == [last] * size
    # Unnamed collectives after it match again, though only the ranks that went on numbered theirs
    # (the MPI backend used to leave rank 0 a number behind: every later collective mismatched).
    _close(hvd.allreduce(tf.ones(1), op=hvd.Sum), [float(size)])


def check_process_sets(hvd, tf, np, rank, size):
    members = [0, size - 1] if size > 2 else [size - 1]  # (a set of every rank is the global one)
    pair = hvd.add_process_set(members)
    assert pair.size() == len(members) and hvd.global_process_set.size() == size
    if rank in members:
        _close(hvd.allreduce(tf.constant([float(rank)]), op=hvd.Sum, process_set=pair), [float(sum(members))])
        assert hvd.allgather_object(rank, process_set=pair) == members
        assert int(hvd.size_op(process_set_id=pair.process_set_id)) == len(members)
    else:
        assert int(hvd.process_set_included_op(pair.process_set_id)) == 0
        with pytest.raises(ValueError, match="not part of"):
            hvd.allreduce(tf.ones(1), process_set=pair)
    hvd.remove_process_set(pair)


def check_gradients(hvd, tf, np, rank, size):
    x = tf.Variable([1.0 + rank, 2.0 * (rank + 1)], dtype=tf.float64)
    with tf.GradientTape(persistent=True) as tape:
        s = hvd.allreduce(x, op=hvd.Sum)
        avg = hvd.allreduce(x, op=hvd.Average)
        mx = hvd.allreduce(x, op=hvd.Max)
        g = hvd.allgather(x)
        b = hvd.broadcast(x, root_rank=0)
        rs = hvd.reducescatter(tf.stack([x] * size), op=hvd.Sum)
    _close(tape.gradient(s, x), [size] * 2)  # d/dx of the sum of every rank's sum
    _close(tape.gradient(avg, x), [1.0] * 2)
    # Max: the exact gradient of the ranks' summed losses reaches the rank that holds the max.
    _close(tape.gradient(mx, x), [size if rank == size - 1 else 0.0] * 2)
    _close(tape.gradient(g, x), [1.0] * 2)  # Horovod's convention: the average of the incoming gradients
    _close(tape.gradient(b, x), [1.0 if rank == 0 else 0.0] * 2)
    _close(tape.gradient(rs, x), [size * size * 1.0] * 2)  # Horovod's convention: size x the exact gradient

    @tf.function
    def step(v):
        with tf.GradientTape() as t:
            out = hvd.alltoall(tf.stack([v] * size))
            loss = tf.reduce_sum(out * tf.cast(rank + 1, tf.float64))
        return t.gradient(loss, v)

    _close(step(x), [sum(r + 1 for r in range(size))] * 2)  # every rank got a copy of x: its multipliers


def check_tf1_graph(hvd, tf, np, rank, size):
    """A TF1 session may run many collectives in one run() in any order on a few threads."""
    with tf.Graph().as_default():
        inputs = [tf.fill([5 + i], float(rank + i)) for i in range(24)]
        sums = [hvd.allreduce(t, op=hvd.Sum) for t in inputs]
        grad = tf.compat.v1.gradients(sums[0], inputs[0])[0]
        with tf.compat.v1.Session() as session:
            values, g = session.run([sums, grad])
    for i, v in enumerate(values):
        _close(v, [sum(r + i for r in range(size))] * (5 + i))
    _close(g, [size] * 5)


def check_tapes(hvd, tf, np, rank, size):
    keras = __import__("keras")
    keras.utils.set_random_seed(rank)  # different weights per rank: the tape must average
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    x = tf.constant(np.random.RandomState(rank).rand(4, 3), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    local = tape.gradient(loss, model.trainable_variables)
    everyone = hvd.allgather_object([g.numpy() for g in local])
    dtape = hvd.DistributedGradientTape(tape, op=hvd.Sum, gradient_predivide_factor=1.0)
    assert isinstance(dtape, tf.GradientTape)
    for g, parts in zip(dtape.gradient(loss, model.trainable_variables), zip(*everyone)):
        _close(g, np.sum(parts, axis=0), tol=1e-4)
    partial = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[0]])
    grads = partial.gradient(loss, model.trainable_variables)
    _close(grads[0], local[0].numpy() / size, tol=1e-4)  # a local layer's gradient / size (Horovod)
    _close(grads[2], np.mean([e[2] for e in everyone], axis=0), tol=1e-4)
    mine, shared = partial.get_local_and_global_gradients(loss, model.trainable_variables)
    assert len(mine) == 2 and len(shared) == 2
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedGradientTape(tape, op=hvd.Sum, gradient_predivide_factor=2.0)
    del tape


def check_synthetic_benchmark_pattern(hvd, tf, np, rank, size):
    """What Horovod's tensorflow2_synthetic_benchmark.py does, on a small model."""
    keras = __import__("keras")
    keras.utils.set_random_seed(100 + rank)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    opt = tf.optimizers.SGD(0.01)
    data = tf.random.uniform([6, 4], seed=rank)
    target = tf.random.uniform([6, 1], minval=0, maxval=3, dtype=tf.int64, seed=rank)

    @tf.function
    def benchmark_step(first_batch):
        compression = hvd.Compression.none
        with tf.GradientTape() as tape:
            probs = model(data, training=True)
            loss = tf.losses.sparse_categorical_crossentropy(target, probs, from_logits=True)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)

    benchmark_step(first_batch=True)
    for _ in range(2):
        benchmark_step(first_batch=False)
    weights = hvd.allgather_object([v.numpy() for v in model.variables])
    for mine, other in zip(weights[0], weights[-1]):
        _close(mine, other, tol=1e-6)  # one start (rank 0's), averaged steps: every rank agrees


def rank_horovod_tensorflow():
    import numpy as np
    import tensorflow as tf

    import hybridsync.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for check in (check_reductions, check_gather_broadcast_alltoall_scatter, check_errors_and_job,
                  check_process_sets, check_gradients, check_tf1_graph, check_tapes,
                  check_synthetic_benchmark_pattern):
        check(hvd, tf, np, rank, size)
    print(f"rank {rank}: horovod.tensorflow checks passed", flush=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_horovod_tensorflow_surface(np_):
    out = run_ranks(__file__, "rank_horovod_tensorflow", np_, timeout=300)
    assert out.count("horovod.tensorflow checks passed") == np_, out


if __name__ == "__main__":
    rank_main(globals())
