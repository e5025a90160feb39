"""Tables with a disk tier (storage: {memory_rows: N, path: DIR}) on real MPI ranks: a cache of a
few rows trains bit-identically to the same table all in memory at -np 1, 2 and 3 -- fixed and
dynamic tables, SGD / Adagrad / Adam, float32 and 16-bit rows; the tier files really hold rows;
checkpoints carry both tiers; a missing or truncated tier file is an error naming it."""
import os

import pytest

from tests.parallel.harness import rank_main, run_ranks, run_scenarios

ROWS, DIM, STEPS, BATCH = 40, 3, 6, 12  # BATCH divides over 1, 2 and 3 ranks
RULES = [("sgd", {"lr": 0.5}), ("adagrad", {"lr": 0.3, "initial_accumulator_value": 0.1}),
         ("adam", {"lr": 0.05})]


def _batches(pool, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(pool[rng.integers(0, len(pool), size=BATCH)], rng.standard_normal((BATCH, DIM)).astype(np.float32))
            for _ in range(STEPS)]


def _train_pair(memory, tiered, batches, ids):
    """Pushes each step's batch (split over the ranks) to both tables; pulls and every row must
    agree bit for bit after each step."""
    import numpy as np

    from hybridsync.ps import client
    from hybridsync.ps.table import pull

    engine = client.engine()
    rank, size = engine.rank, engine.size
    for step_ids, grads in batches:
        mine = slice(rank, None, size)
        (u1, i1, r1), (u2, i2, r2) = pull([memory, tiered], [step_ids[mine], step_ids[mine]])
        np.testing.assert_array_equal(r2[i2], r1[i1], err_msg=f"{tiered.name}: pulled rows")
        engine.push([memory.handle, tiered.handle], [step_ids[mine]] * 2, [grads[mine]] * 2)
    engine.barrier("tiers-test")
    np.testing.assert_array_equal(tiered.read_rows(ids), memory.read_rows(ids), err_msg=tiered.name)
    for k, _ in enumerate(memory.slot_names):
        np.testing.assert_array_equal(tiered.read_rows(ids, k), memory.read_rows(ids, k), err_msg=f"{tiered.name} slot {k}")


def _tier_dir(tmp, name):
    import hybridsync

    return f"{tmp}/rank{hybridsync.rank()}/{name}"  # (each rank's own local disk)


def rank_fixed_tier_parity(tmp):
    import numpy as np

    import hybridsync
    from hybridsync.ps.table import PSTable

    hybridsync.init()
    ids = np.arange(ROWS, dtype=np.int64)
    for dtype in ("float32", "bfloat16"):
        for name, hp in RULES:
            tag = f"{dtype}_{name}"
            rule = {"name": name, **hp}
            memory = PSTable(f"mem_{tag}", ROWS, DIM, rule=rule, storage={"dtype": dtype})
            tiered = PSTable(f"disk_{tag}", ROWS, DIM, rule=rule,
                             storage={"dtype": dtype, "memory_rows": 3 * hybridsync.size(), "path": _tier_dir(tmp, tag)})
            for t in (memory, tiered):
                t.initialize(("normal", 0.0, 0.5), 7)
            _train_pair(memory, tiered, _batches(ids, seed=len(tag)), ids)
            stats = tiered.engine.tier_stats(tiered.handle)  # (every shard holds 13+ rows: each spills)
            # (an operation touching more rows than the share holds them until the next one)
            assert stats["memory_share"] == 3 and stats["memory_rows"] <= BATCH, stats
            assert stats["disk_rows"] > 0 and stats["bytes_written"] > 0 and stats["bytes_read"] > 0, stats
            memory.drop()
            tiered.drop()


def rank_dynamic_tier_parity(tmp):
    import numpy as np

    import hybridsync
    from hybridsync.ps import dynamic_options as dyn
    from hybridsync.ps.dynamic import DynamicTable

    hybridsync.init()
    pool = np.random.default_rng(0).integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=30, dtype=np.int64)
    for dtype, (name, hp) in [("float32", RULES[0]), ("float16", RULES[1]), ("float32", RULES[2])]:
        tag = f"{dtype}_{name}"
        rule = {"name": name, **hp}
        opts = dyn.options(tag, seed=5, ttl_steps=4)
        memory = DynamicTable(f"dmem_{tag}", DIM, opts, rule=rule, storage={"dtype": dtype})
        tiered = DynamicTable(f"ddisk_{tag}", DIM, opts, rule=rule,
                              storage={"dtype": dtype, "memory_rows": 2 * hybridsync.size(),
                                       "path": _tier_dir(tmp, "d" + tag)})
        _train_pair(memory, tiered, _batches(pool, seed=len(tag)), pool)
        assert tiered.read_state()["ids"].tolist() == memory.read_state()["ids"].tolist()
        stats = hybridsync.allgather_object(tiered.engine.tier_stats(tiered.handle))  # (a shard may never spill)
        assert all(s["memory_share"] == 2 for s in stats), stats
        assert sum(s["bytes_written"] for s in stats) > 0 and sum(s["bytes_read"] for s in stats) > 0, stats
        memory.drop()
        tiered.drop()


