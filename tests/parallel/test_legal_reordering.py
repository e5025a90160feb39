"""Orders Horovod allows are no mismatch under either backend (HYBRIDSYNC_BACKEND=mpi | horovod).

Rank 0 starts 'a' asynchronously, computes a little, runs 'b' and only then waits for 'a'; the
other ranks run 'b' then 'a'. Under the MPI backend rank 0's progress thread may negotiate a
round holding only 'a' while its caller already waits for 'b': that is no deadlock (rank 0 has
not yet offered 'b' in that round), and the next round runs 'b'. The gaps vary so that the
rounds land on both sides of each submission, many times."""
import pytest

from tests.parallel.harness import rank_main, run_ranks

ITERATIONS = 60
GAPS_S = (0.0, 0.0002, 0.001, 0.002, 0.005)


def rank_reordered_async():
    import time

    import torch

    import hybridsync.torch as hvd

    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    x, y = torch.ones(4), torch.full((3,), 2.0)
    for i in range(ITERATIONS):
        gap = GAPS_S[i % len(GAPS_S)]
        if rank == 0:
            h = hvd.allreduce_async(x, name=f"a{i}", op=hvd.Sum)
            time.sleep(gap)  # "some compute"
            b = hvd.allreduce(y, name=f"b{i}", op=hvd.Sum)
            a = hvd.synchronize(h)
        else:
            time.sleep(gap * (rank % 2))  # rank 2 (at -np 3) arrives without a gap
            b = hvd.allreduce(y, name=f"b{i}", op=hvd.Sum)
            a = hvd.allreduce(x, name=f"a{i}", op=hvd.Sum)
        assert a.tolist() == [float(size)] * 4, (i, a)
        assert b.tolist() == [2.0 * size] * 3, (i, b)
    print(f"rank {rank}: {ITERATIONS} reordered iterations ran", flush=True)


@pytest.mark.parametrize("backend", ["mpi", "horovod"])
@pytest.mark.parametrize("np_", [2, 3])
def test_async_op_awaited_after_a_later_one_is_no_mismatch(np_, backend):
    out = run_ranks(__file__, "rank_reordered_async", np_, timeout=120, env={"HYBRIDSYNC_BACKEND": backend})
    assert out.count("reordered iterations ran") == np_, out


if __name__ == "__main__":
    rank_main(globals())
