"""The C++ parameter server across real ranks: a fuzz test against a NumPy reference (heavy
duplication, empty batches, ids only one rank touches, uneven and partial shards), errors on
one rank raised on every rank without a hang, and the memory each rank holds."""
import re

import pytest

from tests.parallel.harness import rank_main, run_ranks, run_scenarios, subcase_output


def _numpy_adagrad(table, acc, ids, grads, lr, eps, clr):
    for i in np.unique(ids):
        g = grads[ids == i].sum(0)
        acc[i] += g * g
        table[i] -= clr * g / (np.sqrt(acc[i]) + eps)


def rank_fuzz(seed):
    global np
    import numpy as np

    from hybridsync import ps

    engine = ps.engine()
    rank, size = engine.rank, engine.size
    rng = np.random.default_rng(int(seed))  # same stream on every rank: all know every batch
    A_ROWS, A_DIM, B_ROWS, B_DIM = 37, 3, 20, 5
    lr, decay, eps = 0.3, 0.05, 1e-10
    a = engine.add_table("a", A_ROWS, A_DIM, 0, "cyclic", "adagrad",
                         {"lr": lr, "lr_decay": decay, "initial_accumulator_value": 0.1, "eps": eps})
    b = engine.add_table("b", B_ROWS, B_DIM, min(2, size), "block", "sgd", {"lr": 0.5})
    ref_a = rng.standard_normal((A_ROWS, A_DIM)).astype(np.float32)
    ref_b = rng.standard_normal((B_ROWS, B_DIM)).astype(np.float32)
    acc_a = np.full_like(ref_a, 0.1)
    engine.load_from_root(a, ref_a if rank == 0 else None, 0)
    engine.load_from_root(b, ref_b if rank == 1 % size else None, 1 % size)
    steps_a = 0
    for step in range(40):
        batches = []
        for r in range(size):
            n = int(rng.integers(0, 12)) if step % 7 else 0  # every 7th step: all batches empty
            hot = rng.integers(0, 4, size=n)  # a few ids everyone hits, many times
            own = 30 + r + size * rng.integers(0, 2, size=n)  # ids only rank r touches
            ids_a = np.where(rng.random(n) < 0.6, hot, own % A_ROWS)
            ids_b = rng.integers(0, B_ROWS, size=int(rng.integers(0, 6)))
            batches.append((ids_a, rng.standard_normal((n, A_DIM)).astype(np.float32),
                            ids_b, rng.standard_normal((len(ids_b), B_DIM)).astype(np.float32)))
        ids_a, g_a, ids_b, g_b = batches[rank]
        # Pull: the rows of this rank's ids, and where each id went.
        (ua, inv_a, rows_a), (ub, inv_b, rows_b) = engine.pull([a, b], [ids_a, ids_b])
        np.testing.assert_allclose(rows_a[inv_a], ref_a[ids_a], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rows_b[inv_b], ref_b[ids_b], rtol=1e-5, atol=1e-6)
        assert len(ua) == len(np.unique(ids_a)) and len(ub) == len(np.unique(ids_b))
        # Push, applied lazily; the reference sums over ranks and scales by 1/size.
        engine.push([a, b], [ids_a, ids_b], [g_a, g_b], scale=1.0 / size)
        steps_a += 1
        all_a = np.concatenate([x[0] for x in batches]).astype(np.int64)
        all_ga = np.concatenate([x[1] for x in batches]) / size
        _numpy_adagrad(ref_a, acc_a, all_a, all_ga, lr, eps, lr / (1 + (steps_a - 1) * decay))
        all_b = np.concatenate([x[2] for x in batches]).astype(np.int64)
        all_gb = np.concatenate([x[3] for x in batches]) / size
        np.add.at(ref_b, all_b, -0.5 * all_gb)
        if step % 10 == 9:
            np.testing.assert_allclose(engine.read_table(a, -1), ref_a, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(engine.read_table(a, 0), acc_a, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(engine.read_table(b, -1), ref_b, rtol=1e-5, atol=1e-6)
    assert engine.step(a) == steps_a
    assert engine.step(b) == (steps_a if rank < min(2, size) else -1)  # ranks without a shard have no step
    print(f"rank {rank}: 40 fuzzed steps match NumPy", flush=True)


def rank_errors():
    import numpy as np
    import pytest

    from hybridsync import ps

    engine = ps.engine()
    rank, size = engine.rank, engine.size
    t = engine.add_table("clicks", 10, 2, 0, "cyclic", "sgd", {"lr": 1.0})
    before = engine.read_table(t, -1)

    def expect(call, local_type, local_msg, bad_rank=1):
        if rank == bad_rank:
            with pytest.raises(local_type, match=local_msg):
                call(True)
        else:
            with pytest.raises(RuntimeError, match=rf"failed on rank {bad_rank}: .*{local_msg}"):
                call(False)

    for bad in (10, 99, -1):
        expect(lambda me: engine.pull([t], [np.array([1, bad if me else 2])]), IndexError,
               rf"table 'clicks': id {bad} is out of range \[0, 10\)")
    # A synchronous push with float64 gradients: rejected, not cast, and nothing is applied.
    expect(lambda me: engine.push([t], [np.array([1])], [np.ones((1, 2), np.float64 if me else np.float32)], 1.0, True),
           ValueError, "table 'clicks': gradients must be float32, got dtype float64", bad_rank=0)
    expect(lambda me: engine.push([t], [np.array([1, 2])], [np.ones((2, 3 if me else 2), np.float32)], 1.0, True),
           ValueError, r"gradients shape \(2, 3\) does not match \(2, 2\)")
    # A deferred push: the bad rank raises now, the others at their next operation.
    if rank == 0:
        with pytest.raises(IndexError, match="id 10 is out of range"):
            engine.push([t], [np.array([10])], [np.ones((1, 2), np.float32)], 1.0)
        engine.flush()
    else:
        engine.push([t], [np.array([3])], [np.ones((1, 2), np.float32)], 1.0)
        with pytest.raises(RuntimeError, match="push failed on rank 0: table 'clicks': id 10"):
            engine.flush()
    np.testing.assert_array_equal(engine.read_table(t, -1), before)  # all-or-nothing rounds
    # The engine is still usable, and a rank that registers a different table is named.
    (_, _, rows), = engine.pull([t], [np.array([4])])
    np.testing.assert_array_equal(rows, before[[4]])
    with pytest.raises((ValueError, RuntimeError), match="differs between ranks|registration failed"):
        engine.add_table("clicks2", 10 + (rank == 1), 2, 0, "cyclic", "sgd", {})
    print(f"rank {rank}: errors raised on every rank", flush=True)


def rank_collective_setup_errors():
    """Input a rank rejects in a whole-table collective (load_from_root, add_table) is
    announced inside it: every rank raises at once instead of the others waiting for data."""
    import time

    import numpy as np
    import pytest

    from hybridsync import ps

    engine = ps.engine()
    rank, size = engine.rank, engine.size
    t = engine.add_table("table", 7, 3, 0, "cyclic", "sgd", {"lr": 1.0})
    start = time.monotonic()
    root = size - 1
    wrong = np.zeros((7, 2), np.float32)  # dim 2, the table has 3
    if rank == root:
        with pytest.raises(ValueError, match=r"table 'table': expected a C-contiguous float32 array of shape \(7, 3\)"):
            engine.load_from_root(t, wrong, root)
    else:
        with pytest.raises(RuntimeError, match=rf"load_from_root failed on rank {root}: table 'table': expected"):
            engine.load_from_root(t, None, root)
    with pytest.raises((ValueError, RuntimeError), match="unknown partition 'hash'"):
        engine.add_table("other", 7, 3, 0, "hash" if rank == 0 else "cyclic", "sgd", {"lr": 1.0})
    assert time.monotonic() - start < 10, "a rank waited for a peer that had rejected its input"
    good = np.arange(21, dtype=np.float32).reshape(7, 3)
    engine.load_from_root(t, good if rank == root else None, root)  # still usable
    np.testing.assert_array_equal(engine.read_table(t, -1), good)
    print(f"rank {rank}: setup errors raised on every rank", flush=True)


def rank_collective_argument_errors():
    """Arguments a binding converts before a collective (learning rates, the root rank, a slot)
    never make one rank skip it: every rank raises within seconds and the engine stays usable."""
    import time

    import numpy as np
    import pytest

    from hybridsync import ps

    engine = ps.engine()
    rank, size = engine.rank, engine.size
    t = engine.add_table("lrs", 8, 2, 0, "cyclic", "sgd", {"lr": 1.0})
    before = engine.read_table(t, -1)
    start = time.monotonic()
    ids, grads = np.array([rank]), np.ones((1, 2), np.float32)
    if rank == 0:
        with pytest.raises(ValueError, match="push: learning rates must be a sequence of numbers"):
            engine.push([t], [ids], [grads], 1.0, True, ["fast"])
    else:
        with pytest.raises(RuntimeError, match="push failed on rank 0: push: learning rates must be"):
            engine.push([t], [ids], [grads], 1.0, True, [0.5])
    with pytest.raises(ValueError, match=rf"table 'lrs': load_from_root needs a root rank in \[0, {size}\), got {size}"):
        engine.load_from_root(t, before, size)
    with pytest.raises(ValueError, match="has no state slot 2"):
        engine.read_table(t, 2)
    assert time.monotonic() - start < 10, "a rank waited for a peer that had rejected its input"
    np.testing.assert_array_equal(engine.read_table(t, -1), before)  # nothing applied
    engine.push([t], [ids], [grads], 1.0, False, [0.5])
    expected = before.copy()
    expected[:size] -= 0.5
    np.testing.assert_array_equal(engine.read_table(t, -1), expected)
    print(f"rank {rank}: argument errors raised on every rank", flush=True)


def rank_local_state():
    """local_values and write_local with a slot: a rank's shard (rows and optimizer state) read
    and written in storage order, as checkpoints save and restore it."""
    import numpy as np

    from hybridsync import ps

    engine = ps.engine()
    rank, size = engine.rank, engine.size
    t = engine.add_table("state", 11, 2, 0, "cyclic", "adagrad", {"lr": 0.1})
    engine.load_from_root(t, np.arange(22, dtype=np.float32).reshape(11, 2), 0)
    engine.push([t], [np.arange(11)], [np.ones((11, 2), np.float32)], 1.0, True)
    own = np.arange(rank, 11, size)  # cyclic: local row l is global row l * size + rank
    rows, acc = engine.local_values(t, -1), engine.local_values(t, 0)
    np.testing.assert_array_equal(rows, engine.read_table(t, -1)[own])
    np.testing.assert_array_equal(acc, engine.read_table(t, 0)[own])
    assert rows.shape == (len(own), 2) and engine.local_values(t).shape == rows.shape
    engine.write_local(t, np.arange(11), np.full((11, 2), 7.0, np.float32), 0)
    engine.write_local(t, np.arange(11), np.full((11, 2), 3.0, np.float32))
    engine.barrier()  # local writes are local: the others' are read once they are done
    np.testing.assert_array_equal(engine.read_table(t, 0), np.full((11, 2), 7.0, np.float32))
    np.testing.assert_array_equal(engine.read_table(t, -1), np.full((11, 2), 3.0, np.float32))
    print(f"rank {rank}: local state read and written", flush=True)


def rank_local_writes_after_a_deferred_push():
    """A push that returns nothing is applied before the next operation -- local ones included:
    a table loaded right after training is not overwritten by the last step's push."""
    import numpy as np

    from hybridsync import ps

    engine = ps.engine()
    t = engine.add_table("late", 6, 2, 0, "cyclic", "sgd", {"lr": 1.0})
    engine.push([t], [np.arange(6)], [np.ones((6, 2), np.float32)], 1.0, False)
    assert engine.step(t) in (1, -1), engine.step(t)  # -1: this rank holds no shard
    engine.load_local(t, -1, np.zeros((6, 2), np.float32))
    engine.barrier()
    np.testing.assert_array_equal(engine.read_table(t, -1), np.zeros((6, 2), np.float32))
    engine.push([t], [np.arange(6)], [np.ones((6, 2), np.float32)], 1.0, False)
    engine.write_local(t, np.arange(6), np.full((6, 2), 5.0, np.float32))
    engine.barrier()
    np.testing.assert_array_equal(engine.read_table(t, -1), np.full((6, 2), 5.0, np.float32))


def rank_module_errors():
    import pytest
    import torch

    import hybridsync.torch as hvd

    model = torch.nn.Sequential(torch.nn.Embedding(20, 3, sparse=True))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    ids = torch.tensor([1, 25 if hvd.rank() == 1 else 2])
    if hvd.rank() == 1:
        with pytest.raises(IndexError, match=r"table '0.weight': id 25 is out of range \[0, 20\)"):
            model(ids)
    else:
        with pytest.raises(RuntimeError, match=r"failed on rank 1: table '0.weight': id 25"):
            model(ids)
    with pytest.raises((ValueError, RuntimeError), match="ids must be integers"):
        model(torch.tensor([1.0, 2.0]))
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()


def rank_memory():
    import torch

    import hybridsync.torch as hvd
    from hybridsync import ps

    rows, dim = 40_000, 16
    table_bytes = rows * dim * 4
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(rows, dim, sparse=True), torch.nn.Linear(dim, 1))
    original = model[0].weight
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model=model)
    model(torch.randint(0, rows, (64, 4))).sum().backward()
    opt.step()
    held = ps.engine().row_store_bytes()
    assert held <= 0.6 * table_bytes, (held, table_bytes)
    assert original.numel() == 0, "the full nn.EmbeddingBag weight must be freed after the swap"
    assert not any(p.numel() >= rows for p in model.parameters())
    print(f"MEMORY rank={hvd.rank()} rows_bytes={held} table_bytes={table_bytes} "
          f"ratio={held / table_bytes:.3f} state_bytes={ps.engine().state_bytes()}", flush=True)


