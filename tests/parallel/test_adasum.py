"""Adasum, as Horovod has it, under both dense backends on real ranks: hvd.allreduce(op=Adasum)
(one tensor, grouped, in place, pre/post scaled, float16/64) equals the pairwise tree computed
here from every rank's input, and is the same bits on every rank; DistributedOptimizer(op=Adasum)
matches an Adasum of per-rank updates computed here (MPI backend) and is bit-for-bit Horovod's own
Adasum optimizer (Horovod backend); a non-power-of-two job raises on every rank."""
import pytest

from tests.parallel.harness import rank_main, run_scenarios


def adasum_tree(vectors):
    """Adasum of the ranks' vectors in rank order: neighbours, then pairs of pairs, ..."""
    import torch

    level = [v.double() for v in vectors]
    while len(level) > 1:
        combined = []
        for a, b in zip(level[0::2], level[1::2]):
            dot, a_sq, b_sq = (a * b).sum(), (a * a).sum(), (b * b).sum()
            a_coeff = 1 - dot / a_sq / 2 if a_sq >= 1e-8 else 1.0
            b_coeff = 1 - dot / b_sq / 2 if b_sq >= 1e-8 else 1.0
            combined.append(a_coeff * a + b_coeff * b)
        level = combined
    return level[0]


def _inputs(size, seed, shape=(6, 5)):
    import torch

    return [torch.randn(*shape, generator=torch.Generator().manual_seed(seed + r)) for r in range(size)]


def check_collectives(hvd, rank, size):
    import torch

    xs = _inputs(size, 10)
    got = hvd.allreduce(xs[rank], op=hvd.Adasum, name="ada.one")
    torch.testing.assert_close(got, adasum_tree(xs).float(), rtol=1e-5, atol=1e-5)
    everyone = hvd.allgather_object(got.tolist(), name="ada.bits")
    assert all(e == everyone[0] for e in everyone), "ranks disagree on the Adasum result"
    # Orthogonal contributions add; identical ones stay as they are (Adasum's two limits).
    basis = torch.zeros(size)
    basis[rank] = 2.0
    assert hvd.allreduce(basis, op=hvd.Adasum, name="ada.orth").tolist() == [2.0] * size
    same = torch.tensor([1.5, -3.0, 0.25])
    torch.testing.assert_close(hvd.allreduce(same, op=hvd.Adasum, name="ada.same"), same)
    # Grouped: each tensor its own coefficients; in place; pre/post scaling as Horovod applies it.
    ys = _inputs(size, 40, (3,))
    a, b = hvd.grouped_allreduce([xs[rank], ys[rank]], op=hvd.Adasum, name="ada.group")
    torch.testing.assert_close(a, adasum_tree(xs).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, adasum_tree(ys).float(), rtol=1e-5, atol=1e-5)
    z = xs[rank].clone()
    hvd.allreduce_(z, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0, name="ada.scaled")
    torch.testing.assert_close(z, 3.0 * adasum_tree([x * 0.5 for x in xs]).float(), rtol=1e-5, atol=1e-5)
    wide = hvd.allreduce(xs[rank].double(), op=hvd.Adasum, name="ada.f64")
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide, adasum_tree(xs), rtol=1e-12, atol=1e-12)
    half = hvd.allreduce(xs[rank].half(), op=hvd.Adasum, name="ada.f16")
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), adasum_tree([x.half() for x in xs]).float(), rtol=2e-3, atol=2e-3)
    with pytest.raises(TypeError, match="float16, float32 or float64"):
        hvd.allreduce(torch.arange(3), op=hvd.Adasum, name="ada.ints")


def check_optimizer(hvd, rank, size, backend):
    import copy

    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    start = copy.deepcopy(model)

    def batch(r, step, k):
        return torch.randn(5, 4, generator=torch.Generator().manual_seed(1000 + 100 * r + 10 * step + k))

    def train(module, opt, r, steps=3, passes=2):
        for step in range(steps):
            opt.zero_grad()
            for k in range(passes):
                module(batch(r, step, k)).pow(2).sum().backward()
            opt.step()

    ours = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05),
                                    named_parameters=model.named_parameters(), op=hvd.Adasum,
                                    backward_passes_per_step=2)
    assert isinstance(ours, torch.optim.Adam)
    train(model, ours, rank)
    if backend == "horovod":  # Horovod's own Adasum optimizer on the same start and batches
        import horovod.torch

        theirs_model = copy.deepcopy(start)
        theirs = horovod.torch.DistributedOptimizer(
            torch.optim.Adam(theirs_model.parameters(), lr=0.05),
            named_parameters=[(f"horovod.{n}", p) for n, p in theirs_model.named_parameters()],
            op=horovod.torch.Adasum, backward_passes_per_step=2)
        train(theirs_model, theirs, rank)
        for a, b in zip(model.parameters(), theirs_model.parameters()):
            assert torch.equal(a, b), (a, b)
    # Computed here: every rank's own Adam update each step, combined with the Adasum tree.
    replicas = [copy.deepcopy(start) for _ in range(size)]
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in replicas]
    for step in range(3):
        before = [[p.detach().clone() for p in m.parameters()] for m in replicas]
        for r, (m, opt) in enumerate(zip(replicas, opts)):
            opt.zero_grad()
            for k in range(2):
                m(batch(r, step, k)).pow(2).sum().backward()
            opt.step()
        for i in range(len(before[0])):
            change = adasum_tree([list(m.parameters())[i].detach() - b[i] for m, b in zip(replicas, before)])
            for m, b in zip(replicas, before):
                list(m.parameters())[i].data.copy_(b[i] + change.float())
    for a, b in zip(model.parameters(), replicas[0].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no parameter-server route"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, op=hvd.Adasum)


def rank_adasum(backend):
    import hybridsync.torch as hvd

    hvd.init(backend=backend)
    check_collectives(hvd, hvd.rank(), hvd.size())
    check_optimizer(hvd, hvd.rank(), hvd.size(), backend)


def rank_not_a_power_of_two(backend):
    import torch

    import hybridsync.torch as hvd

    hvd.init(backend=backend)
    with pytest.raises(NotImplementedError, match="power of 2|power-of-two"):
        hvd.allreduce(torch.ones(3), op=hvd.Adasum, name="ada.three")
    model = torch.nn.Linear(2, 1)
    with pytest.raises(NotImplementedError, match="power-of-two number of ranks"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    hvd.allreduce(torch.ones(1), name="ada.still.alive")  # the job carries on after the errors


# Both backends in one launch per world size (a launch starts ranks that import torch: seconds
# on 2 cores); each scenario sets its backend with hvd.init(backend=...); a failure names its sub-case.

@pytest.mark.parametrize("np_", [2, 4])
def test_adasum_allreduce_and_optimizer_under_mpi_and_horovod(np_):
    run_scenarios(__file__, np_, ("rank_adasum", "mpi"), ("rank_adasum", "horovod"), timeout=300)


def test_adasum_on_three_ranks_raises_on_every_rank_under_mpi_and_horovod():
    run_scenarios(__file__, 3, ("rank_not_a_power_of_two", "mpi"), ("rank_not_a_power_of_two", "horovod"))


if __name__ == "__main__":
    rank_main(globals())
