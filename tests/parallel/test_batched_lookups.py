"""Pulls in input order and the batched lookups built on them, at -np 1, 2 and 3: the engine
writes every id's row (duplicates too) where the id stands, after the pending pushes, next to
tables pulled as unique rows in the same round; a model's PS embeddings pulled in one round from
its pre-hook (one autograd node for all Embeddings) train exactly like one pull per call,
including outputs no loss reaches, modules called under no_grad, padding and frequency scaling."""
import pytest

from tests.parallel.harness import rank_main, run_scenarios


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


def _net():
    import torch

    import hybridsync.torch as hvd

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = hvd.Embedding(40, 4)
            self.b = hvd.Embedding(30, 4, padding_idx=2, scale_grad_by_freq=True)
            self.unused = hvd.Embedding(20, 4)  # called; its output reaches the loss only while use_unused
            self.frozen = hvd.Embedding(15, 4)  # called under no_grad
            self.seq = hvd.Embedding(25, 4)  # a whole 2-D input, from a dict
            self.bag = hvd.EmbeddingBag(35, 4, mode="sum")  # pulled as unique rows in the same round
            self.mlp = torch.nn.Linear(20, 1)
            self.swap, self.use_unused = False, True

        def forward(self, ids, extra):
            a = self.a(ids[:, 0].clone() if self.swap else ids[:, 0])
            b = self.b(ids[:, 1])
            unused = self.unused(ids[:, 2])
            with torch.no_grad():
                frozen = self.frozen(ids[:, 3])
            seq = self.seq(extra["seq"]).mean(1)
            out = self.mlp(torch.cat([a, b, frozen, seq, self.bag(extra["bag"])], 1))
            return out + unused.sum() if self.use_unused else out

    torch.manual_seed(3)
    return Net()


def rank_batched_model():
    import torch
    import torch.nn.functional as F

    import hybridsync
    import hybridsync.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    runs = []
    for batched in (True, False):
        model = _net()
        # Adam on the server: a zero gradient pushed for an output no loss reached would still move
        # the rows that have momentum (those `unused` reached in the first steps).
        opt = hybridsync.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), model=model)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        losses = []
        for step in range(6):
            g = torch.Generator().manual_seed(100 * step + rank)
            ids = torch.stack([torch.randint(0, n, (6,), generator=g) for n in (40, 30, 20, 15)], 1)
            ids[:3, 1] = 2  # the padding row, and repeated ids for scale_grad_by_freq
            extra = {"seq": torch.randint(0, 25, (6, 3), generator=g), "bag": torch.randint(0, 35, (6, 2), generator=g)}
            opt.zero_grad()
            model.use_unused = step < 2
            loss = F.mse_loss(model(ids, extra), torch.ones(6, 1))
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step == 0 and not batched:
                model.a._batcher.pattern = []  # learned at the first forward; now one pull per call
        pattern = model.a._batcher.pattern
        assert len(pattern) == (6 if batched else 0), pattern
        after = model.state_dict()
        torch.testing.assert_close(after["frozen.weight"], before["frozen.weight"], rtol=0, atol=0)
        assert not torch.equal(after["a.weight"], before["a.weight"])
        runs.append((losses, after))
        if batched:  # an input other than the one the pre-hook pulled for is an error, never a stale row
            model.swap = True
            with pytest.raises(RuntimeError, match="PS embedding '.*' was called with an input other"):
                model(ids, extra)
            model.swap = False
            model(ids, extra)  # usable afterwards
    (losses, got), (want_losses, want) = runs
    assert losses == pytest.approx(want_losses, rel=1e-6)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, msg=lambda m: f"{key}: {m}")
    print(f"rank {rank}: batched lookups train like one pull per call", flush=True)


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_pull_in_input_order_and_batched_lookups_train_like_one_pull_per_call(np_):
    """Both in one launch per world size (a launch costs seconds; a failure names its sub-case)."""
    run_scenarios(__file__, np_, ("rank_pull_in_order", "2024"), "rank_batched_model")


if __name__ == "__main__":
    rank_main(globals())
