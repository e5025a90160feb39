"""Adagrad's accumulators across a batch change, under real mpirun at 2 and 3 ranks (issue 38).

A model with a dense layer under torch.optim.Adagrad and three PS tables under its Adagrad server
rule -- a sharded fixed table, one with a disk tier holding one row per shard in memory (the rest
on disk, 16-bit rows), and a DynamicEmbedding -- trains with the adaptive loader; between two
steps the batch changes (set as a decision adopted would set it: no timing involved). At the
step the change takes effect, after its synchronize (the pushes held) every rank checks: the
dense sums and every stored row's sums on every shard are exactly f times what they were; f is
the same on every rank, from the noise scale every rank read alike, and the one the formula
gives; rows never touched keep their initial sums. With rescale_accumulators=False nothing
moves. (Parity of the training that follows against a one-process replay that applies the
same rescale: tests/parallel/test_composition.py.)
"""
import pytest

from tests.parallel.harness import rank_main, run_ranks

ROWS, DIM, FEATURES, DATA, LR = 30, 3, 4, 480, 0.1


def rank_rescale(setting, tier_dir):
    import json

    import numpy as np
    import torch

    import hybridsync.torch as hvd
    from hybridsync.adaptive.scaling import accumulator_factor

    setting = json.loads(setting)
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fixed = torch.nn.Embedding(ROWS, DIM, sparse=True)
            self.tiered = torch.nn.Embedding(ROWS, DIM, sparse=True)
            self.dyn = hvd.DynamicEmbedding(DIM, name="dyn", seed=5)
            self.lin = torch.nn.Linear(FEATURES, DIM)

        def forward(self, ids, x):
            return ((self.fixed(ids) + self.tiered(ids) + self.dyn(ids * 7919)) * self.lin(x)).sum(1)

    model = Net()
    config = {"variables": [{"match": "tiered.*",
                             "storage": {"dtype": "float16", "memory_rows": size, "path": tier_dir}}]}
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=LR), model=model, config=config,
                                   adaptive={"rescale_accumulators": setting})
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ROWS - 5, (DATA,), generator=g)  # rows ROWS-5.. are never touched
    x = torch.randn(DATA, FEATURES, generator=g)
    y = torch.randn(DATA, generator=g)
    loader = hvd.AdaptiveDataLoader(torch.utils.data.TensorDataset(ids, x, y), batch_size=4 * size,
                                    interval=10_000, warmup=10_000)  # no decision of its own: the test sets one
    loader.autoscale_batch_size(16 * size, local_bsz_bounds=(1, 16))
    tables = [model.fixed.table, model.tiered.table]

    def state():
        """Dense sums, and every shard's sums of the fixed tables and of the dynamic table's ids."""
        dense = [opt.state[p]["sum"].clone() for p in model.lin.parameters()]
        dyn = model.dyn.table.read_state(rows=False, slots=True)
        return dense, [t.read(0) for t in tables], (dyn["ids"], dyn["slot.sum"])

    checked = 0
    for step, (i, xb, yb) in enumerate(loader):
        opt.zero_grad()
        ((model(i, xb) - yb) ** 2).mean().backward()
        pending = opt.adaptive.accumulators.pending
        if step == 5:
            assert pending is not None if setting is not False else pending is None, pending
            phi = opt.adaptive.stats.steady()["noise_scale"]
            assert hvd.allgather_object(phi) == [phi] * size, "ranks read different noise scales"
            before = state()
            opt.synchronize()  # the rescale, then the exchange; the pushes wait for step()
            after = state()
            if setting is False:
                for a, b in zip(before[0] + before[1], after[0] + after[1]):
                    assert np.array_equal(np.asarray(a), np.asarray(b))
                assert not opt.adaptive.accumulators.log
            else:
                entry = opt.adaptive.accumulators.log[-1]
                f = entry["factor"]
                assert entry["applied"] and (entry["from"], entry["to"]) == (4 * size, 8 * size), entry
                assert f == accumulator_factor(4 * size, 8 * size, phi) and 0 < f < 1, entry
                assert hvd.allgather_object(f) == [f] * size, "ranks rescaled by different factors"
                for a, b in zip(before[0], after[0]):  # dense: torch's float32 product
                    assert torch.equal(b, a * f)
                f32 = np.float32(f)
                for a, b in zip(before[1], after[1]):  # every shard, memory and disk tier
                    assert np.array_equal(b, a * f32)
                    assert (a[ROWS - 5:] == 0).all() and (b[ROWS - 5:] == 0).all()  # never touched
                    assert (a[:ROWS - 5] != 0).any()
                assert np.array_equal(before[2][0], after[2][0])
                assert np.array_equal(after[2][1], before[2][1] * f32) and before[2][1].any()
                tier = model.tiered.table.tier_stats()
                assert tier["disk_rows"] > 0, tier  # rows on the disk tier were among them
            with opt.skip_synchronize():
                opt.step()
            checked += 1
        else:
            assert pending is None, (step, pending)
            opt.step()
        if step == 4:  # between steps, as an adopted decision sets it: 8 samples per rank from now on
            opt._hs_adaptive.set_batch(8, 1)
            loader.batches.changes.append((opt.adaptive.steps, 8, 1))
        if step == 8:
            break
    assert checked == 1
    assert opt.adaptive.accumulators.built_at == (8 * size if setting is not False else 0)
    if setting is not False:  # explain() shows it
        from hybridsync.adaptive.report import describe
        assert f"rescaled at step 5: batch {4 * size} -> {8 * size}" in "\n".join(describe(opt.adaptive.summary()))


@pytest.mark.parametrize("np_", [2, 3])
def test_a_batch_change_rescales_every_adagrad_sum_alike_on_every_rank(np_, tmp_path):
    run_ranks(__file__, "rank_rescale", np_, '"auto"', str(tmp_path / "tiers"), timeout=120)


def test_rescale_off_leaves_the_state_as_it_was(tmp_path):
    run_ranks(__file__, "rank_rescale", 2, "false", str(tmp_path / "tiers"), timeout=120)


if __name__ == "__main__":
    rank_main(globals())