def rank_hand_over():
    """A table leaving the parameter server (PSTable.hand_over, what a switch to a replica
    does): every rank gets the whole table and slots, and each shard gave its rows' memory back
    as they were read -- the pages now read as zeros -- before the table is dropped."""
    import numpy as np
    import pytest

    from hybridsync import ps
    from hybridsync.ps.table import PSTable

    engine = ps.engine()
    rows, dim = 100_000, 16  # 6.4 MB: the shards' rows are mapped pages, 1 MiB chunks
    table = PSTable("leaving", rows, dim, 0, "block", {"name": "adagrad", "lr": 0.1})
    values = np.random.default_rng(7).standard_normal((rows, dim)).astype(np.float32) + 3.0
    table.load_from_root(values, 0)
    ids = np.arange(0, rows, 7)
    table.core.engine.push([table.handle], [ids], [np.ones((len(ids), dim), np.float32)], 1.0, True)
    want_rows, want_acc = table.read(), table.read(0)
    engine.barrier()
    got_rows, got_slots, step = table.hand_over()
    np.testing.assert_array_equal(got_rows, want_rows)
    assert len(got_slots) == 1, got_slots.keys()  # adagrad's accumulator
    np.testing.assert_array_equal(next(iter(got_slots.values())), want_acc)
    assert step == 1, step
    with pytest.raises(Exception, match="leaving"):  # dropped: any use names it
        table.read()
    print(f"rank {engine.rank}: handed over {rows} rows, slots {sorted(got_slots)}", flush=True)


