"""Memory of wrapping: no rank's lifetime peak (ru_maxrss) ever exceeds Horovod's by more than 2%,
in both orders a Horovod script may use (issue 22), measured against real Horovod runs of the
same model (benchmarks/memory.py runs both; its sweep plots the same against table size).

And wrapping a model whose nn.Embedding(sparse=True) tables were built whole costs no memory on
top of the model (issue 13): rank 0, whose rows the shards start from, hands each table's pages
back as they reach the shards, and its own shard only takes memory as it is written -- so the
peak does not grow by a shard. The shards start from rank 0's exact rows (cyclic and block
partitions, a table on fewer shards than ranks), and a weight something else still refers to
(a kept state_dict) is copied, never consumed."""
import sys

import pytest

from tests.parallel.harness import ROOT, rank_main, run_ranks

ROWS, DIM = 400_000, 32  # 48.8 MiB per table


def _model(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(ROWS, DIM, sparse=True),
        "blocks": torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True),
        "few": torch.nn.Embedding(1000, DIM, sparse=True),
        "mlp": torch.nn.Linear(DIM, 1),
    })


def _config(size):
    return {"variables": [{"match": "blocks.*", "sync": "ps", "partition": "block"},
                          {"match": "few.*", "sync": "ps", "partitions": max(1, size - 1)}]}


def _peak_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_wrap_memory():
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    model = _model(seed=7)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # (the first optimizer imports much of torch)
    before = _peak_bytes()  # the whole model has been resident
    opt = hybridsync.DistributedOptimizer(sgd, model=model, config=_config(size))
    grown = _peak_bytes() - before
    shard = ROWS * DIM * 4 // size
    print(f"rank {rank}: wrapping raised the peak by {grown / 2**20:.1f} MiB (a shard is {shard / 2**20:.1f} MiB)",
          flush=True)
    assert grown < shard // 4, f"rank {rank}: wrapping raised the peak by {grown} bytes; a shard is {shard}"
    # The shards hold rank 0's rows, exactly (state_dict gathers them, on every rank).
    state = model.state_dict()
    reference = _model(seed=7)
    for key in ("emb.weight", "blocks.weight", "few.weight"):
        assert torch.equal(state[key], reference.state_dict()[key]), key
    del state, reference
    ids = torch.tensor([[0, 1, ROWS - 1]])
    opt.zero_grad()
    model["mlp"](model["emb"](ids).sum(1)).sum().backward()
    opt.step()

    # A weight something else still holds is read, not consumed: rank 0's kept copy stays intact.
    kept_model = _model(seed=8)
    kept = kept_model.state_dict()  # shares the tables' memory
    expected = kept["emb.weight"].clone()
    hybridsync.DistributedOptimizer(torch.optim.SGD(kept_model.parameters(), lr=0.1), model=kept_model)
    assert torch.equal(kept["emb.weight"], expected)
    assert torch.equal(kept_model.state_dict()["emb.weight"], expected)


@pytest.mark.parametrize("np_", [2, 3])
def test_wrapping_whole_tables_needs_no_memory_beyond_the_model(np_):
    out = run_ranks(__file__, "rank_wrap_memory", np_, timeout=240)
    assert out.count("wrapping raised the peak") == np_, out


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("order", ["wrap-first", "broadcast-first"])
def test_no_rank_ever_needs_more_memory_than_horovod(np_, order):
    """Horovod's README order (wrap, then broadcast_parameters) and the other one; every rank."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory

    runs = {system: memory.measure(np_, system, order, rows=150_000, tables=4, dim=32, steps=5, batch=512,
                                   timeout=240) for system in memory.SYSTEMS}
    for system, run in runs.items():
        assert "failed" not in run, f"{system}: {run.get('failed')}\n{run.get('tail')}"
    horovod = {r["rank"]: r["peak"] for r in runs["horovod"]["ranks"]}
    for r in runs["hybridsync"]["ranks"]:
        ratio = r["peak"] / horovod[r["rank"]]
        print(f"rank {r['rank']}: hybridsync peak {r['peak'] / 2**20:.1f} MiB, Horovod {horovod[r['rank']] / 2**20:.1f} "
              f"MiB ({ratio:.3f}x)")
        assert ratio <= 1.02, f"rank {r['rank']}: hybridsync's lifetime peak is {ratio:.3f}x Horovod's ({order})"


if __name__ == "__main__":
    rank_main(globals())
