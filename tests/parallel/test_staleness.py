"""Bounded staleness (`staleness: k` on PS tables) under real mpirun: k = 0 trains bit for bit as
the synchronous default; with a stalled rank the others run exactly k steps ahead and then wait
(the lag their pulls saw never exceeds k); a save waits for every push in flight; a frozen peer
is still named while a rank waits at the bound; word2vec at k = 4 with a straggler ends within
2% of the synchronous loss; the idle serving thread costs next to no CPU."""
import os
import re
import signal
import socket
import sys
import time

import pytest

from tests.parallel.harness import (ROOT, launch, mark_event, mpirun_prefix, rank_main, run_program, run_ranks,
                                    run_scenarios, seconds_since_event)

VOCAB, DIM, BATCH = 50, 4, 8


def _skipgram(k, seed=0, counting=False):
    """An all-PS model (two sparse tables, nothing dense) wrapped with staleness k; counting:
    zero rows and a loss whose gradient does not depend on them (rows count their lookups)."""
    import torch

    import hybridsync.torch as hvd

    class SkipGram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.inp = torch.nn.Embedding(VOCAB, DIM, sparse=True)
            self.out = torch.nn.Embedding(VOCAB, DIM, sparse=True)
            if counting:
                torch.nn.init.zeros_(self.inp.weight)
                torch.nn.init.zeros_(self.out.weight)

        def forward(self, centre, words):
            u, v = self.inp(centre), self.out(words)
            if counting:
                return -(u.sum() + v.sum())  # gradient -1 per lookup: lr 1 (op=Sum) adds 1 per lookup
            return -torch.nn.functional.logsigmoid((u * v).sum(1)).mean()

    model = SkipGram()
    config = {"defaults": {"sparse": {"sync": "ps", "staleness": k}}} if k is not None else None
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0 if counting else 0.5), model=model,
                                   config=config, op=hvd.Sum if counting else hvd.Average)
    return model, opt


def _batch(step, rank):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH,), generator=g), torch.randint(0, VOCAB, (BATCH,), generator=g)


def _step(model, opt, step, rank):
    opt.zero_grad()
    model(*_batch(step, rank)).backward()
    opt.step()


def _tables(opt):
    """The optimizer's PS tables by variable name (what its frontend hands the core)."""
    return {var.name: var.table for var in opt.hybridsync_frontend.variables() if var.table is not None}


def rank_k0_is_the_synchronous_default():
    """staleness: 0 trains exactly as no staleness key (the collective rounds): same bits."""
    import torch

    import hybridsync

    rank = hybridsync.rank()
    finals = []
    for k in (None, 0):
        model, opt = _skipgram(k)
        for step in range(6):
            _step(model, opt, step, rank)
        for table in _tables(opt).values():
            assert table.staleness()["pulls"] == 0  # no bounded pull: every pull was a round
        finals.append({name: torch.as_tensor(t.read()) for name, t in _tables(opt).items()})
    for name in finals[0]:
        assert torch.equal(finals[0][name], finals[1][name]), name


def _progress(directory, rank, steps):
    path = os.path.join(directory, f"rank{rank}")
    with open(path + ".tmp", "w") as fh:
        fh.write(str(steps))
    os.replace(path + ".tmp", path)


def _read_progress(directory, rank):
    try:
        with open(os.path.join(directory, f"rank{rank}")) as fh:
            return int(fh.read())
    except FileNotFoundError:
        return 0


def _entering(directory, rank, step):
    """A fast rank about to take step `step` (its pull comes a few lines later)."""
    open(os.path.join(directory, f"rank{rank}.entering{step}"), "w").close()


def _stall_until_the_others_wait_at(directory, size, bound):
    """The stalled (last) rank's check: every other rank reaches `bound` steps and goes no further."""
    deadline = time.monotonic() + 60
    while any(_read_progress(directory, r) < bound or not os.path.exists(os.path.join(directory, f"rank{r}.entering{bound}"))
              for r in range(size - 1)):
        assert time.monotonic() < deadline, "the fast ranks did not run k steps ahead"
        time.sleep(0.01)
    # They are at their next step's pull now (so it is held at the bound) or would have gone on,
    # had the bound let them; waiting from the mark of entering that step, not from the end of
    # the last, leaves a slow machine no window to push before the pull has come.
    time.sleep(0.5)
    ahead = [_read_progress(directory, r) for r in range(size - 1)]
    assert ahead == [bound] * (size - 1), f"fast ranks at {ahead}, bound {bound}"


