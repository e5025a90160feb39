"""hvd.elastic.TorchState with tables on the parameter server (issue 23): Horovod's handler-based
state, whose PS tables are committed and restored per shard by each rank locally.

- commit / restore / sync with an Adagrad-trained table: restore() brings the rows, the server
  optimizer's slots and step, the dense weights and the plain attributes back to the commit,
  while every rank goes on training; sync() gives every rank rank 0's dense state; a
  HorovodInternalError inside hvd.elastic.run restores the commit and is raised.
- Dynamic tables: restore() gives back exactly the commit's ids, rows, slots, counters and
  pending ids (ids admitted since are forgotten), and training on matches an uninterrupted twin.
- Memory: constructing the state costs a rank about its own shard, never the table; commit,
  sync and restore then cost nearly nothing more.
"""

import pytest

from tests.parallel.harness import rank_main, run_scenarios, subcase_output
from tests.parallel.memory import peak_mib as _peak_mib, reset_peak as _reset_peak
from tests.parallel.ps_model import ps_model as _model, ps_step as _step


def _shards_table(table, slot=-1):
    """The table (or a slot) assembled from every rank's own shard, gathered as objects."""
    import numpy as np

    import hybridsync
    from hybridsync.ps.partition import Partition

    shards, kind = table.layout
    mine = ((table.engine.local_values(table.handle, slot), Partition(table.num_rows, shards, kind).rows_of(hybridsync.rank()))
            if hybridsync.rank() < shards else (np.zeros((0, table.dim), np.float32), np.zeros(0, np.int64)))
    full = np.zeros((table.num_rows, table.dim), np.float32)
    for rows, ids in hybridsync.allgather_object(mine):
        full[ids] = rows
    return full


def rank_commit_restore_sync():
    import numpy as np
    import torch

    import hybridsync.torch as hvd

    model = _model(3000, 8)
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model=model)
    for step in range(2):
        _step(model, opt, step)
    table = model["emb"].table
    with torch.no_grad():
        model["out"].weight.fill_(float(hvd.rank()))  # sync must give every rank rank 0's
    state = hvd.elastic.TorchState(model, opt, epoch=hvd.rank(), seen=[])
    committed = {}

    @hvd.elastic.run
    def train(state):
        assert state.epoch == 0 and bool(model["out"].weight.eq(0).all()), "sync() did not take rank 0's state"
        for step in range(2, 4):
            _step(model, opt, step)
        state.epoch, state.seen = 1, [1]
        state.commit()
        committed.update(rows=_shards_table(table), slot=_shards_table(table, 0), step=table.step,
                         weight=model["out"].weight.detach().clone())
        for step in range(4, 6):  # the table, its slot and the dense weights move on
            _step(model, opt, step)
        state.epoch, state.seen = 2, [1, 2]
        assert not np.array_equal(_shards_table(table), committed["rows"])
        raise hvd.HorovodInternalError("a collective failed")  # run() restores the commit

    try:
        train(state)
    except hvd.HorovodInternalError:
        pass
    else:
        raise AssertionError("run() swallowed the HorovodInternalError")
    # Every rank restored its own shard: the table is the committed one everywhere.
    assert state.epoch == 1 and state.seen == [1], (state.epoch, state.seen)
    np.testing.assert_array_equal(_shards_table(table), committed["rows"])
    np.testing.assert_array_equal(_shards_table(table, 0), committed["slot"])
    assert table.step == committed["step"] and torch.equal(model["out"].weight, committed["weight"])
    _step(model, opt, 99)  # training goes on from the restored state, no rank waiting
    assert not np.array_equal(_shards_table(table), committed["rows"])
    print(f"rank {hvd.rank()}: ELASTIC-OK", flush=True)
    _restore_matches_commit()


