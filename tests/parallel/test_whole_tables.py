"""No whole table on every rank (issue 23): a PS table in model.state_dict() / optimizer.state_dict()
is a ShardedTableTensor that reads its rows from the shards -- by the rank that asks, alone, in
chunks, while the shards' owners go on training -- only when something needs them.

- Horovod's save idiom, `if hvd.rank() == 0: torch.save(model.state_dict(), path)`, followed by
  more training steps: nothing waits on another rank's program order, and the file holds the
  table as the shards held it at that point.
- A state only rank 0 holds (torch.load on rank 0) loads into every shard.
- Memory: state_dict() costs no rank anything; the rank that saves holds the table once.
- A transport limit lowered below a shard: reads go in chunks, pulls and pushes in fragments,
  and no network message exceeds the limit.
"""
import os

import pytest

from tests.parallel.harness import rank_main, run_ranks
from tests.parallel.memory import peak_mib as _peak_mib
from tests.parallel.ps_model import ps_model, ps_step as _step

ROWS, DIM = 5000, 8


def _model(rows=ROWS, dim=DIM):
    return ps_model(rows, dim)


def _shards_table(engine, table):
    """The table assembled from every rank's own shard (local reads, gathered as objects): an
    independent witness of what the shards hold at this point of every rank's program."""
    import numpy as np

    import hybridsync
    from hybridsync.ps.partition import Partition

    shards, kind = table.layout
    mine = (table.engine.local_values(table.handle, -1), Partition(table.num_rows, shards, kind).rows_of(hybridsync.rank())
            if hybridsync.rank() < shards else np.zeros(0, np.int64))
    full = np.zeros((table.num_rows, table.dim), np.float32)
    for rows, ids in hybridsync.allgather_object(mine):
        full[ids] = rows
    return full


def rank_save_idiom(path):
    import numpy as np
    import torch

    import hybridsync.torch as hvd
    from hybridsync import ps

    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model=model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # Horovod's order: wrap, then broadcast
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(3):
        _step(model, opt, step)
    if hvd.rank() == 0:  # Horovod's idiom: the others go straight on to the next steps
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    saved_point = _shards_table(ps.engine(), model["emb"].table)
    for step in range(3, 6):
        _step(model, opt, step)
    hvd.barrier()
    state = torch.load(path, weights_only=True)
    assert type(state["model"]["emb.weight"]) is torch.Tensor  # a plain tensor once saved
    np.testing.assert_array_equal(state["model"]["emb.weight"].numpy(), saved_point)
    slot = state["optimizer"]["hybridsync"]["ps/sharded"]["emb.weight"]["slots"]["sum"]
    assert tuple(slot.shape) == (ROWS, DIM) and float(slot.sum()) > 0
    # The live state dict reads the shards as they are now, on any rank.
    now = model.state_dict()["emb.weight"]
    assert type(now).__name__ == "ShardedTableTensor" and tuple(now.shape) == (ROWS, DIM)
    np.testing.assert_array_equal(now.numpy(), _shards_table(ps.engine(), model["emb"].table))
    # Rank 0 alone restores the saved state (model and server optimizer); everyone trains on.
    if hvd.rank() == 0:
        loaded = torch.load(path, weights_only=True)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    np.testing.assert_array_equal(model["emb"].weight_numpy(), saved_point)
    np.testing.assert_array_equal(model["emb"].table.read(0), slot.numpy())
    _step(model, opt, 6)
    print(f"rank {hvd.rank()}: rank-0 save and load idiom OK", flush=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_horovods_rank0_save_idiom_then_training_steps(np_, tmp_path):
    # A rank waiting on another's program order would fail in 30 s, not 600.
    run_ranks(__file__, "rank_save_idiom", np_, str(tmp_path / "ckpt.pt"), timeout=180,
              env={"HYBRIDSYNC_TIMEOUT_S": "30"})


def rank_state_dict_memory(path):
    import gc

    import torch

    import hybridsync.torch as hvd

    rows, dim = 1_000_000, 32  # 122 MiB
    table_mib = rows * dim * 4 / 2**20
    model = _model(rows, dim)  # rows seeded on the shards: no rank ever held the table
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    _step(model, opt, 0)
    gc.collect()
    before = _peak_mib()
    state = model.state_dict()
    hvd.broadcast_parameters(state, root_rank=0)
    grown = _peak_mib() - before
    print(f"STATE-DICT-MEMORY rank={hvd.rank()} grew={grown:.1f} MiB table={table_mib:.1f} MiB", flush=True)
    assert grown < 0.05 * table_mib, f"state_dict() grew rank {hvd.rank()}'s peak by {grown:.1f} MiB"
    if hvd.rank() == 0:
        torch.save(state, path)
    del state
    gc.collect()
    hvd.barrier()
    grown = _peak_mib() - before
    print(f"SAVE-MEMORY rank={hvd.rank()} grew={grown:.1f} MiB table={table_mib:.1f} MiB", flush=True)
    if hvd.rank() == 0:
        assert grown < 1.1 * table_mib + 16, f"saving grew rank 0's peak by {grown:.1f} MiB"
    else:
        assert grown < 0.05 * table_mib, f"rank {hvd.rank()} grew by {grown:.1f} MiB while rank 0 saved"
    _step(model, opt, 1)


@pytest.mark.parametrize("np_", [2, 3])
def test_state_dict_costs_no_rank_a_table_and_the_saving_rank_one(np_, tmp_path):
    out = run_ranks(__file__, "rank_state_dict_memory", np_, str(tmp_path / "big.pt"), timeout=240)
    assert out.count("SAVE-MEMORY") == np_


def rank_small_messages():
    import numpy as np
    import torch

    import hybridsync.torch as hvd
    from hybridsync import ps

    limit = int(os.environ["HYBRIDSYNC_MAX_MESSAGE_BYTES"])
    rows, dim = 20000, 16  # a shard is 0.4-0.6 MiB, ten times the limit
    model = _model(rows, dim)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model=model)
    engine = ps.engine()
    engine.reset_traffic()
    for step in range(3):
        g = torch.Generator().manual_seed(step * 7 + hvd.rank())
        ids = torch.randint(0, rows, (8192,), generator=g)  # a request of ~4-8 k ids: fragmented
        opt.zero_grad()
        model["out"](model["emb"](ids)).pow(2).mean().backward()
        opt.step()
    whole = model["emb"].weight_numpy()  # a read in chunks under the limit
    np.testing.assert_array_equal(whole, _shards_table(engine, model["emb"].table))
    traffic = engine.traffic()
    print(f"SMALL-MESSAGES rank={hvd.rank()} largest={traffic['largest_message']} limit={limit}", flush=True)
    assert 0 < traffic["largest_message"] <= limit


@pytest.mark.parametrize("np_", [2, 3])
def test_a_lowered_transport_limit_makes_reads_chunk_and_messages_fragment(np_):
    out = run_ranks(__file__, "rank_small_messages", np_, timeout=180,
                    env={"HYBRIDSYNC_MAX_MESSAGE_BYTES": "65536"})
    assert out.count("SMALL-MESSAGES") == np_


if __name__ == "__main__":
    rank_main(globals())