def rank_fast_ranks_run_k_steps_ahead_then_wait(k, directory):
    """The last rank stalls outside any PS call after 2 steps: every other rank completes exactly
    k + 1 more steps (its pulls miss at most k of the staller's) and then waits at the bound."""
    import hybridsync

    k = int(k)
    rank, size = hybridsync.rank(), hybridsync.size()
    model, opt = _skipgram(k)
    warm, steps = 2, 10
    for step in range(steps):
        if rank == size - 1 and step == warm:
            _stall_until_the_others_wait_at(directory, size, warm + k + 1)
        elif rank < size - 1:
            _entering(directory, rank, step)
        _step(model, opt, step, rank)
        _progress(directory, rank, step + 1)
    for name, table in _tables(opt).items():
        seen = table.staleness()
        assert seen["staleness"] == k and seen["pulls"] == steps, (name, seen)
        assert seen["max_lag"] <= k, (name, seen)
        if rank == 0:
            assert seen["held"] >= 1 and seen["max_lag"] == k, (name, seen)
    text = hybridsync.explain(file=open(os.devnull, "w"))
    assert f"staleness {k}; lag last" in text, text


def rank_a_save_waits_for_every_push_in_flight(directory):
    """The last rank pushes late (it sleeps before each step); right after the last step every
    rank saves: the checkpoint holds every lookup of every rank (rows count them). Then, trained
    on, hvd.barrier() and rank 0's read alone hold them all too."""
    import numpy as np

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()
    model, opt = _skipgram(3, counting=True)
    steps = 6
    for step in range(steps):
        if rank == size - 1:
            time.sleep(0.05)
        _step(model, opt, step, rank)
    path = os.path.join(directory, "ckpt")
    hybridsync.save_checkpoint(path, model, opt)
    expected = {"inp.weight": np.zeros(VOCAB), "out.weight": np.zeros(VOCAB)}
    for r in range(size):
        for step in range(steps):
            centre, words = _batch(step, r)
            np.add.at(expected["inp.weight"], centre.numpy(), 1.0)
            np.add.at(expected["out.weight"], words.numpy(), 1.0)
    fresh, fresh_opt = _skipgram(3, counting=True)
    hybridsync.load_checkpoint(path, fresh, fresh_opt)
    for name, table in _tables(fresh_opt).items():
        rows = np.asarray(table.read())
        assert np.array_equal(rows, np.repeat(expected[name][:, None], DIM, 1)), name
    # Horovod's way to save: hvd.barrier(), then rank 0 alone reads the model (one-sided reads):
    # the barrier lands every push in flight, so rank 0 reads them all.
    import hybridsync.torch as hvd

    for step in range(steps, 2 * steps):
        if rank == size - 1:
            time.sleep(0.05)
        _step(model, opt, step, rank)
        for r in range(size):
            centre, words = _batch(step, r)
            np.add.at(expected["inp.weight"], centre.numpy(), 1.0)
            np.add.at(expected["out.weight"], words.numpy(), 1.0)
    hvd.barrier()
    if rank == 0:
        for name, table in _tables(opt).items():
            rows = np.asarray(table.read())
            assert np.array_equal(rows, np.repeat(expected[name][:, None], DIM, 1)), name


def rank_a_frozen_peer_is_named_while_waiting_at_the_bound():
    import hybridsync

    model, opt = _skipgram(2)
    _step(model, opt, 0, hybridsync.rank())
    if hybridsync.rank() == 1:
        mark_event("frozen")
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive for the OS, silent for its peers
    for step in range(1, 10):  # rank 0 reaches the bound, waits, and the peer timeout fires
        _step(model, opt, step, hybridsync.rank())


