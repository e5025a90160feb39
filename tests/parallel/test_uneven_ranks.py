"""Ranks that do not make the same parameter-server calls (issue 23): never a silent wait.

- hvd.join() with PS tables: a rank that runs out of data joins; the others go on with it
  contributing nothing (its shards still serve them), the average still divides by the world
  size (Horovod's join semantics), and after every rank joined they train on together.
- A rank that leaves early (its program ended) is named by the ranks still waiting for it, at
  once, not after the 600 s timeout.
- Ranks calling different PS operations (a push with updates against a plain push, a pull
  against a barrier) all fail within seconds, naming both operations.
"""
import time

import pytest

from tests.parallel.harness import rank_main, run_ranks, run_scenarios

ROWS, DIM, LR = 50, 4, 0.5


def _batch(rank, step):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, ROWS, (6,), generator=g), torch.randn(6, DIM, generator=g)


def _reference(size, schedule):
    """One process: step k sums the gradients of the (rank, batch) pairs schedule[k] lists,
    divided by the world size (a joined rank counts as zeros, as Horovod's join does)."""
    import torch

    torch.manual_seed(0)
    emb = torch.nn.Embedding(ROWS, DIM)
    lin = torch.nn.Linear(DIM, 1)
    for active in schedule:
        grads = {}
        for r, batch in active:
            ids, target = _batch(r, batch)
            emb.zero_grad()
            lin.zero_grad()
            (lin(emb(ids)) - target.sum(1, keepdim=True)).pow(2).mean().backward()
            for name, p in (("emb", emb.weight), ("w", lin.weight), ("b", lin.bias)):
                grads[name] = grads.get(name, 0) + p.grad.clone()
        with torch.no_grad():
            for name, p in (("emb", emb.weight), ("w", lin.weight), ("b", lin.bias)):
                p -= LR * grads[name] / size
    return emb.weight.detach(), lin.weight.detach(), lin.bias.detach()


def rank_join_with_ps_tables(placement):
    import torch

    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(ROWS, DIM, sparse=True), "lin": torch.nn.Linear(DIM, 1)})
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    # sharded: the rows live on the shards only; replicated: every rank keeps a replica (no model
    # given), which a rank that joined refreshes from the shards when it trains again.
    opt = (hvd.DistributedOptimizer(sgd, model=model) if placement == "sharded" else
           hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), config={
               "variables": [{"match": "emb.*", "sync": "ps"}]}))
    table = (lambda: torch.from_numpy(model["emb"].weight_numpy())) if placement == "sharded" else (
        lambda: model["emb"].weight.detach())
    steps_of = [2 + 2 * r for r in range(size)]  # rank r has 2 + 2r batches
    for step in range(steps_of[rank]):
        ids, target = _batch(rank, step)
        opt.zero_grad()
        (model["lin"](model["emb"](ids)) - target.sum(1, keepdim=True)).pow(2).mean().backward()
        opt.step()
    assert hvd.join() == size - 1
    schedule = [[(r, s) for r in range(size) if s < steps_of[r]] for s in range(max(steps_of))]
    emb, _, _ = _reference(size, schedule)
    if placement == "sharded":  # the shared table took every step (a joined replica catches up later)
        torch.testing.assert_close(table(), emb, rtol=1e-5, atol=1e-6)
    _, w, b = _reference(size, schedule[:steps_of[rank]])  # the dense layer: the steps this rank took
    torch.testing.assert_close(model["lin"].weight.detach(), w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model["lin"].bias.detach(), b, rtol=1e-5, atol=1e-6)
    # Everyone trains on together after the join (the PS counts its calls on from one number),
    # from the dense weights of the rank that took every step, as Horovod scripts do.
    hvd.broadcast_parameters(model.state_dict(), root_rank=size - 1)
    for step in range(2):
        ids, target = _batch(rank, 100 + step)
        opt.zero_grad()
        (model["lin"](model["emb"](ids)) - target.sum(1, keepdim=True)).pow(2).mean().backward()
        opt.step()
    emb, w, b = _reference(size, schedule + [[(r, 100 + k) for r in range(size)] for k in range(2)])
    torch.testing.assert_close(table(), emb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model["lin"].weight.detach(), w, rtol=1e-5, atol=1e-6)
    hvd.join()  # every rank at once: any of them may be the last
    print(f"rank {rank}: join with PS tables ({placement}) matches the one-process reference", flush=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_join_with_uneven_batches_and_ps_tables(np_):
    """Both placements in one launch (a launch costs seconds; each builds its own model)."""
    run_scenarios(__file__, np_, ("rank_join_with_ps_tables", "sharded"), ("rank_join_with_ps_tables", "replicated"),
                  timeout=240, env={"HYBRIDSYNC_TIMEOUT_S": "60"})


def rank_leaves_early():
    import torch

    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(ROWS, DIM, sparse=True)})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model=model)
    leaver = size - 1
    for step in range(2 if rank == leaver else 3):  # the last rank has one batch fewer
        start = time.monotonic()
        try:
            opt.zero_grad()
            model["emb"](_batch(rank, step)[0]).sum().backward()
            opt.step()
        except RuntimeError as exc:
            waited = time.monotonic() - start
            assert rank != leaver and step == 2, (rank, step, exc)
            assert f"rank {leaver} called shutdown (its program is ending)" in str(exc), exc
            assert waited < 15, f"named the leaving rank after {waited:.1f} s"
            print(f"LEFT-EARLY rank={rank} named rank {leaver} after {waited:.1f} s", flush=True)
            return
    assert rank == leaver, "a rank whose peer left went on without an error"


@pytest.mark.parametrize("np_", [2, 3])
def test_a_rank_that_leaves_early_is_named_at_once(np_):
    out = run_ranks(__file__, "rank_leaves_early", np_, timeout=120, env={"HYBRIDSYNC_TIMEOUT_S": "600"})
    assert out.count("LEFT-EARLY") == np_ - 1


def rank_protocol_mismatch(case):
    import numpy as np

    from hybridsync import ps

    engine = ps.engine()
    rank = engine.rank
    t = engine.add_table("t", 10, 2, 0, "cyclic", "sgd", {"lr": 1.0})
    ids, grads = np.array([rank]), np.ones((1, 2), np.float32)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        if case == "updates":  # rank 0 wants the changed rows back, the others push plainly
            engine.push([t], [ids], [grads], 1.0, rank == 0)
            engine.flush()
        else:  # rank 0 pulls while the others wait in a barrier
            if rank == 0:
                engine.pull([t], [ids])
            else:
                engine.barrier("checkpoint")
    waited = time.monotonic() - start
    message = str(raised.value)
    want = (["push(return_updates=True)", "called push "] if case == "updates"
            else ["called pull", "called barrier (checkpoint)"])
    assert "ranks called different PS operations" in message and all(w in message for w in want), message
    assert waited < 10, f"the mismatch took {waited:.1f} s to surface"
    print(f"MISMATCH rank={rank} after {waited:.2f} s", flush=True)


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("case", ["updates", "pull"])
def test_ranks_calling_different_ps_operations_all_fail_at_once(np_, case):
    out = run_ranks(__file__, "rank_protocol_mismatch", np_, case, timeout=120, env={"HYBRIDSYNC_TIMEOUT_S": "600"})
    assert out.count("MISMATCH") == np_


if __name__ == "__main__":
    rank_main(globals())
