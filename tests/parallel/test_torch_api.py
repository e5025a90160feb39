"""The Horovod-compatible module across real ranks: collectives, broadcasts of model and
optimizer state, misuse errors, and the ported Horovod example."""
import re

import pytest

from tests.parallel.harness import rank_main, run_program, run_ranks, run_scenarios


def rank_collectives(backend):
    import torch

    import hybridsync.torch as hvd

    hvd.init(backend=backend)  # the module-level functions use the backend under test
    assert hvd.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1)).plan.backend == backend
    rank, size = hvd.rank(), hvd.size()
    t = torch.full((3,), float(rank + 1))
    torch.testing.assert_close(hvd.allreduce(t, op=hvd.Sum), torch.full((3,), float(sum(range(1, size + 1)))))
    torch.testing.assert_close(hvd.allreduce(t), torch.full((3,), sum(range(1, size + 1)) / size))
    assert t[0] == rank + 1  # out of place
    gathered = hvd.allgather(torch.arange(rank + 1, dtype=torch.float32))
    torch.testing.assert_close(gathered, torch.cat([torch.arange(r + 1, dtype=torch.float32) for r in range(size)]))
    b = torch.full((2, 2), float(rank))
    hvd.broadcast_(b, root_rank=size - 1)
    assert (b == size - 1).all()
    assert hvd.broadcast_object({"rank": rank}, root_rank=1) == {"rank": 1}
    assert hvd.allgather_object(rank) == list(range(size))

    # Model and optimizer state from rank 0.
    torch.manual_seed(rank)  # different initial weights on every rank
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    if rank == 0:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()  # rank 0 has Adam state, the others none
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    flat = hvd.allgather_object([p.detach().tolist() for p in model.parameters()])
    assert all(x == flat[0] for x in flat)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    assert set(opt.state[model.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    states = hvd.allgather_object(opt.state[model.weight]["exp_avg"].tolist())
    assert all(s == states[0] for s in states)
    print(f"rank {rank}: collectives and broadcasts agree ({backend})", flush=True)


def rank_zero_grad_in_flight():
    import torch

    import hybridsync.torch as hvd

    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, backend="horovod")
    model(torch.randn(3, 4)).sum().backward()  # hooks start the all-reduces
    with pytest.raises(RuntimeError, match="before optimizer.step\\(\\) or optimizer.synchronize\\(\\)"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


def rank_without_horovod():
    import sys

    sys.modules["horovod"] = None  # as if Horovod were not installed
    import torch

    import hybridsync.torch as hvd

    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    assert opt.plan.backend == "mpi" and "horovod" not in {k.split(".")[0] for k, v in sys.modules.items() if v}
    model(torch.full((2, 4), float(hvd.rank()))).sum().backward()
    opt.synchronize()
    mean_input = sum(range(hvd.size())) / hvd.size()
    torch.testing.assert_close(model.weight.grad, torch.full((2, 4), 2 * mean_input))


def test_without_horovod_the_mpi_backend_is_used_with_a_warning():
    out = run_ranks(__file__, "rank_without_horovod", 2)
    assert out.count("Horovod is not installed; dense all-reduce uses MPI (mpi4py)") == 2, out


def test_collectives_and_broadcasts_under_horovod_and_mpi():
    """Both backends in one launch (a launch costs seconds; a failure names its sub-case)."""
    run_scenarios(__file__, 3, ("rank_collectives", "horovod"), ("rank_collectives", "mpi"))


def test_zero_grad_while_exchange_in_flight_is_an_error():
    run_ranks(__file__, "rank_zero_grad_in_flight", 2)


def test_ported_horovod_example_trains():
    out = run_program(2, "examples/torch_mnist_like.py", "--epochs", "3", "--samples", "2048")
    losses = [float(x) for x in re.findall(r"mean train loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < 0.8 * losses[0], out


if __name__ == "__main__":
    rank_main(globals())