def _restore_matches_commit():
    """restore() after more steps gives exactly the committed rows, slots, step and weights."""
    import numpy as np
    import torch

    import hybridsync.torch as hvd

    model = _model(2000, 4)
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model=model)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    state.sync()
    table = model["emb"].table
    for step in range(3):
        _step(model, opt, step)
    state.batch = 3
    state.commit()
    want = (_shards_table(table), _shards_table(table, 0), table.step, model["out"].weight.detach().clone(),
            {k: v.clone() for k, v in opt.state[model["out"].weight].items()})
    for step in range(3, 6):
        _step(model, opt, step)
    state.batch = 6
    state.restore()
    assert state.batch == 3
    np.testing.assert_array_equal(_shards_table(table), want[0])
    np.testing.assert_array_equal(_shards_table(table, 0), want[1])
    assert table.step == want[2], (table.step, want[2])
    assert torch.equal(model["out"].weight, want[3])
    assert all(torch.equal(opt.state[model["out"].weight][k], v) for k, v in want[4].items())
    print(f"rank {hvd.rank()}: RESTORE-OK step={table.step}", flush=True)


def rank_restore_ends_when_every_shard_is_restored():
    """restore() writes each rank's own shard; a rank that reads the table one-sided right after
    its restore() (a state_dict, a checkpoint) must find every shard restored, also when another
    rank (the last, held up) comes to its restore() later."""
    import time

    import numpy as np
    import torch

    import hybridsync.torch as hvd

    model = _model(400, 4)
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model=model)
    table = model["emb"].table
    _step(model, opt, 0)
    state = hvd.elastic.TorchState(model, opt)
    committed = table.read()  # one-sided, every shard
    _step(model, opt, 1)
    if hvd.rank() == hvd.size() - 1:
        time.sleep(1.0)
    state.restore()
    np.testing.assert_array_equal(table.read(), committed)


def rank_elastic_memory():
    import gc

    import torch

    import hybridsync.torch as hvd

    rows, dim = 800_000, 32  # 98 MiB
    table_mib = rows * dim * 4 / 2**20
    model = _model(rows, dim)  # rows seeded on the shards: no rank ever holds the table
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    _step(model, opt, 0)
    shard_mib = model["emb"].table.engine.shard_rows(model["emb"].table.handle) * dim * 4 / 2**20
    gc.collect()
    before = _reset_peak()
    state = hvd.elastic.TorchState(model, opt, epoch=0)
    grown = {"construct": _peak_mib() - before}
    for what in ("commit", "sync", "restore"):
        _step(model, opt, 1)
        gc.collect()
        before = _reset_peak()
        getattr(state, what)()
        grown[what] = _peak_mib() - before
    print(f"ELASTIC-MEMORY rank={hvd.rank()} table={table_mib:.1f} MiB shard={shard_mib:.1f} MiB "
          + " ".join(f"{k}={v:.1f}" for k, v in grown.items()), flush=True)
    assert grown["construct"] < shard_mib + 0.05 * table_mib, grown
    for what in ("commit", "sync", "restore"):
        assert grown[what] < 0.05 * table_mib, (what, grown)
    _step(model, opt, 2)


def rank_elastic_state():
    rank_restore_ends_when_every_shard_is_restored()
    rank_commit_restore_sync()
    rank_elastic_memory()


def _dynamic_model(seed_offset=0):
    """Two dynamic tables (admission with expiry; LRU at a capacity) under Adagrad and Adam on
    the shards, and a dense head under the wrapped Adagrad."""
    import torch

    import hybridsync.torch as hvd

    torch.manual_seed(7)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.adm = hvd.DynamicEmbedding(3, seed=11, admit_after=2, ttl_steps=3)
            self.lru = hvd.DynamicEmbedding(3, seed=12, capacity=8, evict="lru")
            self.head = torch.nn.Linear(6, 1)

        def forward(self, ids):
            return self.head(torch.cat([self.adm(ids[:, 0]), self.lru(ids[:, 1])], 1)).squeeze(1)

    model = Net()
    config = {"variables": [{"match": "lru.*", "sync": "ps", "optimizer": {"name": "adam", "lr": 0.05}}]}
    return model, hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model=model, config=config)