def rank_broken_tier_files(tmp):
    """A tier file truncated, then one deleted, under a live table: the next pull raises on every
    rank, naming the file."""
    import os

    import numpy as np

    import hybridsync
    from hybridsync.ps.table import PSTable, pull

    hybridsync.init()
    rank, size = hybridsync.rank(), hybridsync.size()
    ids = np.arange(ROWS, dtype=np.int64)
    for damage in ("truncated", "missing"):
        table = PSTable(f"broken_{damage}", ROWS, DIM, rule={"name": "adagrad", "lr": 0.1},
                        storage={"memory_rows": size, "path": _tier_dir(tmp, damage)})
        table.initialize(("normal", 0.0, 1.0), 1)
        for step_ids, grads in _batches(ids, seed=3)[:3]:
            pull([table], [step_ids[rank::size]])
            table.engine.push([table.handle], [step_ids[rank::size]], [grads[rank::size]])
        table.engine.barrier("spilled")
        path = table.engine.tier_stats(table.handle)["path"]
        assert os.path.getsize(path) > 0, path
        if rank == size - 1:  # one rank's disk goes wrong
            os.truncate(path, 0) if damage == "truncated" else os.unlink(path)
        paths = hybridsync.allgather_object(path)
        try:
            pull([table], [ids[rank::size]])  # every row: the damaged shard must read its file
        except Exception as exc:
            assert paths[-1] in str(exc) and damage in str(exc), str(exc)
            print(f"rank {rank}: {type(exc).__name__}: {exc}", flush=True)
        else:
            raise AssertionError(f"a {damage} tier file went unnoticed")


DYN_IDS = [-7, 3, 11, 2**40, 99, -2**62, 5, 123456789]


def _tiered_model(tmp, tag, tiered=True):
    """A torch model whose two PS tables keep 2 rows per rank in memory, the rest on disk (or,
    not tiered, the same tables all in memory)."""
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    size = hybridsync.size()
    if tiered:
        disk = lambda name: {"memory_rows": 2 * size, "path": _tier_dir(tmp, f"{tag}-{name}")}  # noqa: E731
        dyn = {"evict": "lfu", "storage": disk("d")}  # (spills LFU)
    else:
        disk, dyn = (lambda name: {}), {}  # noqa: E731

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fixed = hvd.Embedding(ROWS, DIM, name="fixed", seed=4, storage={"dtype": "bfloat16", **disk("f")})
            self.dyn = hvd.DynamicEmbedding(DIM, name="dyn", seed=5, **dyn)
            self.out = torch.nn.Linear(2 * DIM, 1)

        def forward(self, ids, raw):
            return self.out(torch.cat([self.fixed(ids), self.dyn(raw)], 1)).squeeze(1)

    model = Net()
    return model, hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), model=model)


def _tiered_steps(model, opt, steps):
    import torch

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()
    for step in steps:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, ROWS, (BATCH,), generator=g)
        raw = torch.tensor(DYN_IDS)[torch.randint(0, len(DYN_IDS), (BATCH,), generator=g)]
        y = torch.randn(BATCH, generator=g)
        mine = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids[mine], raw[mine]), y[mine]).backward()
        opt.step()


def _tiered_snapshot(model):
    import numpy as np

    out = {"fixed": model.fixed.table.read(), "dyn": model.dyn.table.read_rows(np.array(DYN_IDS, np.int64))}
    for k, name in enumerate(model.fixed.table.slot_names):
        out[f"fixed.{name}"] = model.fixed.table.read(k)
    state = model.dyn.table.read_state(slots=True)
    out["dyn.ids"] = state["ids"]
    for name in model.dyn.table.slot_names:
        out[f"dyn.{name}"] = state[f"slot.{name}"]
    return out


def rank_tiered_checkpoint_save(tmp):
    import os

    import numpy as np

    import hybridsync

    model, opt = _tiered_model(tmp, "save")
    _tiered_steps(model, opt, range(4))
    stats = hybridsync.allgather_object(model.fixed.table.engine.tier_stats(model.fixed.table.handle))
    assert sum(s["disk_rows"] for s in stats) > 0, stats  # the checkpoint has rows on disk to carry
    with open(os.devnull, "w") as sink:
        text = hybridsync.explain(file=sink)
    tiers = text[text.index("tables with a disk tier"):]
    assert "fixed" in tiers and "bfloat16" in tiers and "dyn" in tiers and "hit rate" in tiers, text
    hybridsync.save_checkpoint(f"{tmp}/ckpt", model, opt)
    at_save = _tiered_snapshot(model)
    _tiered_steps(model, opt, range(4, 7))
    if hybridsync.rank() == 0:
        np.savez(f"{tmp}/at-save.npz", **at_save)
        np.savez(f"{tmp}/final.npz", **_tiered_snapshot(model))


def rank_tiered_checkpoint_load(tmp):
    import numpy as np

    import hybridsync

    model, opt = _tiered_model(tmp, "load")
    hybridsync.load_checkpoint(f"{tmp}/ckpt", model, opt)
    for stage, steps in (("at-save", ()), ("final", range(4, 7))):
        _tiered_steps(model, opt, steps)
        want, got = np.load(f"{tmp}/{stage}.npz"), _tiered_snapshot(model)
        assert set(want.files) == set(got), (sorted(want.files), sorted(got))
        for key in want.files:  # the load is exact; training on at another world size sums gradients in
            if stage == "at-save":  # another order (float32), as without a disk tier
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{stage} {key}")
            else:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"{stage} {key}")


