"""The parameter server called from several Python threads at once (TensorFlow runs its
numpy_function ops on threads of its own; the bindings release the GIL): results equal a
serial run, and nothing crashes or deadlocks."""
import pytest

from tests.parallel.harness import rank_main, run_scenarios

ROWS, DIM, THREADS, CALLS = 50, 4, 4, 60


def rank_threads_one_rank():
    """World of one: pushes (SGD: order-independent sums) and pulls from 4 threads at once."""
    import threading

    import numpy as np

    from hybridsync import ps

    engine = ps.engine()
    assert engine.size == 1
    start = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    table = engine.add_table("threads", ROWS, DIM, 0, "cyclic", "sgd", {"lr": 0.1})
    engine.load_local(table, -1, start)
    work = []
    for t in range(THREADS):
        rng = np.random.default_rng(100 + t)
        work.append([(rng.integers(0, ROWS, size=int(rng.integers(1, 20))),) for _ in range(CALLS)])
        work[-1] = [(ids, rng.standard_normal((len(ids), DIM)).astype(np.float32)) for (ids,) in work[-1]]
    errors = []

    def run(calls):
        try:
            for ids, grads in calls:
                engine.push([table], [ids], [grads], 1.0, False)
                (unique, inverse, rows), = engine.pull([table], [ids])
                assert rows.shape == (len(unique), DIM) and np.isfinite(rows).all()
                _, looked_up = engine.lookup(table, ids)
                assert looked_up.shape == (len(ids), DIM)
                engine.spec(table), engine.step(table), engine.slot_names(table), engine.hyperparameters(table)
                engine.traffic()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(calls,)) for calls in work]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
        assert not th.is_alive(), "a PS call deadlocked"
    assert not errors, errors
    expected = start.copy()
    for calls in work:
        for ids, grads in calls:
            np.add.at(expected, ids, -0.1 * grads)
    np.testing.assert_allclose(engine.read_table(table, -1), expected, rtol=1e-5, atol=1e-5)
    assert engine.step(table) == THREADS * CALLS
    print("threads: results equal the serial run", flush=True)


def rank_threads_with_collectives():
    """Several ranks: one thread per rank issues the collectives in a fixed order while other
    threads hammer the local calls of the same engine."""
    import threading

    import numpy as np

    from hybridsync import ps

    engine = ps.engine()
    rank, size = engine.rank, engine.size
    table = engine.add_table("shared", ROWS, DIM, 0, "cyclic", "sgd", {"lr": 0.5})
    side = engine.add_table("side", ROWS, DIM, 0, "cyclic", "sgd", {"lr": 0.5})
    stop, errors = threading.Event(), []

    def local_calls():
        rng = np.random.default_rng(rank)
        try:
            while not stop.is_set():
                engine.spec(table), engine.step(table), engine.hyperparameters(table), engine.slot_names(table)
                engine.traffic(), engine.row_store_bytes()
                ids = rng.integers(0, ROWS, size=5)
                engine.write_local(side, ids, np.ones((5, DIM), np.float32))
        except BaseException as exc:
            errors.append(exc)

    helpers = [threading.Thread(target=local_calls) for _ in range(3)]
    for th in helpers:
        th.start()
    rng = np.random.default_rng(7)  # the same sequence on every rank: ranks split it
    expected = np.zeros((ROWS, DIM), np.float32)
    for _ in range(CALLS):
        ids = rng.integers(0, ROWS, size=(size, 8))
        grads = rng.standard_normal((size, 8, DIM)).astype(np.float32)
        engine.push([table], [ids[rank]], [grads[rank]], 1.0 / size, False)
        for r in range(size):
            np.add.at(expected, ids[r], -0.5 * grads[r] / size)
        engine.pull([table], [ids[rank]])
    stop.set()
    for th in helpers:
        th.join(timeout=60)
        assert not th.is_alive(), "a local PS call deadlocked"
    assert not errors, errors
    np.testing.assert_allclose(engine.read_table(table, -1), expected, rtol=1e-5, atol=1e-5)
    print(f"rank {rank}: collectives and local calls from several threads agree", flush=True)



def _join(threads, what, timeout=120):
    for th in threads:
        th.join(timeout=timeout)
        assert not th.is_alive(), f"{what} deadlocked (still running after {timeout} s)"


