"""The PyTorch frontend with the model on a CUDA device, at -np 1, 2 and 3 (every rank on the one GPU).

Needs a CUDA device: skipped where torch sees none (CI has none). On a GPU machine:
`bash tests/gpu/run_on_device.sh` (it also sets up MPI there from carried wheels), or
`python -m pytest tests/gpu` where hybridsync is installed. docs/testing.md has the details.

What it checks, each against the same thing on the CPU or against a one-process reference:
- Horovod's collectives on CUDA tensors: results on the input's device, values equal to the CPU
  run's, in-place variants writing the CUDA tensor, half precision, broadcast of a CUDA model
  and of Adam's CUDA state.
- The composition test (tests/parallel/test_composition.py: sharded, dynamic, bounded-staleness
  and disk-tier tables, the adaptive batch with accumulation, a skipped non-finite step, elastic
  commit/restore, join, checkpoints reloaded at another world size) with the model on CUDA,
  against its one-process CPU replay.
- examples/torch_dlrm.py --device cuda trains (its loss falls) with the tables on the shards.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.parallel.harness import rank_main, run_program, run_ranks, run_scenarios

torch = pytest.importorskip("torch")
# HYBRIDSYNC_GPU_TEST_DEVICE=cpu runs the same checks on the CPU (the test code itself, without a GPU).
DEVICE = os.environ.get("HYBRIDSYNC_GPU_TEST_DEVICE", "cuda")
if __name__ != "__main__" and DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (see tests/gpu/run_on_device.sh)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
COMPOSITION = str(ROOT / "tests" / "parallel" / "test_composition.py")


def _backends():
    try:
        import horovod.torch  # noqa: F401
        return ["mpi", "horovod"]
    except ImportError:
        return ["mpi"]


def _device():
    """This rank's device: GPU local_rank % GPUs (the ranks share one GPU on a one-GPU machine)."""
    import hybridsync

    if DEVICE == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", hybridsync.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


# -- collectives ------------------------------------------------------------------------------------
def rank_collectives():
    import torch

    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    device = _device()

    def on_both(make):
        """(the CUDA tensor, the same values on the CPU)"""
        cpu = make()
        return cpu.to(device), cpu

    def same(got, want, what):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=0, msg=what)

    x, x_cpu = on_both(lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1))
    for op, name in ((hvd.Sum, "sum"), (hvd.Average, "average"), (hvd.Max, "max"), (hvd.Min, "min")):
        got = hvd.allreduce(x, op=op, name=f"allreduce.{name}")
        assert got.device == device, (name, got.device)
        same(got, hvd.allreduce(x_cpu, op=op, name=f"allreduce.cpu.{name}"), f"allreduce {name}")

    y = x.clone()
    out = hvd.allreduce_(y, op=hvd.Sum, name="allreduce_")
    assert out.data_ptr() == y.data_ptr() and y.device == device
    same(y, x_cpu * sum(r + 1 for r in range(size)) / (rank + 1), "allreduce_ in place")

    # (Horovod's own CPU build takes no bfloat16: under HYBRIDSYNC_BACKEND=horovod, as there)
    halves = (torch.float16,) if os.environ.get("HYBRIDSYNC_BACKEND") == "horovod" else (torch.float16, torch.bfloat16)
    for dtype in halves:
        h = torch.full((5,), float(rank + 1), dtype=dtype, device=device)
        got = hvd.allreduce(h, op=hvd.Sum, name=f"allreduce.{dtype}")
        assert got.dtype == dtype and got.device == device, (got.dtype, got.device)
        same(got, torch.full((5,), float(sum(range(1, size + 1))), dtype=dtype), f"allreduce {dtype}")

    group = [x, x * 2, torch.ones(7, device=device) * rank]
    got = hvd.grouped_allreduce(group, op=hvd.Sum, name="grouped")
    want = hvd.grouped_allreduce([t.cpu() for t in group], op=hvd.Sum, name="grouped.cpu")
    for n, (g, w) in enumerate(zip(got, want)):
        assert g.device == device, (n, g.device)
        same(g, w, f"grouped_allreduce[{n}]")

    mine = torch.full((rank + 1, 3), float(rank), device=device)  # ragged first dimension
    got = hvd.allgather(mine, name="allgather")
    assert got.device == device and got.shape == (sum(r + 1 for r in range(size)), 3), (got.device, got.shape)
    same(got, torch.cat([torch.full((r + 1, 3), float(r)) for r in range(size)]), "allgather")

    b = torch.full((4,), float(rank), device=device)
    hvd.broadcast_(b, root_rank=size - 1, name="broadcast_")
    same(b, torch.full((4,), float(size - 1)), "broadcast_ in place")
    got = hvd.broadcast(torch.full((2, 2), float(rank), device=device), root_rank=0, name="broadcast")
    assert got.device == device
    same(got, torch.zeros(2, 2), "broadcast")

    sent = torch.arange(size * 2, dtype=torch.float32, device=device) + 100 * rank
    got, received = hvd.alltoall(sent, splits=torch.full((size,), 2, dtype=torch.int32), name="alltoall")
    assert got.device == device, got.device
    same(got, torch.cat([torch.arange(rank * 2, rank * 2 + 2, dtype=torch.float32) + 100 * r for r in range(size)]),
         "alltoall")

    # A model and Adam's state on the GPU, broadcast from the last rank as Horovod's README does.
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4, device=device)).sum().backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=size - 1)
    hvd.broadcast_optimizer_state(opt, root_rank=size - 1)
    for key, value in model.state_dict().items():
        assert value.device == device, (key, value.device)
        everyone = hvd.allgather(value[None], name=f"check.{key}")
        for r in range(size):
            same(everyone[r], everyone[size - 1], f"broadcast_parameters {key} on rank {r}")
    for p in model.parameters():
        for key, value in opt.state[p].items():
            if torch.is_tensor(value) and value.dim():
                assert value.device == device, (key, value.device)
                everyone = hvd.allgather(value[None], name="check.state")
                same(everyone[rank], everyone[size - 1], f"broadcast_optimizer_state {key}")


