"""The MPI backend's asynchronous collectives progress in the background, as Horovod's do: poll()
only reports, so a rank that lags its peers still finds a just-submitted op unfinished (Horovod's
*_async_fused tests assert that), ops finish while the caller does something else, results are
right, and mismatches still raise on every rank."""
import time

import pytest

from tests.parallel.harness import rank_main, run_ranks


def _arrived(directory, tag, rank, size, cap_s=60.0):
    """Marks this rank arrived at `tag` and waits until every rank has, without any MPI call
    (a collective would itself drive the ops in flight): a file per rank in a shared directory.
    So "every other rank has submitted" is a fact, not a guess that a sleep was long enough."""
    from pathlib import Path

    Path(directory, f"{tag}.{rank}").touch()
    deadline = time.monotonic() + cap_s
    while not all(Path(directory, f"{tag}.{r}").exists() for r in range(size)):
        assert time.monotonic() < deadline, f"not every rank reached {tag} in {cap_s:.0f} s"
        time.sleep(0.01)


def _check_lagging_rank_polls_false(hvd, rank, size, directory, round_):
    """The last rank submits after every other rank is there already: its first poll of each op
    must still say unfinished (nothing progresses inside poll), and synchronize gives the sums."""
    import torch

    hvd.barrier()
    lagging = rank == size - 1
    if lagging:  # the others submit all six ops first (the lagging rank's files: a formality)
        _arrived(directory, f"lag{round_}", rank, size)
    handles, first_polls = [], []
    for i, dtype in enumerate((torch.int32, torch.float32, torch.float64)):
        t = torch.full((size * 2, 3), float(rank + i), dtype=dtype)
        h_sum = hvd.allreduce_async(t, op=hvd.Sum, name=f"lag.sum.{i}")
        first_polls.append(hvd.poll(h_sum))
        h_rs = hvd.reducescatter_async(t, op=hvd.Sum, name=f"lag.rs.{i}")
        first_polls.append(hvd.poll(h_rs))
        handles.append((i, dtype, h_sum, h_rs))
    if not lagging:
        _arrived(directory, f"lag{round_}", rank, size)
    if lagging:
        assert not any(first_polls), f"poll() said a just-submitted op had finished: {first_polls}"
    for i, dtype, h_sum, h_rs in handles:
        expected = float(sum(r + i for r in range(size)))
        assert torch.equal(hvd.synchronize(h_sum), torch.full((size * 2, 3), expected, dtype=dtype))
        assert torch.equal(hvd.synchronize(h_rs), torch.full((2, 3), expected, dtype=dtype))
        assert hvd.poll(h_sum) and hvd.poll(h_rs)


def _check_progress_without_waiting(hvd, rank, size, directory):
    """Submitted on every rank, then nobody waits or polls for a while: the ops finish meanwhile
    (the first poll afterwards says so on every rank)."""
    import torch

    hvd.barrier()
    h = hvd.allreduce_async(torch.full((4,), float(rank)), op=hvd.Sum, name="bg.sum")
    g = hvd.allgather_async(torch.full((rank + 1,), float(rank)), name="bg.gather")
    _arrived(directory, "bg", rank, size)  # (a peer slow to submit would leave the ops unfinished)
    time.sleep(2.0)  # the caller computes: no MPI call, no poll
    if not (hvd.poll(h) and hvd.poll(g)):  # (a loaded machine may not have run the thread yet)
        time.sleep(10.0)
    assert hvd.poll(h) and hvd.poll(g), "async ops made no progress while the caller did other work"
    assert hvd.synchronize(h).tolist() == [float(sum(range(size)))] * 4
    assert hvd.synchronize(g).tolist() == [float(r) for r in range(size) for _ in range(r + 1)]


def _check_mismatch_raises_everywhere(hvd, rank, size):
    """A shape mismatch on the lagging rank, found by the background rounds before anyone waits:
    every rank's synchronize raises it, and the next collective works."""
    import torch

    from hybridsync.comm.negotiation import CollectiveMismatchError

    hvd.barrier()
    odd = rank == size - 1
    if odd:
        time.sleep(0.3)
    h = hvd.allreduce_async(torch.ones(3 + odd), name="bg.mismatch")
    time.sleep(0.5)  # the progress threads negotiate meanwhile
    with pytest.raises(CollectiveMismatchError, match=rf"allreduce 'bg.mismatch'.*rank {size - 1}"):
        hvd.synchronize(h)
    # Different names awaited on different ranks: none can run, and every rank is told.
    h = hvd.allreduce_async(torch.ones(2), name=f"bg.only.{int(odd)}")
    with pytest.raises(CollectiveMismatchError, match="none can run"):
        hvd.synchronize(h)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="bg.after").item() == size


def rank_async_progress(directory):
    import hybridsync.torch as hvd

    hvd.init(backend="mpi")
    rank, size = hvd.rank(), hvd.size()
    for round_ in range(3):  # the lag check is about timing: more than one chance to go wrong
        _check_lagging_rank_polls_false(hvd, rank, size, directory, round_)
    _check_progress_without_waiting(hvd, rank, size, directory)
    _check_mismatch_raises_everywhere(hvd, rank, size)


@pytest.mark.parametrize("np_", [2, 3])
def test_async_ops_progress_in_the_background_and_poll_only_reports(np_, tmp_path):
    run_ranks(__file__, "rank_async_progress", np_, str(tmp_path), timeout=180)


if __name__ == "__main__":
    rank_main(globals())
