"""Parity of the sparse path: N ranks x local batch b give the same embedding rows and dense
weights as one process with batch N*b (rtol 1e-5) after 10 steps, for SGD, Adagrad and Adam
under a step LR schedule, in both placements, at -np 2 and -np 3 (uneven shards). Every rank computes the
single-process reference itself."""
import pytest

from tests.parallel.harness import rank_main, run_scenarios

STEPS, LOCAL_BATCH = 10, 5
ROWS, BAG_ROWS, DIM = 50, 31, 4


def _model():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
            self.bag = torch.nn.EmbeddingBag(BAG_ROWS, DIM, mode="sum", sparse=True)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(2 * DIM + 2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

        def forward(self, ids, bag_ids, dense):
            return self.mlp(torch.cat([self.emb(ids).mean(1), self.bag(bag_ids), dense], dim=1))

    torch.manual_seed(7)
    return Net()


def _batch(step, size):
    """The global batch of one step: heavy duplication, and ids only one rank's slice touches."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    n = LOCAL_BATCH * size
    ids = torch.randint(0, 6, (n, 3), generator=g)  # few hot ids, repeated within and across ranks
    ids[:, 2] = torch.randint(0, ROWS, (n,), generator=g)  # a long tail
    bag_ids = torch.randint(0, BAG_ROWS, (n, 2), generator=g)
    dense = torch.randn(n, 2, generator=g)
    y = torch.randn(n, 1, generator=g)
    return ids, bag_ids, dense, y


def _optimizers(name, model, reference):
    import torch

    dense = [p for n, p in model.named_parameters() if n.startswith("mlp")]
    sparse = [p for n, p in model.named_parameters() if not n.startswith("mlp")]
    if name == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.2)]
    if name == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.1)]
    if reference:  # torch's Adam cannot take sparse gradients; SparseAdam is the lazy rule
        return [torch.optim.Adam(dense, lr=0.01), torch.optim.SparseAdam(sparse, lr=0.01)]
    return [torch.optim.Adam(model.parameters(), lr=0.01)]


def _train(name, placement, rank, size, micro=1):
    import torch
    import torch.nn.functional as F

    import hybridsync.torch as hvd

    model = _model()
    optimizers = _optimizers(name, model, reference=placement is None)
    if placement == "sharded":
        optimizers = [hvd.DistributedOptimizer(optimizers[0], model=model, backward_passes_per_step=micro)]
    elif placement == "replicated":
        optimizers = [hvd.DistributedOptimizer(optimizers[0], named_parameters=model.named_parameters(),
                                               backward_passes_per_step=micro)]
    # The learning rate changes during training: the server-side rules must follow it.
    schedules = [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) for opt in optimizers]
    for step in range(STEPS):
        ids, bag_ids, dense, y = _batch(step, size)
        if placement is not None:
            part = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            ids, bag_ids, dense, y = ids[part], bag_ids[part], dense[part], y[part]
        for opt in optimizers:
            opt.zero_grad()
        # micro > 1: gradient accumulation over micro-batches whose losses add up to the mean.
        for chunk in zip(*(t.chunk(micro) for t in (ids, bag_ids, dense, y))):
            (F.mse_loss(model(*chunk[:3]), chunk[3], reduction="sum") / len(y)).backward()
        for opt in optimizers:
            opt.step()
        for schedule in schedules:
            schedule.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, optimizers[0]


def rank_parity(backend):
    import torch

    import hybridsync.torch as hvd

    hvd.init(backend=backend)  # the dense backend of every optimizer below
    rank, size = hvd.rank(), hvd.size()
    for name in ("sgd", "adagrad", "adam"):
        want, _ = _train(name, None, rank, size)
        for placement in ("sharded", "replicated"):
            got, opt = _train(name, placement, rank, size)
            assert set(got) == set(want)
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{name}/{placement} {key}: {m}")
            assert opt.plan.backend == backend
            routes = {v.name: (v.route.value, v.placement.value) for v in opt.plan.variables}
            assert routes["emb.weight"] == routes["bag.weight"] == ("ps", placement), routes
            assert routes["mlp.0.weight"] == ("allreduce", "-"), routes
            print(f"rank {rank}: {name}/{placement} matches the {size * LOCAL_BATCH}-sample run", flush=True)
    # Gradient accumulation: 5 samples in micro-batches of 3 + 2 per rank, one exchange per step.
    want, _ = _train("adagrad", None, rank, size)
    for placement in ("sharded", "replicated"):
        got, _ = _train("adagrad", placement, rank, size, micro=2)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"adagrad/{placement}/2 passes {key}: {m}")


@pytest.mark.parametrize("np_", [2, 3])
def test_sparse_parity_under_mpi_and_horovod(np_):
    """Both backends in one launch (a launch costs seconds; a failure names its sub-case)."""
    run_scenarios(__file__, np_, ("rank_parity", "mpi"), ("rank_parity", "horovod"), timeout=360)


if __name__ == "__main__":
    rank_main(globals())
