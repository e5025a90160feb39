"""Pulls in input order, at -np 1, 2 and 3: the engine writes every id's row (duplicates too)
where the id stands, after the pending pushes, next to tables pulled as unique rows in the same
round."""
import pytest

from tests.parallel.harness import rank_main, run_ranks


def rank_pull_in_order(seed):
    import numpy as np

    from hybridsync import ps

    engine = ps.engine()
    rank, size = engine.rank, engine.size
    rng = np.random.default_rng(int(seed))  # the same stream on every rank: all know every batch
    a = engine.add_table("a", 37, 3, 0, "cyclic", "sgd", {"lr": 0.5})
    b = engine.add_table("b", 20, 5, min(2, size), "block", "sgd", {"lr": 0.5})
    ref_a = rng.standard_normal((37, 3)).astype(np.float32)
    ref_b = rng.standard_normal((20, 5)).astype(np.float32)
    engine.load_from_root(a, ref_a if rank == 0 else None, 0)
    engine.load_from_root(b, ref_b if rank == 0 else None, 0)
    for step in range(30):
        batches = []
        for _ in range(size):
            n = int(rng.integers(0, 8)) if step % 5 else 0  # every 5th step: no ids at all
            ids_a = np.where(rng.random((n, 2)) < 0.6, rng.integers(0, 4, (n, 2)), rng.integers(0, 37, (n, 2)))
            ids_b = rng.integers(0, 20, size=int(rng.integers(0, 9)))
            batches.append((ids_a, ids_b, rng.standard_normal((ids_a.size, 3)).astype(np.float32)))
        ids_a, ids_b, grads = batches[rank]
        ordered_b = bool(step % 2)
        (ua, inv_a, rows_a), (ub, inv_b, rows_b) = engine.pull([a, b], [ids_a, ids_b], [True, ordered_b])
        assert inv_a is None and rows_a.shape == ids_a.shape + (3,) and rows_a.flags.c_contiguous
        np.testing.assert_allclose(rows_a, ref_a[ids_a], rtol=1e-5, atol=1e-6)  # pushes: summed in another order
        # Deduplicated for the wire; in a world of one nothing crosses one.
        assert sorted(ua) == (sorted(np.unique(ids_a)) if size > 1 else [])
        if ordered_b:
            assert inv_b is None
            np.testing.assert_array_equal(rows_b, ref_b[ids_b])
        else:
            np.testing.assert_array_equal(rows_b[inv_b], ref_b[ids_b])
            assert len(ub) == len(np.unique(ids_b))
        unique, rows = engine.lookup(b, ids_b)
        np.testing.assert_array_equal(rows, ref_b[ids_b])
        # A lazy push: the next pull must see it.
        engine.push([a], [ids_a.reshape(-1)], [grads], scale=1.0 / size)
        all_ids = np.concatenate([x[0].reshape(-1) for x in batches]).astype(np.int64)
        all_grads = np.concatenate([x[2] for x in batches]) / size
        np.add.at(ref_a, all_ids, -0.5 * all_grads)
    # A bad id on rank 0 only: every rank raises, and the engine stays usable.
    bad = np.array([[1, 40]]) if rank == 0 else np.array([[1, 2]])
    with pytest.raises(IndexError if rank == 0 else RuntimeError, match="id 40 is out of range"):
        engine.pull([a], [bad], [True])
    (_, _, rows), = engine.pull([a], [np.array([2, 2])], [True])
    np.testing.assert_allclose(rows, ref_a[[2, 2]], rtol=1e-5, atol=1e-6)
    print(f"rank {rank}: 30 steps of pulls in input order match NumPy", flush=True)


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_pull_in_input_order(np_):
    run_ranks(__file__, "rank_pull_in_order", np_, "2024")


if __name__ == "__main__":
    rank_main(globals())
