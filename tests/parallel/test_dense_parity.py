"""Parity of the dense path: N ranks x local batch b give the same parameters as one process
with batch N*b (same data, same seed), for every optimizer, both backends, -np 2 and 3.
Each rank also computes the single-process reference itself and compares."""
import pytest

from tests.parallel.harness import rank_main, run_scenarios

STEPS, LOCAL_BATCH, FEATURES = 5, 6, 10


def _model():
    import torch

    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data(step, rows):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, FEATURES, generator=g), torch.randn(rows, 3, generator=g)


def _train(optimizer_factory, wrap, rank, size, micro_batches=1):
    """Trains STEPS steps; with wrap, on this rank's slice; else (reference) on the whole batch."""
    import torch

    import hybridsync.torch as hvd

    model = _model()
    opt = optimizer_factory(model.parameters())
    if wrap:
        opt = wrap(opt, model)
    for step in range(STEPS):
        x, y = _data(step, LOCAL_BATCH * size * micro_batches)
        if wrap:  # this rank's contiguous share of the global batch
            share = LOCAL_BATCH * micro_batches
            x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        opt.zero_grad()
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            (torch.nn.functional.mse_loss(model(xs), ys) / micro_batches).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def rank_parity(backend):
    import torch

    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    optimizers = {
        "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    }
    cases = []  # (label, optimizer, wrap kwargs, micro batches, rtol, atol)
    for label in optimizers:
        cases.append((label, label, {}, 1, 1e-5, 1e-6))
        cases.append((label + "+bpps2", label, {"backward_passes_per_step": 2}, 2, 1e-5, 1e-6))
    # fp16 rounds each gradient to ~3 significant digits before the sum.
    cases.append(("sgd-momentum+fp16", "sgd-momentum", {"compression": hvd.Compression.fp16}, 1, 0, 2e-3))
    cases.append(("sgd-momentum+sum+predivide", "sgd-momentum", {"gradient_predivide_factor": 2.0}, 1, 1e-5, 1e-6))
    for label, opt_name, kwargs, micro, rtol, atol in cases:
        wrap = lambda opt, model: hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                                           backend=backend, **kwargs)
        got = _train(optimizers[opt_name], wrap, rank, size, micro)
        want = _train(optimizers[opt_name], None, rank, size, micro)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{label} ({backend}): {m}")
        # All ranks hold identical parameters.
        gathered = hvd.allgather_object([t.tolist() for t in got])
        assert all(x == gathered[0] for x in gathered), f"{label}: ranks diverged"
        print(f"rank {rank}: {label} matches the {size * LOCAL_BATCH * micro}-sample single-process run", flush=True)

    # op=Sum: the update is the sum of the ranks' gradients (= size x the average).
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)
    got = _train(sgd, lambda opt, model: hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), backend=backend, op=hvd.Sum), rank, size)
    want = _train(lambda ps: torch.optim.SGD(ps, lr=0.1 * size), None, rank, size)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("np_", [2, 3])
def test_dense_parity_under_horovod_and_mpi(np_):
    """Both backends in one launch (a launch costs seconds; each optimizer names its backend)."""
    run_scenarios(__file__, np_, ("rank_parity", "horovod"), ("rank_parity", "mpi"))


if __name__ == "__main__":
    rank_main(globals())
