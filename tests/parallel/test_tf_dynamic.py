"""Keras DynamicEmbedding on real MPI ranks: at -np 2, 3 and 1 the same rows and counters as the
one-process reference (tests/dynamic_reference.py) with raw int64 ids, admission and LRU
eviction, trained with a GradientTape loop through the DistributedOptimizer; a checkpoint saved
at 2 ranks loads at 3 and 1 with identical lookups, into a model that already stepped on other
ids (the load replaces them); bad ids raise on every rank; hvd.elastic.KerasState restores dynamic
tables exactly (ids admitted after the commit forgotten) at -np 2 and 3."""
import pytest

from tests.parallel.harness import rank_main, run_ranks, run_scenarios
from tests.parallel.test_dynamic_tables import BATCH, DIM, STEPS, _batches, _pool, snapshot

OPTIONS = dict(capacity=10, evict="lru", admit_after=2)
SERVER = {"name": "adam", "lr": 0.05}
BAG_SERVER = {"name": "sgd", "lr": 0.5}


def _net():
    """(model holding a dynamic table of single ids and one of bags, wrapped optimizer); the
    optimizer is named, so a second one in the process has the same variable names."""
    import keras

    import hybridsync.tensorflow as hvd

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.users = hvd.DynamicEmbedding(DIM, name="users", seed=11, **OPTIONS)
            self.bags = hvd.DynamicEmbedding(DIM, name="bags", seed=11, mode="sum")

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, name="sgd"), config={"variables": [
        {"match": "users*", "sync": "ps", "optimizer": SERVER},
        {"match": "bags*", "sync": "ps", "optimizer": BAG_SERVER}]})
    return Net(), opt


def _step(net, opt, ids, w, rank, size):
    """One step on rows rank::size of the global batch; loss = sum(w * rows) / BATCH, so the
    average over ranks is the one-process loss."""
    import tensorflow as tf

    mine = slice(rank, BATCH, size)
    with tf.GradientTape() as tape:
        loss = (tf.reduce_sum(net.users(ids[mine]) * w[mine])
                + tf.reduce_sum(net.bags(ids[mine]) * w[mine, 0])) * size / BATCH
    variables = net.users.trainable_variables + net.bags.trainable_variables
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))


def _parity(rank, size):
    import numpy as np

    from hybridsync import comm
    from tests.dynamic_reference import ReferenceTable

    net, opt = _net()
    ref = ReferenceTable(DIM, shards=size, seed=11, rule=("adam", {"lr": 0.05}), **OPTIONS)
    ref_bags = ReferenceTable(DIM, shards=size, seed=11, rule=("sgd", {"lr": 0.5}))
    for ids, w in _batches():
        _step(net, opt, ids, w, rank, size)
        for table, bag in ((ref, False), (ref_bags, True)):
            grads = {}
            for b in range(BATCH):
                for c in range(2):
                    g = (w[b, 0] if bag else w[b, c]).astype(np.float64) / BATCH
                    grads[int(ids[b, c])] = grads.get(int(ids[b, c]), 0) + g
            table.push(grads)
    pool = _pool()
    for emb, table in ((net.users, ref), (net.bags, ref_bags)):
        want = np.stack([table.row(int(i)) for i in pool])
        np.testing.assert_allclose(emb.table.read_rows(pool), want, rtol=1e-5, atol=1e-5,
                                   err_msg=f"{emb.name} at {size} ranks")
        stats = comm.objects().allgather_object(emb.stats(), name="test.stats")
        assert sum(s["stored"] for s in stats) == len(table.stored_ids())
        for key in ("admitted", "evicted"):
            assert sum(s[key] for s in stats) == getattr(table, key), (emb.name, key, stats)
    assert ref.evicted > 0 and ref_bags.admitted > 0
    return net, opt


def _tables(net):
    return {"users": net.users.table, "bags": net.bags.table}