def rank_checkpoints_between_tiered_and_untiered(tmp):
    """A checkpoint of tables with a disk tier loads into the same tables all in memory, and back:
    every row, slot and dynamic entry equal, and both train on alike, bit for bit."""
    import numpy as np

    import hybridsync

    def same(got, want, what):
        assert set(got) == set(want), (what, sorted(got), sorted(want))
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")

    source = _tiered_model(tmp, "from", tiered=True)
    _tiered_steps(*source, range(4))
    stats = hybridsync.allgather_object(source[0].fixed.table.tier_stats())
    assert sum(s["disk_rows"] for s in stats) > 0, stats  # (rows on disk to carry)
    for k, tiered in enumerate((False, True)):  # tiered -> all in memory, then all in memory -> tiered
        hybridsync.save_checkpoint(f"{tmp}/ckpt{k}", *source)
        target = _tiered_model(tmp, f"to{k}", tiered=tiered)
        hybridsync.load_checkpoint(f"{tmp}/ckpt{k}", *target)
        same(_tiered_snapshot(target[0]), _tiered_snapshot(source[0]), f"loaded (tiered={tiered})")
        for model, opt in (source, target):
            _tiered_steps(model, opt, range(4 + 3 * k, 7 + 3 * k))
        same(_tiered_snapshot(target[0]), _tiered_snapshot(source[0]), f"trained on (tiered={tiered})")
        source = target


def rank_auto_keeps_a_tiered_table_on_the_ps(tmp):
    """`sync: auto` (the default) on an nn.Embedding whose rule gives it a disk tier: only the PS
    stores rows so, so auto leaves it there (before, it measured and could move the table to a
    replica, its disk tier gone). It trains exactly as the same table all in memory."""
    import numpy as np
    import torch

    import hybridsync
    import hybridsync.torch as hvd
    from hybridsync.types import Route

    rank, size = hybridsync.rank(), hybridsync.size()

    def build(storage):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(ROWS, DIM, sparse=True))
        rule = {"match": "0.weight", **({"storage": storage} if storage else {"sync": "ps"})}
        config = {"auto_steps": 2, "auto_trial_steps": 3, "variables": [rule]}
        return model, hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model=model,
                                               config=config)

    tiered = build({"memory_rows": 2 * size, "path": _tier_dir(tmp, "auto")})
    memory = build(None)
    for step in range(12):  # past auto_steps and its trials
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, ROWS, (BATCH,), generator=g)[rank::size]
        for model, opt in (tiered, memory):
            opt.zero_grad()
            (model(ids) ** 2).sum().backward()
            opt.step()
    v = tiered[1].plan.by_name()["0.weight"]
    assert v.route is Route.PS and not v.auto and v.storage["memory_rows"] == 2 * size, (v.route, v.auto, v.reason)
    table = tiered[0][0].table
    stats = hybridsync.allgather_object(table.tier_stats())
    assert all(s["path"] and s["memory_share"] == 2 for s in stats), stats  # (its tier is there)
    all_ids = np.arange(ROWS)
    np.testing.assert_array_equal(table.read_rows(all_ids), memory[0][0].table.read_rows(all_ids))


def rank_tiered_steps(tmp):
    model, opt = _tiered_model(tmp, "timeline")
    _tiered_steps(model, opt, range(4))


def test_the_timeline_shows_tier_io_and_a_job_that_ends_leaves_no_tier_file(tmp_path):
    """The timeline has the tier's spans; the tier files go with the engine at shutdown, although
    the script still holds its tables (before, every rank's files stayed after the job)."""
    import json

    trace = tmp_path / "trace.json"
    run_ranks(__file__, "rank_tiered_steps", 2, str(tmp_path), env={"HYBRIDSYNC_TIMELINE": str(trace)})
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    for rank in (0, 1):
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert {"tier prefetch", "tier read", "tier write"} <= names, (rank, sorted(names))
    left = sorted(str(f) for f in tmp_path.rglob("*.tier"))
    assert left == [], left


def rank_full_disk(tmp):
    """One rank's disk fills up (RLIMIT_FSIZE: its tier file cannot grow) while a pull must spill
    rows: that pull raises on every rank, naming the file, and no row changes; once there is
    room again, training goes on exactly as the all-in-memory table's."""
    import resource
    import signal

    import numpy as np

    import hybridsync
    from hybridsync.ps.table import PSTable, pull

    hybridsync.init()
    rank, size = hybridsync.rank(), hybridsync.size()
    ids = np.arange(ROWS, dtype=np.int64)
    rule = {"name": "adagrad", "lr": 0.3}
    memory = PSTable("full_mem", ROWS, DIM, rule=rule)
    tiered = PSTable("full_disk", ROWS, DIM, rule=rule, storage={"memory_rows": size, "path": _tier_dir(tmp, "full")})
    for t in (memory, tiered):
        t.initialize(("normal", 0.0, 0.5), 2)
    grads = np.random.default_rng(0).standard_normal((BATCH, DIM)).astype(np.float32)
    steps = [np.arange(BATCH) + BATCH * s for s in range(3)]  # new rows every step: the file must grow
    _train_pair(memory, tiered, [(steps[0], grads), (steps[1], grads)], ids)
    path = tiered.tier_stats()["path"]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == size - 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails with EFBIG instead)
        resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path), hard))
    paths = hybridsync.allgather_object(path)
    before = tiered.read_rows(ids), [tiered.read_rows(ids, k) for k in range(len(tiered.slot_names))]
    try:
        pull([tiered], [steps[2][rank::size]])
    except Exception as exc:
        assert paths[-1] in str(exc) and "could not take" in str(exc), str(exc)
        print(f"rank {rank}: {type(exc).__name__}: {exc}", flush=True)
    else:
        raise AssertionError("a full disk went unnoticed")
    tiered.engine.barrier("after-full")
    np.testing.assert_array_equal(tiered.read_rows(ids), before[0])
    for k, slot in enumerate(before[1]):
        np.testing.assert_array_equal(tiered.read_rows(ids, k), slot)
    if rank == size - 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    _train_pair(memory, tiered, [(steps[2], grads), (steps[0], grads)], ids)


