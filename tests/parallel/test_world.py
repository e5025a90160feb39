"""Every rank sees the right rank/size under mpirun and horovodrun, and MPI's and Horovod's
all-reduce agree."""
import os
import sys
from pathlib import Path

import pytest

from tests.parallel.harness import rank_main, run_ranks


def rank_world(expected_size):
    import numpy as np
    import torch
    from mpi4py import MPI

    import hybridsync
    import horovod.torch as hvd

    hybridsync.init(backend="horovod")  # again: idempotent, and starts Horovod on the same communicator
    size, rank = hybridsync.size(), hybridsync.rank()
    assert size == int(expected_size) == MPI.COMM_WORLD.Get_size()
    assert rank == MPI.COMM_WORLD.Get_rank()
    # One host: local rank/size equal the global ones.
    assert (hybridsync.local_rank(), hybridsync.local_size()) == (rank, size)
    assert hvd.is_initialized() and (hvd.rank(), hvd.size()) == (rank, size)

    x = torch.arange(10, dtype=torch.float32) * (rank + 1) + 0.25
    by_horovod = hvd.allreduce(x, op=hvd.Sum, name="world.x").numpy()
    by_mpi = MPI.COMM_WORLD.allreduce(x.numpy(), op=MPI.SUM)
    expected = np.arange(10) * sum(r + 1 for r in range(size)) + 0.25 * size
    np.testing.assert_allclose(by_horovod, expected, rtol=1e-6)
    np.testing.assert_allclose(by_mpi, expected, rtol=1e-6)
    print(f"rank {rank}/{size}: horovod and MPI all-reduce agree", flush=True)


@pytest.mark.parametrize("np_", [2, 3])
def test_rank_size_and_allreduce_under_mpirun(np_):
    run_ranks(__file__, "rank_world", np_, str(np_))


def test_rank_size_and_allreduce_under_horovodrun():
    horovodrun = str(Path(sys.executable).with_name("horovodrun"))
    run_ranks(__file__, "rank_world", 2, "2", launcher=[horovodrun, "-np", "2"])


def test_init_names_the_mpi_thread_level_it_needs():
    # MPI initialised first with less than MPI_THREAD_MULTIPLE (as a library might): init() says
    # what to set instead of letting the PS's and the heartbeat's threads race inside MPI.
    import subprocess

    code = ("import mpi4py; mpi4py.rc.thread_level = 'serialized'\n"
            "from mpi4py import MPI\n"
            "import hybridsync\n"
            "from hybridsync.runtime import LaunchError\n"
            "try:\n"
            "    hybridsync.init()\n"
            "except LaunchError as e:\n"
            "    print('REFUSED:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert "REFUSED: MPI was initialised with MPI_THREAD_SERIALIZED" in out.stdout, out.stdout + out.stderr
    assert "mpi4py.rc.thread_level" in out.stdout


if __name__ == "__main__":
    rank_main(globals())
