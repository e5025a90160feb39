"""Keras DynamicEmbedding on real MPI ranks: the same rows and counters as the one-process
reference (tests/dynamic_reference.py) with raw int64 ids, admission and LRU eviction, trained
with a GradientTape loop through the DistributedOptimizer; bad ids raise on every rank."""
import pytest

from tests.parallel.harness import rank_main, run_ranks
from tests.parallel.test_dynamic_tables import BATCH, DIM, _batches, _pool

OPTIONS = dict(capacity=10, evict="lru", admit_after=2)
SERVER = {"name": "adam", "lr": 0.05}


def rank_keras_parity():
    import numpy as np
    import tensorflow as tf
    import keras

    import hybridsync.tensorflow as hvd
    from hybridsync import comm
    from tests.dynamic_reference import ReferenceTable

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    layer = hvd.DynamicEmbedding(DIM, name="users", seed=11, **OPTIONS)
    bags = hvd.DynamicEmbedding(DIM, name="bags", seed=11, mode="sum")
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), config={"variables": [
        {"match": "users*", "sync": "ps", "optimizer": SERVER},
        {"match": "bags*", "sync": "ps", "optimizer": {"name": "sgd", "lr": 0.5}}]})
    ref = ReferenceTable(DIM, shards=size, seed=11, rule=("adam", {"lr": 0.05}), **OPTIONS)
    ref_bags = ReferenceTable(DIM, shards=size, seed=11, rule=("sgd", {"lr": 0.5}))
    for ids, w in _batches():
        mine = slice(rank, BATCH, size)
        with tf.GradientTape() as tape:
            loss = (tf.reduce_sum(layer(ids[mine]) * w[mine]) + tf.reduce_sum(bags(ids[mine]) * w[mine, 0])) * size / BATCH
        variables = layer.trainable_variables + bags.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        for table, bag in ((ref, False), (ref_bags, True)):
            grads = {}
            for b in range(BATCH):
                for c in range(2):
                    g = (w[b, 0] if bag else w[b, c]).astype(np.float64) / BATCH
                    grads[int(ids[b, c])] = grads.get(int(ids[b, c]), 0) + g
            table.push(grads)
    pool = _pool()
    for emb, table in ((layer, ref), (bags, ref_bags)):
        want = np.stack([table.row(int(i)) for i in pool])
        np.testing.assert_allclose(emb.table.read_rows(pool), want, rtol=1e-5, atol=1e-5, err_msg=emb.name)
        stats = comm.objects().allgather_object(emb.stats(), name="test.stats")
        assert sum(s["stored"] for s in stats) == len(table.stored_ids())
        assert sum(s["evicted"] for s in stats) == table.evicted
    assert ref.evicted > 0
    bad = np.array([0.5, 1.5], np.float32) if rank == 1 else np.array([1, 2], np.int64)
    with pytest.raises(Exception, match="ids must be integers|failed on rank 1"):
        layer(bad)
    assert layer(np.array([[3, 4]])).shape == (1, 2, DIM)  # still in step
    hvd.shutdown()


def test_keras_dynamic_embedding_matches_the_reference_at_two_ranks():
    run_ranks(__file__, "rank_keras_parity", 2, timeout=240)


if __name__ == "__main__":
    rank_main(globals())