def rank_full_disk_at_a_push(tmp):
    """One rank's disk fills up while a push must spill rows (it touches rows no pull brought in:
    gradient accumulation, a push without a pull). A push is not answered, so a failure could
    not stop the other shards from applying their part: the push keeps those rows in memory and
    applies everywhere, exactly. The next pull that must spill fails on every rank, naming the
    file, with no row or slot changed; once there is room, training goes on as all in memory.
    Fixed and dynamic tables."""
    import resource
    import signal

    import numpy as np

    import hybridsync
    from hybridsync.ps import dynamic_options as dyn
    from hybridsync.ps.dynamic import DynamicTable
    from hybridsync.ps.table import PSTable, pull

    hybridsync.init()
    rank, size = hybridsync.rank(), hybridsync.size()
    rule = {"name": "adagrad", "lr": 0.3}
    grads = np.random.default_rng(0).standard_normal((BATCH, DIM)).astype(np.float32)
    pool = np.random.default_rng(2).integers(-2**40, 2**40, size=5 * BATCH, dtype=np.int64)
    for kind in ("fixed", "dynamic"):
        disk = {"memory_rows": size, "path": _tier_dir(tmp, f"push-{kind}")}
        if kind == "fixed":
            ids = np.arange(ROWS, dtype=np.int64)
            memory = PSTable("pfull_mem", ROWS, DIM, rule=rule)
            tiered = PSTable("pfull_disk", ROWS, DIM, rule=rule, storage=disk)
            for t in (memory, tiered):
                t.initialize(("normal", 0.0, 0.5), 2)
        else:
            ids = pool
            opts = dyn.options(kind, seed=3)
            memory = DynamicTable("pfull_dmem", DIM, opts, rule=rule)
            tiered = DynamicTable("pfull_ddisk", DIM, dyn.options(kind, seed=3, disk_tier=True), rule=rule, storage=disk)
        a, b, c, d = (ids[BATCH * k:BATCH * (k + 1)] for k in range(4))  # (disjoint; d: 4 rows of a fixed table)
        mine = slice(rank, None, size)
        _train_pair(memory, tiered, [(a, grads)], ids)  # a: trained, in memory
        pull([memory, tiered], [b[mine], b[mine]])  # a goes to disk to make room for b
        tiered.engine.push([memory.handle, tiered.handle], [b[mine]] * 2, [grads[mine]] * 2)
        tiered.engine.barrier("b trained")  # b: trained, in memory; the disk holds a, nothing free
        path = tiered.engine.tier_stats(tiered.handle)["path"]
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        if rank == size - 1:  # its disk is full now
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails with EFBIG instead)
            resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path), hard))
        paths = hybridsync.allgather_object(path)
        # A push of rows no pull brought in: room for c means b to disk, which cannot take it.
        tiered.engine.push([memory.handle, tiered.handle], [c[mine]] * 2, [grads[mine]] * 2)
        tiered.engine.barrier("c pushed")
        np.testing.assert_array_equal(tiered.read_rows(ids), memory.read_rows(ids), err_msg=f"{kind}: after the push")
        for k in range(len(tiered.slot_names)):
            np.testing.assert_array_equal(tiered.read_rows(ids, k), memory.read_rows(ids, k), err_msg=f"{kind} slot {k}")
        before = tiered.read_rows(ids), [tiered.read_rows(ids, k) for k in range(len(tiered.slot_names))]
        try:  # new rows: the pull must spill b and c first
            pull([tiered], [d[mine]])
        except Exception as exc:
            assert paths[-1] in str(exc) and "could not take" in str(exc), str(exc)
            print(f"rank {rank}: {type(exc).__name__}: {exc}", flush=True)
        else:
            raise AssertionError(f"{kind}: a full disk went unnoticed by the pull")
        tiered.engine.barrier("after-full")
        np.testing.assert_array_equal(tiered.read_rows(ids), before[0])
        for k, slot in enumerate(before[1]):
            np.testing.assert_array_equal(tiered.read_rows(ids, k), slot)
        if rank == size - 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        _train_pair(memory, tiered, [(d, grads[:len(d)]), (a, grads), (c, grads)], ids)
        if kind == "dynamic":
            assert tiered.read_state()["ids"].tolist() == memory.read_state()["ids"].tolist()
        memory.drop()
        tiered.drop()