def rank_hand_over_releases_pages():
    """The engine-level half: after a hand-over read by every rank, the shard's rows and slot
    read as zeros (their pages went back), while every rank holds the right values."""
    import numpy as np

    from hybridsync import ps

    engine = ps.engine()
    rows, dim = 100_000, 16
    t = engine.add_table("released", rows, dim, 0, "block", "adagrad", {"lr": 0.1})
    values = np.random.default_rng(3).standard_normal((rows, dim)).astype(np.float32) + 3.0
    engine.load_from_root(t, values if engine.rank == 0 else None, 0)
    engine.push([t], [np.arange(rows)], [np.ones((rows, dim), np.float32)], 1.0, True)
    want_rows, want_acc = engine.read_table(t, -1), engine.read_table(t, 0)
    engine.barrier()
    np.testing.assert_array_equal(engine.read_table(t, 0, True), want_acc)
    np.testing.assert_array_equal(engine.read_table(t, -1, True), want_rows)
    engine.barrier()  # every rank has read every chunk: every shard has given them back
    mine, acc = engine.local_values(t, -1), engine.local_values(t, 0)
    zero_rows = float(np.mean(~mine.any(axis=1)))
    zero_acc = float(np.mean(~acc.any(axis=1)))
    # (only rows on a chunk's edge pages may stay: a few per MiB)
    assert zero_rows > 0.99 and zero_acc > 0.99, (zero_rows, zero_acc)
    print(f"rank {engine.rank}: {zero_rows:.4f} of the shard's rows given back", flush=True)