def rank_dense_training():
    """A dense model on CUDA through DistributedOptimizer: every rank ends with the same weights,
    equal to one process's SGD on the whole batch."""
    import torch

    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    device = _device()
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).double()
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).double()
    model.load_state_dict(reference.state_dict())
    model.to(device)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(4 * size, 6, generator=gen).double(), torch.randn(4 * size, generator=gen).double()
        opt.zero_grad()
        mine = slice(4 * rank, 4 * rank + 4)
        ((model(x[mine].to(device)).squeeze(1) - y[mine].to(device)) ** 2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ((reference(x).squeeze(1) - y) ** 2).mean().backward()
        ref_opt.step()
    for (key, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        assert got.device == device, (key, got.device)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-12, msg=key)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_collectives_and_dense_training_on_cuda(backend, np_):
    run_scenarios(__file__, np_, "rank_collectives", "rank_dense_training", env={"HYBRIDSYNC_BACKEND": backend})


# -- every feature at once --------------------------------------------------------------------------
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("np_,resume_np", [(1, 2), (2, 3), (3, 1)])
def test_composition_on_cuda(tmp_path, backend, np_, resume_np):
    env = {"HYBRIDSYNC_BACKEND": backend}
    run_ranks(COMPOSITION, "rank_job1", np_, str(tmp_path), DEVICE, env=env, timeout=300)
    run_ranks(COMPOSITION, "rank_job2", resume_np, str(tmp_path), DEVICE, env=env, timeout=300)


# -- the example ------------------------------------------------------------------------------------
def test_dlrm_example_on_cuda():
    out = run_program(2, str(ROOT / "examples" / "torch_dlrm.py"), "--device", DEVICE, "--steps", "150",
                      "--rows", "20000", "--batch-size", "256", "--log-every", "50", timeout=300)
    losses = [float(v) for v in re.findall(r"step\s+\d+\s+loss ([0-9.]+)", out)]
    assert len(losses) == 3, out
    assert losses[-1] < losses[0], (losses, out)


if __name__ == "__main__":
    rank_main(globals())