def rank_same_name_same_path(tmp):
    """Two live tables of one name with their tiers in one directory (a table moving to another
    layout or storage is made before the old one is dropped): each keeps its own file."""
    import numpy as np

    import hybridsync
    from hybridsync.ps.table import PSTable

    hybridsync.init()
    ids = np.arange(ROWS, dtype=np.int64)
    rule = {"name": "adam", "lr": 0.05}
    storage = {"memory_rows": hybridsync.size(), "path": _tier_dir(tmp, "shared")}
    memory = PSTable("twin_mem", ROWS, DIM, rule=rule)
    old = PSTable("same", ROWS, DIM, rule=rule, storage=storage)
    for t in (memory, old):
        t.initialize(("normal", 0.0, 0.5), 2)
    batches = _batches(ids, seed=4)
    _train_pair(memory, old, batches[:3], ids)
    new = PSTable("same", ROWS, DIM, rule=rule, storage=storage)
    assert new.tier_stats()["path"] != old.tier_stats()["path"]
    _train_pair(memory, old, batches[3:4], ids)  # the old table's file is intact
    new.take_from(old)
    old.drop()  # (removes its own file only)
    _train_pair(memory, new, batches[4:], ids)


def test_tables_of_one_name_keep_their_own_tier_files(tmp_path):
    run_ranks(__file__, "rank_same_name_same_path", 2, str(tmp_path))


def test_a_full_disk_fails_the_pull_on_every_rank_and_changes_nothing(tmp_path):
    run_ranks(__file__, "rank_full_disk", 2, str(tmp_path))


def test_a_full_disk_at_a_push_applies_it_everywhere_and_fails_the_next_pull(tmp_path):
    run_ranks(__file__, "rank_full_disk_at_a_push", 2, str(tmp_path))


def test_a_missing_or_truncated_tier_file_is_an_error_naming_it(tmp_path):
    run_ranks(__file__, "rank_broken_tier_files", 2, str(tmp_path))


def rank_dynamic_disk_bound(tmp):
    """disk_rows bounds a dynamic table's two tiers together: with memory_rows + disk_rows rows
    per cluster it evicts exactly as the same table all in memory with that capacity (LRU, LFU)."""
    import numpy as np

    import hybridsync
    from hybridsync.ps import dynamic_options as dyn
    from hybridsync.ps.dynamic import DynamicTable

    hybridsync.init()
    size = hybridsync.size()
    pool = np.random.default_rng(1).integers(-2**40, 2**40, size=40, dtype=np.int64)
    for evict, (name, hp) in (("lru", RULES[2]), ("lfu", RULES[1])):
        rule = {"name": name, **hp}
        memory = DynamicTable(f"cap_{evict}", DIM, dyn.options(evict, capacity=6 * size, evict=evict, seed=2), rule=rule)
        tiered = DynamicTable(f"bound_{evict}", DIM, dyn.options(evict, evict=evict, seed=2, disk_tier=True), rule=rule,
                              storage={"memory_rows": 2 * size, "disk_rows": 4 * size,
                                       "path": _tier_dir(tmp, f"bound_{evict}")})
        _train_pair(memory, tiered, _batches(pool, seed=9), pool)
        stored = memory.read_state()["ids"].tolist()
        assert tiered.read_state()["ids"].tolist() == stored and len(stored) <= 6 * size, stored
        assert sum(s["evicted"] for s in hybridsync.allgather_object(memory.stats())) > 0  # (the bound was reached)
        memory.drop()
        tiered.drop()


def test_disk_rows_bounds_a_dynamic_table_like_a_capacity(tmp_path):
    run_ranks(__file__, "rank_dynamic_disk_bound", 3, str(tmp_path))  # (3: uneven shares)


def rank_fixed_and_dynamic_tier_parity(tmp):
    """Both parities in one launch per world size (a launch costs seconds; their tier files are
    in directories of their own)."""
    rank_fixed_tier_parity(tmp)
    rank_dynamic_tier_parity(tmp)


def rank_memory_returns_to_its_share(tmp):
    """A write of the whole table (load_from_root: how an nn.Embedding or a Keras Embedding
    moves onto the shards) holds every row of the shard in memory; the next operation must
    spill down to the share even when every row it touches is already in memory."""
    import numpy as np

    import hybridsync
    from hybridsync.ps.table import PSTable, pull

    hybridsync.init()
    size = hybridsync.size()
    ids = np.arange(ROWS, dtype=np.int64)
    values = np.random.default_rng(3).standard_normal((ROWS, DIM)).astype(np.float32)
    table = PSTable("share", ROWS, DIM, rule={"name": "sgd", "lr": 0.5},
                    storage={"memory_rows": 3 * size, "path": _tier_dir(tmp, "share")})
    table.load_from_root(values if hybridsync.rank() == 0 else None, 0)
    held = table.tier_stats()
    assert held["memory_rows"] == len(range(hybridsync.rank(), ROWS, size)), held  # the whole shard
    few = ids[:2 * size]  # rows already in memory on every shard
    for _ in range(2):
        (unique, inverse, rows), = pull([table], [few])
        np.testing.assert_array_equal(rows[inverse], values[few])
        table.engine.push([table.handle], [few], [np.zeros((len(few), DIM), np.float32)])
    stats = table.tier_stats()
    assert stats["memory_rows"] <= stats["memory_share"] + 2, stats  # (the share, or what one operation touches)
    assert stats["disk_rows"] > 0, stats
    np.testing.assert_array_equal(table.read_rows(ids), values)  # nothing lost on the way to disk
    table.drop()