def rank_idle_cpu():
    """No PS thread spins while the engine is idle, nor while a rank waits long for a late peer
    (OpenMPI's blocking calls would burn the core a co-located rank needs)."""
    import time

    import numpy as np

    from hybridsync import ps

    engine = ps.engine()
    table = engine.add_table("idle", 100, 4, 0, "cyclic", "sgd", {"lr": 0.1})
    engine.pull([table], [np.arange(10)])
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(1.0)  # idle: between operations
    idle_cpu = time.process_time() - cpu
    assert idle_cpu < 0.15, f"an idle engine used {idle_cpu:.2f} CPU-s in 1 s"
    engine.barrier("idle")  # (so rank 1's 2 s are all lateness, however late rank 0 woke)
    if engine.rank == 1:
        time.sleep(2.0)  # the late peer
    cpu, wall = time.process_time(), time.perf_counter()
    engine.pull([table], [np.arange(10)])
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if engine.rank == 0:
        assert wall > 1.5, wall
        assert cpu < 0.35 * wall, f"waiting {wall:.2f} s for a late peer used {cpu:.2f} CPU-s"
    print(f"IDLE-CPU rank={engine.rank} idle={idle_cpu:.3f} wait_wall={wall:.2f} wait_cpu={cpu:.3f}", flush=True)