def rank_idle_serving_thread_cpu(seconds):
    """A rank idle in Python (sleeping) while its serving thread waits for requests: the
    thread's CPU time over that while, from /proc (it is named hybridsync-ps)."""
    import hybridsync
    from hybridsync import ps

    ps.engine().add_table("t", 10, 2, 0, "cyclic", "sgd", {"lr": 0.1})

    def serving_cpu_s():
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as fh:
                if fh.read().strip() != "hybridsync-ps":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        raise AssertionError("no thread named hybridsync-ps")

    before, start = serving_cpu_s(), time.monotonic()
    time.sleep(float(seconds))
    used, wall = serving_cpu_s() - before, time.monotonic() - start
    print(f"IDLE-CPU rank={hybridsync.rank()} serving thread {used:.3f} s over {wall:.1f} s", flush=True)
    assert used < 0.1 * wall, f"the idle serving thread used {used:.2f} s of CPU in {wall:.1f} s"


def rank_a_bad_bounded_push_is_raised_on_every_rank(k):
    """The last rank pushes an id out of range on a bounded table (a one-sided push: no round
    carries its error): it raises at once, every other rank at its next pull -- at the latest
    k + 1 steps after it, when the bound needs that step -- naming the table, the id and the rank;
    no row changed, nothing waits, and training goes on."""
    import numpy as np

    import hybridsync
    from hybridsync import ps

    k, rank, size = int(k), hybridsync.rank(), hybridsync.size()
    engine = ps.engine()
    table = engine.add_table("emb", 12, 2, 0, "cyclic", "sgd", {"lr": 1.0})
    engine.set_staleness(table, k)
    bad_rank, bad_step, steps = size - 1, 2, 2 + k + 4
    def rows():
        (_, inverse, unique_rows), = engine.pull([table], [np.arange(12)])
        return np.asarray(unique_rows)[inverse, 0]

    first = rows()
    # (without it a rank that starts late would read, as its `first`, rows some of the others'
    # pushes already changed: they may run up to k + 1 steps ahead of it)
    engine.barrier("start")
    raised, pushed = [], 0
    for step in range(steps):
        try:
            engine.pull([table], [np.arange(12)])  # rows from every shard
            ids = np.array([rank, 1000 if (rank, step) == (bad_rank, bad_step) else 11])
            engine.push([table], [ids], [np.ones((2, 2), np.float32)], 1.0, False)
            pushed += 1
        except (IndexError, RuntimeError) as e:
            raised.append((step, type(e), str(e)))
    engine.barrier("end")  # every rank got here: nothing hangs
    assert len(raised) == 1, raised  # once, though every shard told it
    step, kind, text = raised[0]
    assert "table 'emb': id 1000 is out of range [0, 12)" in text, text
    if rank == bad_rank:
        assert (step, kind) == (bad_step, IndexError), raised
    else:
        assert kind is ps.RemoteError and f"failed on rank {bad_rank}" in text, raised
        # (a rank may be up to k steps behind the bad one, or k + 1 ahead: then the bound waits for it)
        assert bad_step - k <= step <= bad_step + k + 1, raised
    # All or nothing: the bad push changed no row. Each rank lost one step's push (the bad one,
    # or the one after the pull that raised): row r took rank r's other pushes, row 11 every
    # rank's but the bad one, which had 1000 in its place.
    assert pushed == steps - 1, pushed
    change = rows() - first
    assert np.array_equal(change[:size], np.full(size, -(steps - 1.0))), change
    assert change[11] == -size * (steps - 1.0), change
    print(f"BAD-PUSH rank={rank} raised at step {step}: {text}", flush=True)


def rank_a_bad_learning_rate_on_a_bounded_table_raises_on_every_rank():
    """Through the torch optimizer: the last rank's learning rate turns negative for one step
    (bad input found before anything is sent); every rank raises once, naming the table; all
    ranks then train on together."""
    import hybridsync
    from hybridsync import ps

    rank, size = hybridsync.rank(), hybridsync.size()
    model, opt = _skipgram(2)
    raised = []
    for step in range(8):
        if rank == size - 1:
            opt.param_groups[0]["lr"] = -1.0 if step == 2 else 0.5
        try:
            _step(model, opt, step, rank)
        except (ValueError, RuntimeError) as e:
            raised.append((step, str(e)))
    ps.engine().barrier("end")  # every rank got here: nothing hangs
    assert len(raised) == 1, raised
    assert "learning rate must be >= 0" in raised[0][1] and ".weight'" in raised[0][1], raised
    if rank != size - 1:
        assert f"failed on rank {size - 1}" in raised[0][1], raised
    print(f"BAD-LR rank={rank} raised at step {raised[0][0]}: {raised[0][1]}", flush=True)