def _dynamic_step(model, opt, step, fresh=False):
    """One step on rows rank::size of a global batch of 12 drawn per step: hot ids, a tail of
    raw int64 ids, and (fresh=True) ids never seen in the other steps."""
    import numpy as np
    import torch

    import hybridsync.torch as hvd
    from tests.parallel.test_dynamic_tables import _pool

    rng = np.random.default_rng(1000 + step)
    pool = _pool()
    ids = pool[rng.integers(0, len(pool), size=(12, 2))]
    ids[:4] = pool[rng.integers(0, 4, size=(4, 2))]
    if fresh:  # the same new ids every detour step: admit_after=2 admits them at the second
        ids[4:] = np.random.default_rng(99).integers(1, 2**40, size=(8, 2))
    mine = torch.from_numpy(ids[hvd.rank()::hvd.size()])
    y = torch.from_numpy(rng.standard_normal(12).astype(np.float32)[hvd.rank()::hvd.size()])
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(mine), y).backward()
    opt.step()


def _dynamic_everything(model, opt):
    """Every stored id with its row, slots, count and last touch, the pending ids, the steps,
    the dense weights and the wrapped optimizer's state, gathered (a witness)."""
    import torch

    from tests.parallel.test_dynamic_tables import snapshot

    out = snapshot({"adm": model.adm.table, "lru": model.lru.table})
    out.update({f"step.{n}": m.table.step for n, m in (("adm", model.adm), ("lru", model.lru))})
    out.update({f"head.{k}": v.detach().numpy().copy() for k, v in model.head.state_dict().items()})
    for p in model.head.parameters():
        out.update({f"opt.{p.shape}.{k}": torch.as_tensor(v).numpy().copy() for k, v in opt.state[p].items()})
    return out


def _assert_same(got, want, what):
    import numpy as np

    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")


def rank_dynamic_restore():
    """TorchState with dynamic tables: restore() after steps that admitted new ids and trained
    old ones gives back exactly the commit's ids, rows, slots, counts, last touches, pending
    ids and steps (ids admitted since are forgotten); training on from there is bit-identical
    to a twin that never left the committed path."""
    import hybridsync.torch as hvd

    model, opt = _dynamic_model()
    twin, twin_opt = _dynamic_model()
    for step in range(4):
        _dynamic_step(model, opt, step)
        _dynamic_step(twin, twin_opt, step)
    state = hvd.elastic.TorchState(model, opt, batch=4)
    state.commit()
    committed = _dynamic_everything(model, opt)
    for step in range(100, 103):  # a detour: new ids admitted, old rows trained, ids evicted
        _dynamic_step(model, opt, step, fresh=True)
    state.batch = 7
    detour = _dynamic_everything(model, opt)
    new_ids = set(detour["adm.ids"].tolist()) - set(committed["adm.ids"].tolist())
    assert new_ids and detour["step.adm"] == committed["step.adm"] + 3, "the detour admitted no new id"
    state.restore()
    assert state.batch == 4
    _assert_same(_dynamic_everything(model, opt), committed, "after restore()")
    for step in range(4, 9):
        _dynamic_step(model, opt, step)
        _dynamic_step(twin, twin_opt, step)
    _assert_same(_dynamic_everything(model, opt), _dynamic_everything(twin, twin_opt), "trained on after restore()")
    print(f"rank {hvd.rank()}: DYNAMIC-RESTORE-OK", flush=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_torch_state_restores_dynamic_tables_and_with_a_ps_table_commits_restores_and_syncs_holding_a_shard(np_):
    # One job per world size for every check: starting jobs is what costs. (The memory check
    # measures the peak from its own reset, after the dynamic tables' scenario.)
    out = run_scenarios(__file__, np_, "rank_dynamic_restore", "rank_elastic_state", timeout=300,
                        env={"HYBRIDSYNC_TIMEOUT_S": "30"})
    dynamic, fixed = subcase_output(out, 1), subcase_output(out, 2)
    assert dynamic.count("DYNAMIC-RESTORE-OK") == np_, out
    assert fixed.count("ELASTIC-OK") == np_ and fixed.count("RESTORE-OK") == np_, out
    assert fixed.count("ELASTIC-MEMORY") == np_, out


if __name__ == "__main__":
    rank_main(globals())