def rank_seeded_tables():
    import hashlib

    import numpy as np
    import torch

    import hybridsync.torch as hvd
    from hybridsync import ps

    torch.manual_seed(11)
    everywhere = hvd.Embedding(5000, 8)
    torch.manual_seed(11)
    one_shard = hvd.Embedding(5000, 8, partitions=1, partition="block")
    full = everywhere.weight_numpy()
    np.testing.assert_array_equal(full, one_shard.weight_numpy())
    assert abs(full.mean()) < 0.02 and abs(full.std() - 1) < 0.02  # N(0, 1), like nn.Embedding
    # Created on the shards: no rank ever held the whole table.
    assert ps.engine().row_store_bytes() <= (5000 // hvd.size() + 1) * 8 * 4 + 5000 * 8 * 4
    print(f"TABLE-DIGEST {hashlib.sha256(full.tobytes()).hexdigest()}", flush=True)


# The engine's scenarios share one launch per world size (a launch costs seconds on 2 cores;
# each scenario has tables of its own names, and a failure names its sub-case). The seeded
# tables go first: they count the engine's rows. Measurements of a process's memory or CPU
# (rank_memory, rank_hand_over_releases_pages, rank_idle_cpu) keep launches of their own.
ENGINE_SCENARIOS = ("rank_seeded_tables", ("rank_fuzz", "12345"), "rank_errors", "rank_collective_setup_errors",
                    "rank_collective_argument_errors", "rank_hand_over")


def test_engine_scenarios_at_two_and_three_ranks_and_seeded_tables_do_not_depend_on_the_shards():
    """At 2 and 3 ranks: seeded tables (the same digest at both), the fuzz against numpy, bad
    input on one rank and bad collective setups and arguments raise on every rank, a table
    handed over reaches every rank; at 2: shard state in storage order, bad ids through a PS
    embedding; at 3: local writes wait for a deferred push."""
    digests = set()
    for np_, only_here in ((2, ("rank_local_state", "rank_module_errors")),
                           (3, ("rank_local_writes_after_a_deferred_push",))):
        out = run_scenarios(__file__, np_, *ENGINE_SCENARIOS, *only_here)
        found = re.findall(r"TABLE-DIGEST ([0-9a-f]+)", subcase_output(out, 1))
        assert len(found) == np_, out
        digests |= set(found)
    assert len(digests) == 1, digests


def test_sharded_placement_holds_half_the_rows_per_rank_at_two_ranks():
    out = run_ranks(__file__, "rank_memory", 2)
    ratios = [float(x) for x in re.findall(r"ratio=([0-9.]+)", out)]
    assert len(ratios) == 2 and all(r <= 0.6 for r in ratios), out


@pytest.mark.parametrize("np_", [2, 3])
def test_a_handed_over_tables_shards_give_their_memory_back(np_):
    run_ranks(__file__, "rank_hand_over_releases_pages", np_)


def test_idle_and_waiting_ranks_do_not_spin_a_core():
    run_ranks(__file__, "rank_idle_cpu", 2)


if __name__ == "__main__":
    rank_main(globals())