def _load(path, rank, size):
    """A fresh model steps once on other ids (Keras builds its plan on the first step), then
    loads: every stored id, row, slot, count, last touch and pending id is the one saved."""
    import numpy as np

    import hybridsync

    net, opt = _net()
    other = np.arange(2 * BATCH, dtype=np.int64).reshape(BATCH, 2) + 10**15
    _step(net, opt, other, np.ones((BATCH, 2, DIM), np.float32), rank, size)
    hybridsync.load_checkpoint(path, net, opt)
    got, want = snapshot(_tables(net)), np.load(f"{path}.expected.npz")
    assert set(got) == set(want.files)
    for key in want.files:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert net.users.table.step == STEPS
    for name in ("users", "bags"):  # and what a forward pass looks up
        ids = want[f"{name}.ids"]
        np.testing.assert_array_equal(net.users(ids[:, None]).numpy()[:, 0] if name == "users" else
                                      net.bags(ids[:, None]).numpy(), want[f"{name}.rows"], err_msg=name)


def rank_keras_scenario(path, role):
    import numpy as np

    import hybridsync
    import hybridsync.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    net, opt = _parity(rank, size)
    if role == "save":
        hybridsync.save_checkpoint(path, net, opt)
        state = snapshot(_tables(net))
        if rank == 0:
            np.savez(f"{path}.expected.npz", **state)
    else:
        _load(path, rank, size)
    if size > 1:
        bad = np.array([0.5, 1.5], np.float32) if rank == 1 else np.array([1, 2], np.int64)
        with pytest.raises(Exception, match="ids must be integers|failed on rank 1"):
            net.users(bad)
        assert net.users(np.array([[3, 4]])).shape == (1, 2, DIM)  # still in step
    hvd.shutdown()


def _keras_everything(net, opt):
    out = snapshot(_tables(net))
    out.update({f"step.{n}": t.step for n, t in _tables(net).items()})
    out.update({f"var.{i}": v.numpy() for i, v in enumerate(net.variables + opt.variables)})
    return out


def _same(got, want, what):
    import numpy as np

    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")


def rank_keras_state():
    """KerasState with dynamic tables: restore() after steps that admitted new ids and trained
    old ones gives back exactly the commit's ids, rows, slots, counts, last touches, pending ids
    and steps; training on from there is bit-identical to a twin that never left that path."""
    import numpy as np

    import hybridsync.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    (net, opt), (twin, twin_opt) = _net(), _net()
    batches = _batches()
    for ids, w in batches[:4]:
        _step(net, opt, ids, w, rank, size)
        _step(twin, twin_opt, ids, w, rank, size)
    state = hvd.elastic.KerasState(net, opt, batch=4)
    state.commit()
    committed = _keras_everything(net, opt)
    fresh = np.random.default_rng(99).integers(1, 2**40, size=(BATCH, 2))  # new ids, admitted at their second step
    for ids, w in batches[4:7]:
        _step(net, opt, np.where(np.arange(BATCH)[:, None] < 4, ids, fresh), w, rank, size)
    state.batch = 7
    detour = _keras_everything(net, opt)
    assert set(detour["users.ids"].tolist()) - set(committed["users.ids"].tolist()), "the detour admitted no new id"
    state.restore()
    assert state.batch == 4
    _same(_keras_everything(net, opt), committed, "after restore()")
    for ids, w in batches[4:]:
        _step(net, opt, ids, w, rank, size)
        _step(twin, twin_opt, ids, w, rank, size)
    _same(_keras_everything(net, opt), _keras_everything(twin, twin_opt), "trained on after restore()")
    print(f"rank {rank}: KERAS-DYNAMIC-RESTORE-OK", flush=True)
    hvd.shutdown()


def test_keras_dynamic_embedding_parity_at_2_3_1_ranks_checkpoint_across_them_and_state_restores(tmp_path):
    """2 trains, checks and saves; 3 and 1 train, check, and load it into a fresh model. At 2 and 3
    ranks the same launch then checks that Keras's state restores dynamic tables exactly (a
    rank waiting on another's program order fails in 30 s)."""
    path, env = str(tmp_path / "ckpt"), {"HYBRIDSYNC_TIMEOUT_S": "30"}
    for np_, mode in ((2, "save"), (3, "load")):
        out = run_scenarios(__file__, np_, ("rank_keras_scenario", path, mode), "rank_keras_state",
                            timeout=400, env=env)
        assert out.count("KERAS-DYNAMIC-RESTORE-OK") == np_, out
    run_ranks(__file__, "rank_keras_scenario", 1, path, "load", timeout=240)


if __name__ == "__main__":
    rank_main(globals())