@pytest.mark.parametrize("np_", [2, 3])
def test_memory_returns_to_its_share_after_a_whole_table_write(np_, tmp_path):
    run_ranks(__file__, "rank_memory_returns_to_its_share", np_, str(tmp_path))


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_fixed_and_dynamic_tables_with_a_tiny_cache_train_like_all_in_memory(np_, tmp_path):
    run_ranks(__file__, "rank_fixed_and_dynamic_tier_parity", np_, str(tmp_path))


# -- checkpoints of a table larger than memory: only the rows written --------------------------
BIG_ROWS = 1_000_000  # (a shard of 333k-500k rows: many chunks, were it saved whole)


def _big_model(tmp, tag, tiered, memory_rows=None):
    """A torch model with one fixed table of BIG_ROWS rows: with a disk tier keeping a few rows
    per rank in memory, or all in memory."""
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    size = hybridsync.size()
    storage = {"memory_rows": memory_rows or 2 * size, "path": _tier_dir(tmp, tag)} if tiered else None

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.big = hvd.Embedding(BIG_ROWS, DIM, name="big", seed=6, initializer=("uniform", -0.5, 0.5),
                                     storage=storage)
            self.out = torch.nn.Linear(DIM, 1)

        def forward(self, ids):
            return self.out(self.big(ids)).squeeze(1)

    model = Net()
    return model, hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), model=model)


def _big_batch(step):
    """Step `step`'s ids (spread over the whole table) and targets."""
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, BIG_ROWS, (BATCH,), generator=g), torch.randn(BATCH, generator=g)


def _big_steps(model, opt, steps):
    """Steps whose ids spread over the whole table: a few dozen rows written in all."""
    import torch

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()
    for step in steps:
        ids, y = _big_batch(step)
        mine = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids[mine]), y[mine]).backward()
        opt.step()


def _big_sample(steps=range(5)):
    """The rows trained by _big_steps(steps), and untouched ones across the table."""
    import numpy as np

    trained = [_big_batch(s)[0].numpy() for s in steps]
    untouched = np.random.default_rng(3).integers(0, BIG_ROWS, 500)
    return np.unique(np.concatenate(trained + [untouched, [0, 1, 2, BIG_ROWS - 1]]).astype(np.int64))


def _big_snapshot(model):
    table = model.big.table
    ids = _big_sample()
    out = {"rows": table.read_rows(ids)}
    for k, name in enumerate(table.slot_names):
        out[name] = table.read_rows(ids, k)
    return out


class _WriterSizes:
    """Records the rows of every array a checkpoint hands its file writers (whole arrays to
    array_files.write, chunks to a streamed writer): what a rank held at once."""

    def __init__(self, monkey):
        from hybridsync import array_files

        self.largest = 0
        original_write = array_files.write

        def write(arrays, path):
            self.largest = max([self.largest] + [len(a) for a in arrays.values() if getattr(a, "ndim", 0) >= 1])
            return original_write(arrays, path)

        monkey.append((array_files, "write", original_write))
        array_files.write = write
        streamed = getattr(array_files, "StreamedWriter", None)
        if streamed is not None:
            original_chunk = streamed.write

            def write_chunk(writer, key, chunk):
                self.largest = max(self.largest, len(chunk))
                return original_chunk(writer, key, chunk)

            monkey.append((streamed, "write", original_chunk))
            streamed.write = write_chunk


