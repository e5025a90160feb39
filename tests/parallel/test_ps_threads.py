"""The parameter server called from several Python threads at once (TensorFlow runs its
numpy_function ops on threads of its own; the bindings release the GIL): results equal a
serial run, and nothing crashes or deadlocks."""
import pytest

from tests.parallel.harness import rank_main, run_ranks

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
    np.testing.assert_allclose(engine.gather(table, -1), expected, rtol=1e-5, atol=1e-5)
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
    np.testing.assert_allclose(engine.gather(table, -1), expected, rtol=1e-5, atol=1e-5)
    print(f"rank {rank}: collectives and local calls from several threads agree", flush=True)


def test_threads_on_one_rank_equal_a_serial_run():
    run_ranks(__file__, "rank_threads_one_rank", 1)


@pytest.mark.parametrize("np_", [2, 3])
def test_local_calls_from_threads_beside_collectives(np_):
    run_ranks(__file__, "rank_threads_with_collectives", np_)


if __name__ == "__main__":
    rank_main(globals())
