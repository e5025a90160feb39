"""Peers that freeze, die or are merely slow: a frozen peer (SIGSTOP) is named, with its host,
by every other rank within the peer timeout and the job ends (inside Horovod's collectives too,
where the heartbeat's watchdog ends it); ranks that finish first are not reported; a peer busy in Python for longer
than that (holding the GIL) is only reported in a warning, and the job finishes."""
import os
import signal
import socket
import sys
import time

from tests.parallel.harness import launch, mark_event, mpirun_prefix, rank_main, run_ranks, seconds_since_event

PEER_TIMEOUT_S = 3


def rank_frozen_peer(directory):
    import numpy as np

    import hybridsync
    from hybridsync import ps

    engine = ps.engine()
    table = engine.add_table("t", 10, 2, 0, "cyclic", "sgd", {"lr": 0.1})
    rank = hybridsync.rank()
    if rank == 1:
        mark_event("frozen")
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive for the OS, silent for its peers
    try:
        engine.pull([table], [np.arange(4)])  # waits for rank 1: raises, and the job ends
    except Exception as e:
        # Each survivor says what it raised, then waits (capped) for the other before the job
        # ends: the first to abort would otherwise cut off a second that is a moment slower.
        print(f"rank {rank} raised: {e}", file=sys.stderr, flush=True)
        open(os.path.join(directory, f"named.{rank}"), "w").close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(directory, f"named.{r}")) for r in (0, 2)):
            time.sleep(0.05)
        raise


def rank_frozen_peer_in_allreduce():
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    hvd.init(backend="mpi")
    hvd.allreduce(torch.ones(3), name="first")  # the backend's communicator exists before the freeze
    if hybridsync.rank() == 1:
        mark_event("frozen")
        os.kill(os.getpid(), signal.SIGSTOP)
    hvd.allreduce(torch.ones(3), name="waits")  # the MPI backend's wait names the frozen rank


def rank_frozen_peer_under_async_ops():
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    hvd.init(backend="mpi")
    hvd.allreduce(torch.ones(3), name="first")
    if hybridsync.rank() == 1:
        mark_event("frozen")
        os.kill(os.getpid(), signal.SIGSTOP)
    handle = hvd.allreduce_async(torch.ones(3), name="in.background")
    while not hvd.poll(handle):  # only the progress thread works on it: it must not wait forever
        time.sleep(0.05)
    print(f"rank {hybridsync.rank()}: the progress thread gave up on the op", flush=True)
    hvd.synchronize(handle)  # raises the thread's error naming the frozen rank


def rank_frozen_peer_in_horovod_allreduce():
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    hvd.init(backend="horovod")
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())

    def step():
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()

    step()
    if hybridsync.rank() == 1:
        mark_event("frozen")
        os.kill(os.getpid(), signal.SIGSTOP)
    # The optimizer's all-reduces go to Horovod directly: its wait cannot raise, and only the
    # heartbeat's watchdog ends the job.
    step()


def rank_one_leaves_early():
    import hybridsync

    if hybridsync.rank() == 0:  # outlives the others by more than the watchdog's limit
        time.sleep(PEER_TIMEOUT_S + 5 + 4)
        print("rank 0 finished after the others left", flush=True)


def rank_busy_peer():
    import numpy as np

    import hybridsync
    from hybridsync import ps

    engine = ps.engine()
    table = engine.add_table("t", 10, 2, 0, "cyclic", "sgd", {"lr": 0.1})
    if hybridsync.rank() == 0:
        end = time.monotonic() + 2.5 * PEER_TIMEOUT_S
        while time.monotonic() < end:  # pure Python: holds the GIL throughout
            sum(range(1000))
    engine.pull([table], [np.arange(4)])
    print(f"rank {hybridsync.rank()}: the slow peer caught up", flush=True)


def test_a_frozen_peer_is_named_by_every_other_rank_within_the_peer_timeout(tmp_path):
    env = {"HYBRIDSYNC_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S), "HYBRIDSYNC_TIMEOUT_S": "120"}
    rc, out = launch(mpirun_prefix(3) + ["-x", "HYBRIDSYNC_PEER_TIMEOUT_S", sys.executable, "-u", __file__,
                                         "rank_frozen_peer", str(tmp_path)], 120, env)
    elapsed = seconds_since_event(out, "frozen")
    assert rc != 0, out
    host = socket.gethostname()
    named = f"rank 1 on host {host} has not been heard from"
    assert f"[1,0]<stderr>:" in out and named in out, out
    assert sum(named in line for line in out.splitlines() if line.startswith(("[1,0]", "[1,2]"))) >= 2, out
    assert elapsed < PEER_TIMEOUT_S + 25, f"the job ended {elapsed:.0f} s after rank 1 froze\n{out}"


def test_a_frozen_peer_is_named_in_a_dense_all_reduce_too():
    env = {"HYBRIDSYNC_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S)}
    rc, out = launch(mpirun_prefix(2) + [sys.executable, "-u", __file__, "rank_frozen_peer_in_allreduce"], 120, env)
    assert rc != 0, out
    assert f"rank 1 on host {socket.gethostname()} has not been heard from" in out, out
    assert seconds_since_event(out, "frozen") < PEER_TIMEOUT_S + 25, out


def test_a_frozen_peer_fails_an_async_op_left_to_the_progress_thread():
    """Nobody waits on the op, only poll() reads it: the MPI backend's progress thread names the
    frozen rank and hands that error to the op, instead of leaving a poll loop spinning forever."""
    env = {"HYBRIDSYNC_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S)}
    rc, out = launch(mpirun_prefix(2) + [sys.executable, "-u", __file__, "rank_frozen_peer_under_async_ops"], 120,
                     env)
    assert rc != 0, out
    assert "rank 0: the progress thread gave up on the op" in out, out
    assert f"rank 1 on host {socket.gethostname()} has not been heard from" in out, out
    assert seconds_since_event(out, "frozen") < PEER_TIMEOUT_S + 25, out


def test_a_frozen_peer_inside_a_horovod_collective_ends_the_job_naming_it():
    """Horovod's wait cannot raise: the heartbeat's watchdog ends the job a grace period after
    the peer timeout, naming the silent rank and its host."""
    env = {"HYBRIDSYNC_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S)}
    rc, out = launch(mpirun_prefix(2) + [sys.executable, "-u", __file__, "rank_frozen_peer_in_horovod_allreduce"],
                     120, env)
    assert rc != 0, out
    assert f"rank 1 on host {socket.gethostname()} has not been heard from" in out, out
    assert "aborting the job" in out, out
    assert seconds_since_event(out, "frozen") < PEER_TIMEOUT_S + 5 + 25, out


def test_ranks_that_finish_first_are_not_reported_silent():
    env = {"HYBRIDSYNC_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S)}
    out = run_ranks(__file__, "rank_one_leaves_early", 2, env=env, timeout=120)
    assert "rank 0 finished after the others left" in out and "not been heard from" not in out, out


def test_a_peer_busy_in_python_past_the_timeout_is_a_warning_not_an_error():
    env = {"HYBRIDSYNC_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S)}
    out = run_ranks(__file__, "rank_busy_peer", 2, env=env, timeout=120)
    assert "is alive: busy" in out and "rank 0 on host" in out, out


if __name__ == "__main__":
    rank_main(globals())