def _save_and_check_written_rows(model, opt, path):
    """Saves, and checks each shard file holds only the rows written, handed over in chunks."""
    import json

    import hybridsync

    import numpy as np

    table = model.big.table
    written = len(np.union1d(table.engine.written_rows(table.handle, True), table.engine.written_rows(table.handle, False)))
    monkey = []
    sizes = _WriterSizes(monkey)
    try:
        hybridsync.save_checkpoint(path, model, opt)
    finally:
        for owner, name, original in monkey:
            setattr(owner, name, original)
    shard_rows = -(-BIG_ROWS // hybridsync.size())
    # The old save read every row of a shard into one array (shard_rows of them): never now.
    assert sizes.largest <= written < 100 < shard_rows, (sizes.largest, written, shard_rows)
    manifest = json.loads(open(f"{path}/manifest.json").read())
    entry = manifest["tables"][0]
    assert manifest["format"] == "hybridsync-checkpoint/2" and entry["rows_saved"] == "written", manifest
    assert entry["initial_rows"] == {"kind": "uniform", "seed": 6, "a": -0.5, "b": 0.5}, entry
    rows = hybridsync.allgather_object(written)
    assert [f["rows"] for f in entry["files"]] == rows and 0 < sum(rows) <= 5 * BATCH, (entry["files"], rows)


def rank_written_rows_checkpoint_save(tmp):
    """np 2: a tiered table of BIG_ROWS rows, a few dozen of them trained, saved: the shard
    files hold only the rows written, streamed; the reference all in memory trained alike."""
    import numpy as np

    import hybridsync

    tiered, reference = _big_model(tmp, "big-save", True), _big_model(tmp, "big-ref", False)
    for model, opt in (tiered, reference):
        _big_steps(model, opt, range(5))
    _save_and_check_written_rows(*tiered, f"{tmp}/big-ckpt")
    want, got = _big_snapshot(reference[0]), _big_snapshot(tiered[0])
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    if hybridsync.rank() == 0:
        np.savez(f"{tmp}/big-reference.npz", **want)


def rank_written_rows_checkpoint_load(tmp):
    """np 3: the checkpoint loads into a tiered table with another memory_rows and into one all
    in memory, both trained on other rows first (which the load must undo): trained rows, slots
    and untouched rows equal the reference; saved again at 3, it loads again alike."""
    import numpy as np

    import hybridsync

    want = dict(np.load(f"{tmp}/big-reference.npz"))

    def same(model, what):
        got = _big_snapshot(model)
        assert set(got) == set(want), (what, sorted(got), sorted(want))
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")

    tiered = _big_model(tmp, "big-load", True, memory_rows=5)
    untiered = _big_model(tmp, "big-untiered", False)
    for model, opt in (tiered, untiered):
        _big_steps(model, opt, range(20, 22))  # rows the checkpoint does not have: the load resets them
        hybridsync.load_checkpoint(f"{tmp}/big-ckpt", model, opt)
    same(tiered[0], "into a tiered table at 3")
    same(untiered[0], "into an untiered table at 3")
    _save_and_check_written_rows(*tiered, f"{tmp}/big-ckpt3")
    _big_steps(*untiered, range(30, 31))
    hybridsync.load_checkpoint(f"{tmp}/big-ckpt3", *untiered)
    same(untiered[0], "saved at 3, into an untiered table")


def rank_written_rows_elastic_commit(tmp):
    """An elastic commit of a tiered table of BIG_ROWS rows keeps its written rows in a file on
    the rank's disk, no array in memory; training on other rows, then a restore, gives back every
    row and slot as committed (rows written since back to their initial values)."""
    import glob

    import numpy as np

    import hybridsync.torch as hvd

    model, opt = _big_model(tmp, "big-elastic", True)
    _big_steps(model, opt, range(3))
    later = _big_sample([0, 1, 2, 3, 4, 20, 21])  # (rows trained before the commits, after them, never)
    table = model.big.table

    def snapshot():
        return [table.read_rows(later)] + [table.read_rows(later, k) for k in range(len(table.slot_names))]

    state = hvd.elastic.TorchState(model, opt, batch=0)
    for commit in range(2):  # (the second replaces the first's file)
        state.commit()
        committed = snapshot()
        handler = state._handlers["_ps_tables"]
        assert handler.saved_bytes() == 0, handler.saved_bytes()  # (the old commit held the whole shard)
        files = glob.glob(f"{_tier_dir(tmp, 'big-elastic')}/.*commit*")
        assert len(files) == 1, files
        _big_steps(model, opt, range(20, 22))
        assert not all(np.array_equal(a, b) for a, b in zip(snapshot(), committed))
        state.restore()
        for k, (got, want) in enumerate(zip(snapshot(), committed)):
            np.testing.assert_array_equal(got, want, err_msg=f"commit {commit}: {'rows' if k == 0 else f'slot {k - 1}'}")
        _big_steps(model, opt, range(3 + commit, 4 + commit))




# -- a dynamic table with a disk tier: its checkpoint and elastic commit stream its shard -------
STREAM_CHUNK, STREAM_BATCH = 16, 48  # (a chunk of 16 entries; shards of ~100 stored and ~50 pending)


def _stream_model(tmp, tag, tiered, memory_rows=None):
    """A torch model with one dynamic table (Adam: two slots; admit_after=2: pending ids too),
    with a disk tier keeping a few rows per rank in memory, or all in memory."""
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    storage = {"memory_rows": memory_rows or 2 * hybridsync.size(), "path": _tier_dir(tmp, tag)} if tiered else None

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.dyn = hvd.DynamicEmbedding(DIM, name="stream", seed=8, admit_after=2, storage=storage)
            self.out = torch.nn.Linear(DIM, 1)

        def forward(self, raw):
            return self.out(self.dyn(raw)).squeeze(1)

    model = Net()
    return model, hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), model=model)