def test_staleness_zero_is_bit_identical_to_the_synchronous_default_and_a_bad_learning_rate_raises_on_every_rank():
    """(one launch: a bounded table given a bad learning rate raises on every rank, after the
    parity)"""
    out = run_scenarios(__file__, 2, "rank_k0_is_the_synchronous_default",
                        "rank_a_bad_learning_rate_on_a_bounded_table_raises_on_every_rank", timeout=240)
    assert out.count("BAD-LR") == 2, out


@pytest.mark.parametrize("np_,k", [(2, 2), (3, 1)])
def test_fast_ranks_run_exactly_k_steps_ahead_of_a_stalled_rank(np_, k, tmp_path):
    trace = tmp_path / "trace.json"
    run_ranks(__file__, "rank_fast_ranks_run_k_steps_ahead_then_wait", np_, str(k), str(tmp_path),
              env={"HYBRIDSYNC_TIMELINE": str(trace)})
    import json

    lags = [e for e in json.loads(trace.read_text())["traceEvents"]
            if e.get("ph") == "C" and e["name"].startswith("staleness lag ")]
    assert {e["pid"] for e in lags} == set(range(np_)), lags[:4]  # every rank's counter
    assert max(e["args"]["value"] for e in lags) == k, lags  # the timeline shows the lag, up to the bound


def test_a_save_waits_for_every_bounded_push_in_flight(tmp_path):
    run_ranks(__file__, "rank_a_save_waits_for_every_push_in_flight", 3, str(tmp_path))


def test_a_frozen_peer_is_named_while_a_rank_waits_at_the_bound():
    timeout_s = 3
    env = {"HYBRIDSYNC_PEER_TIMEOUT_S": str(timeout_s)}
    rc, out = launch(mpirun_prefix(2) + [sys.executable, "-u", __file__,
                                         "rank_a_frozen_peer_is_named_while_waiting_at_the_bound"], 120, env)
    elapsed = seconds_since_event(out, "frozen")  # (not since the launch: starting takes what the load makes it)
    assert rc != 0, out
    assert f"rank 1 on host {socket.gethostname()} has not been heard from" in out, out
    assert "pull (bounded staleness)" in out, out
    assert elapsed < timeout_s + 25, f"the job ended {elapsed:.0f} s after rank 1 froze\n{out}"


@pytest.mark.parametrize("np_", [2, 3])
def test_a_bad_bounded_push_is_raised_on_every_rank(np_):
    out = run_ranks(__file__, "rank_a_bad_bounded_push_is_raised_on_every_rank", np_, "2", timeout=120)
    assert out.count("BAD-PUSH") == np_, out


def test_the_idle_serving_thread_does_not_spin_a_core():
    out = run_ranks(__file__, "rank_idle_serving_thread_cpu", 2, "2")
    assert out.count("IDLE-CPU") == 2, out


def _held_out_loss(out: str) -> float:
    return float(re.search(r"held-out loss after training ([0-9.]+)", out).group(1))


def test_word2vec_with_a_straggler_at_staleness_4_ends_within_2_percent_of_synchronous(tmp_path):
    losses = {}
    for k in (0, 4):
        config = tmp_path / f"k{k}.yaml"
        config.write_text(f"defaults:\n  sparse: {{sync: ps, staleness: {k}}}\n")
        out = run_program(2, str(ROOT / "examples" / "torch_word2vec.py"), "--steps", "150", "--vocab", "5000",
                          "--tokens", "100000", "--batch-size", "128", "--dim", "16", "--log-every", "150",
                          "--slow-ms", "5", "--config", str(config), timeout=240)
        losses[k] = _held_out_loss(out)
        if k:  # the straggler made the fast rank's pulls miss some of its steps, never more than 4
            lags = [int(m) for m in re.findall(r"lag last \d+, max (\d+)", out)]
            assert lags and max(lags) <= 4 and max(lags) >= 1, out
    print(f"word2vec held-out loss: k=0 {losses[0]:.4f}, k=4 {losses[4]:.4f}")
    assert abs(losses[4] - losses[0]) <= 0.02 * losses[0], losses


if __name__ == "__main__":
    rank_main(globals())
