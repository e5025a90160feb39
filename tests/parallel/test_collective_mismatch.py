"""Mismatched collectives raise on every rank, naming the collective and the ranks that
disagree -- never a hang, a wrong result or a corrupted heap -- and the job goes on working.

One job per world size runs every case in turn under each backend: the last rank submits
something different; each case checks that every rank raised, then a normal collective proves
that nothing was left behind. Under Horovod the ranks agree before Horovod sees a collective
(hybridsync.comm.horovod_gate), so the cases Horovod itself would wait on forever (names that
differ, a name submitted twice, different kinds under one name) raise too; process sets run
over MPI under both backends."""
import contextlib
import re
import time

import pytest

from tests.parallel.harness import rank_main, run_ranks


def _expect_error(hvd, label, ranks_named, fn):
    """fn() must raise on this rank with a message naming `label` and the odd rank(s)."""
    import torch

    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        fn()
    assert time.monotonic() - start < 10, "a mismatch must raise at once, not after a timeout"
    text = str(info.value)
    assert label in text, text
    for r in ranks_named:
        assert re.search(rf"rank[s]? [\[]?[0-9, ]*\b{r}\b", text), text
    # Nothing left in flight: the next collective works on every rank.
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name=f"after.{label}").item() == hvd.size()
    print(f"rank {hvd.rank()}: {label} raised after {time.monotonic() - start:.3f} s", flush=True)


def mismatch_cases(hvd, rank, size, odd):
    """(label, fn) pairs: collectives whose descriptor differs on rank `odd`."""
    import torch

    me = rank == odd
    return [
        ("allreduce 'm.shape'", lambda: hvd.allreduce(torch.ones(3 + me), name="m.shape")),
        ("allreduce 'm.dtype'", lambda: hvd.allreduce(torch.ones(3, dtype=torch.float64 if me else torch.float32),
                                                      name="m.dtype")),
        ("allreduce 'm.op'", lambda: hvd.allreduce(torch.ones(3), name="m.op", op=hvd.Sum if me else hvd.Average)),
        ("allreduce 'm.scale'", lambda: hvd.allreduce(torch.ones(3), name="m.scale",
                                                      prescale_factor=2.0 if me else 1.0)),
        # Trailing dims differing used to return a wrong shape on one rank and corrupt the heap.
        ("allgather 'm.gather'", lambda: hvd.allgather(torch.ones(2, 3 + me), name="m.gather")),
        ("allgather 'm.ndim'", lambda: hvd.allgather(torch.ones(2, 3, 1) if me else torch.ones(2, 3), name="m.ndim")),
        ("broadcast 'm.root'", lambda: hvd.broadcast(torch.ones(3), root_rank=odd if me else 0, name="m.root")),
        ("broadcast 'm.bshape'", lambda: hvd.broadcast(torch.ones(2 + me), root_rank=0, name="m.bshape")),
    ]


def more_cases(hvd, rank, size, odd):
    import numpy as np
    import torch

    from hybridsync import comm

    me = rank == odd

    def duplicate():
        # The duplicating rank holds its backend's progress lock across both submissions, so its
        # progress thread cannot negotiate the first op in between (a descheduled test thread
        # would otherwise let it run first, and then only the duplicating rank is told, as in
        # Horovod). This pins the case under test: a duplicate submitted before negotiation.
        lock = getattr(comm.backend(), "_progress_lock", None)  # the Horovod backend has no thread
        with lock if me and lock is not None else contextlib.nullcontext():
            first = hvd.allreduce_async(torch.ones(2), name="m.dup")
            if me:  # the duplicating rank is told at once, as by Horovod ...
                with pytest.raises(ValueError, match="still in flight"):
                    hvd.allreduce_async(torch.ones(2), name="m.dup")
        hvd.synchronize(first)  # ... and every rank when the name is negotiated

    def names():
        hvd.allreduce(torch.ones(2), name="m.other" if me else "m.name")

    def kinds():
        return hvd.allgather(torch.ones(2), name="m.kind") if me else hvd.allreduce(torch.ones(2), name="m.kind")

    def fused():  # the optimizer's unverified fused all-reduce (TensorFlow's too): one check per batch
        comm.backend("mpi").allreduce_arrays([np.ones(2), np.ones(3 + me)], name="m.fused")

    def process_set_ranks():
        hvd.add_process_set([odd] if me else [0])

    return [
        ("allreduce 'm.dup'", duplicate),
        ("allreduce 'm.name'", names),
        ("allreduce 'm.kind'", kinds),
        ("allreduce 'm.fused.1'", fused),
        ("broadcast_object 'm.obj'", lambda: hvd.broadcast_object(rank, root_rank=odd if me else 0, name="m.obj")),
        ("process_set 'process_set", process_set_ranks),
    ]


def check_membership(hvd, rank, size):
    """A rank outside a process set cannot use it (raised at once, locally); its members can."""
    import torch

    members = hvd.add_process_set([0, 1])
    if rank in members.ranks:
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=members).item() == 2
    else:
        with pytest.raises(ValueError, match="not part of"):
            hvd.allreduce(torch.ones(1), process_set=members)
    hvd.remove_process_set(members)


def check_no_false_alarms(hvd, rank, size, backend):
    """What Horovod allows is no mismatch: async collectives submitted and waited for in another
    order on each rank, and a user collective one rank waits for before its optimizer step
    while another waits for the step first (the optimizer's all-reduces skip the negotiation, and
    take part in it while they wait), under both backends."""
    import torch

    names = [f"order.{i}" for i in range(4)]
    if rank % 2:
        names.reverse()
    handles = {n: hvd.allreduce_async(torch.full((2,), float(n[-1])), name=n, op=hvd.Sum) for n in names}
    for n in reversed(names) if rank == 0 else names:
        assert hvd.synchronize(handles[n]).tolist() == [float(n[-1]) * size] * 2
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(3):
        metric = hvd.allreduce_async(torch.ones(1), op=hvd.Sum, name=f"metric.{step}")
        if rank == 0:
            hvd.synchronize(metric)
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        assert hvd.synchronize(metric).item() == size


def rank_mismatches():
    import torch

    import hybridsync.torch as hvd

    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    odd = size - 1
    for backend in ("mpi", "horovod"):  # one job, both backends
        hvd.init(backend=backend)
        if size > 2:
            check_membership(hvd, rank, size)
        check_no_false_alarms(hvd, rank, size, backend)
        cases = mismatch_cases(hvd, rank, size, odd) + more_cases(hvd, rank, size, odd)
        for label, fn in cases:
            # The message names the odd rank (the others are named with it, or as the majority).
            _expect_error(hvd, f"{label}", [odd], fn)
        print(f"rank {rank}: {len(cases)} mismatches raised ({backend})", flush=True)
    hvd.barrier()


@pytest.mark.parametrize("np_", [2, 3])
def test_mismatched_collectives_raise_on_every_rank(np_):
    out = run_ranks(__file__, "rank_mismatches", np_, timeout=120)
    assert out.count("mismatches raised") == 2 * np_, out
    assert out.count("raised after") == np_ * 28, out
    assert out.count("14 mismatches raised (horovod)") == np_, out


if __name__ == "__main__":
    rank_main(globals())