def rank_threads_mixed_tables():
    """World of one, 4 pushing/pulling threads plus an observer: pushes to an SGD and an Adagrad
    table in one call (every other one returning the changed rows), pulls that mix a table no
    one pushes to (its rows must come back exact: no torn or misdirected reads) with a changing
    one, and lookups with 2-D ids. SGD's rows and Adagrad's accumulators are sums over pushes,
    so they equal the serial result whatever the interleaving."""
    import threading
    import traceback

    import numpy as np

    from hybridsync import ps

    engine = ps.engine()
    assert engine.size == 1
    rng = np.random.default_rng(1)
    start = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    fixed = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    sgd = engine.add_table("mixed.sgd", ROWS, DIM, 0, "cyclic", "sgd", {"lr": 0.1})
    ada = engine.add_table("mixed.adagrad", ROWS, DIM, 0, "block", "adagrad",
                           {"lr": 0.05, "initial_accumulator_value": 0.1})
    static = engine.add_table("mixed.static", ROWS, DIM, 0, "cyclic", "sgd", {"lr": 0.1})
    engine.load_local(sgd, -1, start)
    engine.load_local(ada, -1, start)
    engine.load_local(static, -1, fixed)
    specs = {t: engine.spec(t) for t in (sgd, ada, static)}
    resolved = {t: engine.hyperparameters(t) for t in specs}
    assert resolved[ada]["lr"] == 0.05 and resolved[ada]["initial_accumulator_value"] == 0.1, resolved
    work = []
    for t in range(THREADS):
        r = np.random.default_rng(200 + t)
        calls = []
        for _ in range(CALLS):
            ids = r.integers(0, ROWS, size=int(r.integers(1, 16)))
            calls.append((ids, r.standard_normal((len(ids), DIM)).astype(np.float32),
                          r.integers(0, ROWS, size=(3, int(r.integers(1, 5))))))
        work.append(calls)
    errors, stop = [], threading.Event()
    together = threading.Barrier(THREADS)  # start at once, so the calls overlap

    def run(calls):
        try:
            together.wait(timeout=60)
            for k, (ids, grads, other) in enumerate(calls):
                got = engine.push([sgd, ada], [ids, ids], [grads, grads], 1.0, k % 2 == 0)
                if k % 2 == 0:  # the changed rows of both tables
                    assert len(got) == 2
                    for changed, rows in got:
                        assert sorted(changed.tolist()) == sorted(set(ids.tolist())), (changed, ids)
                        assert rows.shape == (len(changed), DIM) and np.isfinite(rows).all()
                else:
                    assert got is None
                (u0, i0, r0), (u1, i1, r1) = engine.pull([static, sgd], [other.ravel(), ids])
                np.testing.assert_array_equal(u0[i0], other.ravel())
                np.testing.assert_array_equal(r0, fixed[u0])  # nobody writes this table
                np.testing.assert_array_equal(u1[i1], ids)
                assert r1.shape == (len(u1), DIM) and np.isfinite(r1).all()
                _, looked_up = engine.lookup(static, other)
                np.testing.assert_array_equal(looked_up, fixed[other])
                _, looked_up = engine.lookup(ada, ids)
                assert looked_up.shape == (len(ids), DIM) and np.isfinite(looked_up).all()
        except BaseException:  # reported by the main thread
            errors.append(traceback.format_exc())

    def observe():
        last = {t: 0 for t in specs}
        try:
            while not stop.is_set():
                for t, spec in specs.items():
                    assert engine.spec(t) == spec
                    step = engine.step(t)
                    assert step >= last[t], (t, step, last[t])  # steps only go up
                    last[t] = step
                    assert engine.slot_names(t) == (["sum"] if t == ada else [])
                    assert engine.hyperparameters(t) == resolved[t]  # given ones plus the rule's defaults
                    assert engine.shard_rows(t) == ROWS
                engine.traffic(), engine.row_store_bytes(), engine.state_bytes()
        except BaseException:
            errors.append(traceback.format_exc())

    observer = threading.Thread(target=observe, daemon=True)
    observer.start()
    threads = [threading.Thread(target=run, args=(calls,), daemon=True) for calls in work]
    for th in threads:
        th.start()
    _join(threads, "a PS call")
    stop.set()
    _join([observer], "the observer's local calls")
    assert not errors, "\n".join(errors)
    want_rows, want_sum = start.copy(), np.full((ROWS, DIM), 0.1, np.float32)
    for calls in work:
        for ids, grads, _ in calls:
            np.add.at(want_rows, ids, -0.1 * grads)
            summed = np.zeros((ROWS, DIM), np.float32)
            np.add.at(summed, ids, grads)  # a push's duplicate ids are summed before the rule
            want_sum += np.where(np.isin(np.arange(ROWS), ids)[:, None], summed * summed, 0)
    np.testing.assert_allclose(engine.read_table(sgd, -1), want_rows, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(engine.read_table(ada, 0), want_sum, rtol=1e-5, atol=1e-5)
    assert np.isfinite(engine.read_table(ada, -1)).all()
    np.testing.assert_array_equal(engine.read_table(static, -1), fixed)
    assert engine.step(sgd) == engine.step(ada) == THREADS * CALLS and engine.step(static) == 0
    print("threads: two tables per push, exact pulls of a fixed table, serial sums", flush=True)


def rank_collectives_hop_threads():
    """Several ranks, collectives from a different thread at every step (TensorFlow runs its
    numpy_function ops on whichever pool thread is free), one at a time and in the same order on
    every rank, while 3 threads per rank make local calls and write_local rows of another table.
    Every pull sees exactly the serial run's rows after the pushes before it."""
    import threading
    import traceback

    import numpy as np

    from hybridsync import ps

    engine = ps.engine()
    rank, size = engine.rank, engine.size
    sgd = engine.add_table("hop.sgd", ROWS, DIM, 0, "cyclic", "sgd", {"lr": 0.5})
    ada = engine.add_table("hop.adagrad", ROWS, DIM, min(2, size), "block", "adagrad",
                           {"lr": 0.1, "initial_accumulator_value": 0.1})
    side = engine.add_table("hop.side", ROWS, DIM, 0, "cyclic", "sgd", {"lr": 0.5})
    stop, errors = threading.Event(), []

    def local_calls(seed):
        r = np.random.default_rng(seed)
        value = np.float32(rank + 1)
        try:
            while not stop.is_set():
                for t in (sgd, ada, side):
                    engine.spec(t), engine.step(t), engine.hyperparameters(t), engine.slot_names(t)
                    engine.shard_rows(t)
                engine.traffic(), engine.row_store_bytes(), engine.state_bytes()
                ids = r.integers(0, ROWS, size=5)
                engine.write_local(side, ids, np.full((5, DIM), value, np.float32))
        except BaseException:
            errors.append(traceback.format_exc())

    helpers = [threading.Thread(target=local_calls, args=(10 * rank + k,), daemon=True) for k in range(3)]
    for th in helpers:
        th.start()
    rng = np.random.default_rng(7)  # the same sequence on every rank: each takes its share
    want, want_sum = np.zeros((ROWS, DIM), np.float32), np.full((ROWS, DIM), 0.1, np.float32)
    for step in range(CALLS):
        ids = rng.integers(0, ROWS, size=(size, 6))
        grads = rng.standard_normal((size, 6, DIM)).astype(np.float32)
        np.add.at(want, ids.ravel(), -0.5 * grads.reshape(-1, DIM) / size)
        summed = np.zeros((ROWS, DIM), np.float32)
        np.add.at(summed, ids.ravel(), grads.reshape(-1, DIM) / size)
        want_sum += np.where(np.isin(np.arange(ROWS), ids)[:, None], summed * summed, 0)
        pulled = {}

        def collectives():
            try:
                engine.push([sgd, ada], [ids[rank], ids[rank]], [grads[rank], grads[rank]], 1.0 / size, step % 3 == 0)
                pulled["rows"] = engine.pull([sgd], [ids[(rank + 1) % size]])[0]
            except BaseException:
                errors.append(traceback.format_exc())

        th = threading.Thread(target=collectives, daemon=True)
        th.start()
        _join([th], f"step {step}'s collectives", timeout=60)
        assert not errors, "\n".join(errors)
        unique, inverse, rows = pulled["rows"]
        np.testing.assert_array_equal(unique[inverse], ids[(rank + 1) % size])
        np.testing.assert_allclose(rows, want[unique], rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
    stop.set()
    _join(helpers, "a local PS call", timeout=60)
    assert not errors, "\n".join(errors)
    np.testing.assert_allclose(engine.read_table(sgd, -1), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(engine.read_table(ada, 0), want_sum, rtol=1e-5, atol=1e-6)
    # Every rank wrote whole rows of its own value into the rows its shard holds.
    written = engine.read_table(side, -1)
    for row in written:
        assert (row == row[0]).all() and row[0] in [0.0] + list(range(1, size + 1)), row
    print(f"rank {rank}: collectives hopping threads beside local calls equal the serial run", flush=True)


# The scenarios of a world size share one launch (a launch costs seconds on 2 cores; each has
# tables of its own; a failure names its sub-case).
def test_threads_on_one_rank_equal_a_serial_run_and_two_tables_give_exact_pulls_and_adagrad_sums():
    run_scenarios(__file__, 1, "rank_threads_one_rank", "rank_threads_mixed_tables", timeout=240)


@pytest.mark.parametrize("np_", [2, 3])
def test_local_calls_from_threads_beside_collectives_and_collectives_hopping_threads(np_):
    run_scenarios(__file__, np_, "rank_threads_with_collectives", "rank_collectives_hop_threads", timeout=240)


if __name__ == "__main__":
    rank_main(globals())