def _stream_steps(model, opt, steps):
    """Steps over 400 raw ids: some seen once (pending), most stored."""
    import torch

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()
    for step in steps:
        g = torch.Generator().manual_seed(200 + step)
        raw = torch.randint(0, 400, (STREAM_BATCH,), generator=g) * 7919 - 10**6
        y = torch.randn(STREAM_BATCH, generator=g)
        mine = slice(rank * STREAM_BATCH // size, (rank + 1) * STREAM_BATCH // size)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(raw[mine]), y[mine]).backward()
        opt.step()


def _stream_state(model):
    """The whole dynamic table: ids, rows, slots, counts, last touches, pending ids."""
    state = model.dyn.table.read_state(slots=True)
    state.pop("sizes")  # (per shard: differs between world sizes)
    return state


def _same_state(got, want, what):
    import numpy as np

    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")


def rank_dynamic_streamed_checkpoint_save(tmp):
    """np 2: a dynamic table with a disk tier, saved with chunks of STREAM_CHUNK entries: no
    array handed to a file writer is larger than a chunk (the old save read the whole shard into
    memory), while each shard stores several chunks' worth, most of it on disk; it trained like
    the same table all in memory."""
    import hybridsync
    from hybridsync.ps import written_rows

    import numpy as np

    tiered, reference = _stream_model(tmp, "stream-save", True), _stream_model(tmp, "stream-ref", False)
    for model, opt in (tiered, reference):
        _stream_steps(model, opt, range(12))
    table = tiered[0].dyn.table
    stats, tier = table.stats(), table.tier_stats()
    assert stats["stored"] > 3 * STREAM_CHUNK and stats["pending"] > STREAM_CHUNK, stats
    assert tier["disk_rows"] > 2 * STREAM_CHUNK, tier
    monkey = [(written_rows, "CHUNK_ROWS", written_rows.CHUNK_ROWS)]
    written_rows.CHUNK_ROWS = STREAM_CHUNK
    sizes = _WriterSizes(monkey)
    try:
        hybridsync.save_checkpoint(f"{tmp}/stream-ckpt", *tiered)
    finally:
        for owner, name, original in monkey:
            setattr(owner, name, original)
    assert 0 < sizes.largest <= STREAM_CHUNK, sizes.largest
    want = _stream_state(reference[0])
    _same_state(_stream_state(tiered[0]), want, "tiered against all in memory")
    if hybridsync.rank() == 0:
        np.savez(f"{tmp}/stream-reference.npz", **want)


def rank_dynamic_streamed_checkpoint_load(tmp):
    """np 3: the checkpoint of 2 ranks loads bit for bit into a tiered table with another
    memory_rows and into one all in memory, both trained on first (which the load must undo);
    trained on after the load, the two stay identical."""
    import numpy as np

    import hybridsync

    want = dict(np.load(f"{tmp}/stream-reference.npz"))
    tiered = _stream_model(tmp, "stream-load", True, memory_rows=5)
    untiered = _stream_model(tmp, "stream-untiered", False)
    for model, opt in (tiered, untiered):
        _stream_steps(model, opt, range(40, 42))
        hybridsync.load_checkpoint(f"{tmp}/stream-ckpt", model, opt)
    _same_state(_stream_state(tiered[0]), want, "into a tiered table at 3")
    _same_state(_stream_state(untiered[0]), want, "into an untiered table at 3")
    for model, opt in (tiered, untiered):
        _stream_steps(model, opt, range(12, 15))
    _same_state(_stream_state(tiered[0]), _stream_state(untiered[0]), "trained on after the load at 3")


def rank_dynamic_streamed_elastic_commit(tmp):
    """An elastic commit of a dynamic table with a disk tier keeps its shard in a file on the
    rank's disk, no array in memory; training on (new ids admitted, rows spilled), then a
    restore, gives back exactly the committed table."""
    import glob

    import hybridsync.torch as hvd

    model, opt = _stream_model(tmp, "stream-elastic", True)
    _stream_steps(model, opt, range(6))
    state = hvd.elastic.TorchState(model, opt, batch=0)
    for commit in range(2):  # (the second replaces the first's file)
        state.commit()
        committed = _stream_state(model)
        handler = state._handlers["_ps_tables"]
        assert handler.saved_bytes() == 0, handler.saved_bytes()  # (the old commit held the whole shard)
        files = glob.glob(f"{_tier_dir(tmp, 'stream-elastic')}/.*commit*")
        assert len(files) == 1, files
        _stream_steps(model, opt, range(20, 23))
        assert len(_stream_state(model)["ids"]) > len(committed["ids"])
        state.restore()
        _same_state(_stream_state(model), committed, f"commit {commit}")
        _stream_steps(model, opt, range(6 + commit, 7 + commit))


# -- the torch scenarios above share one launch per world size ----------------------------------
# (each launch starts ranks that import torch: seconds on 2 cores). Each scenario works in a
# directory of its own; a failure names its sub-case.

def test_tiered_checkpoints_elastic_commits_and_auto_at_two_ranks_loaded_at_three(tmp_path):
    """2 ranks: checkpoints load between tiered and untiered tables; sync: auto keeps a tiered
    table on the PS; checkpoints of both tiers, of a table larger than memory (only its written
    rows) and of a dynamic table with a disk tier (its shard streamed) are saved, and elastic
    commits of the last two keep their rows on disk. 3 ranks: the three checkpoints load."""
    dirs = {name: tmp_path / name for name in ("between", "auto", "tiers", "big", "big-elastic", "stream",
                                               "stream-elastic")}
    for d in dirs.values():
        d.mkdir()
    run_scenarios(__file__, 2, ("rank_checkpoints_between_tiered_and_untiered", dirs["between"]),
                  ("rank_auto_keeps_a_tiered_table_on_the_ps", dirs["auto"]),
                  ("rank_tiered_checkpoint_save", dirs["tiers"]), ("rank_written_rows_checkpoint_save", dirs["big"]),
                  ("rank_written_rows_elastic_commit", dirs["big-elastic"]),
                  ("rank_dynamic_streamed_checkpoint_save", dirs["stream"]),
                  ("rank_dynamic_streamed_elastic_commit", dirs["stream-elastic"]), timeout=480)
    run_scenarios(__file__, 3, ("rank_tiered_checkpoint_load", dirs["tiers"]),
                  ("rank_written_rows_checkpoint_load", dirs["big"]),
                  ("rank_dynamic_streamed_checkpoint_load", dirs["stream"]), timeout=480)


if __name__ == "__main__":
    rank_main(globals())
