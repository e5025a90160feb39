"""Checkpoints: saved at -np 2, loaded at -np 3 and -np 1 with identical parameters and server
state, and training continued from them gives the numbers of the uninterrupted run (SGD,
Adagrad, Adam); corrupt, missing and foreign checkpoints are errors naming the file or the
variable on every rank; a rank killed mid-save leaves the previous checkpoint loadable; a killed
rank ends the job within seconds; elastic State resumes at another world size."""
import os
import signal
import sys
import time

import pytest

from tests.parallel.harness import launch, mpirun_prefix, rank_main, run_ranks

GLOBAL_BATCH, STEPS = 6, 4
OPTIMIZERS = ("sgd", "adagrad", "adam")


def _model():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(40, 4, sparse=True)  # sharded on the PS
            self.rep = torch.nn.Embedding(30, 4, sparse=True)  # replicated (config rule)
            self.mlp = torch.nn.Linear(8, 1)

        def forward(self, ids):
            return self.mlp(torch.cat([self.emb(ids[:, 0]), self.rep(ids[:, 1])], 1)).squeeze(1)

    return Net()


def _wrapped(name):
    import torch

    import hybridsync.torch as hvd

    model = _model()
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.3), "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.2),
            "adam": lambda p: torch.optim.Adam(p, lr=0.05)}[name]
    config = {"variables": [{"match": "rep.weight", "sync": "ps", "placement": "replicated"}]}
    return model, hvd.DistributedOptimizer(make(model.parameters()), model=model, config=config)


def _train(model, opt, steps):
    import torch

    import hybridsync

    rank, size = hybridsync.rank(), hybridsync.size()
    share = GLOBAL_BATCH // size
    for step in steps:
        g = torch.Generator().manual_seed(step)
        ids = torch.stack([torch.randint(0, 40, (GLOBAL_BATCH,), generator=g),
                           torch.randint(0, 30, (GLOBAL_BATCH,), generator=g)], 1)
        y = torch.randn(GLOBAL_BATCH, generator=g)
        mine = slice(rank * share, (rank + 1) * share)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids[mine]), y[mine]).backward()
        opt.step()


def _snapshot(model, opt):
    """Every parameter and server slot, whole (gathered: a test may)."""
    import numpy as np

    out = {f"param.{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    for route, tables in opt.state_dict().get("hybridsync", {}).items():
        for var, state in tables.items():
            for slot, value in state["slots"].items():
                out[f"slot.{var}.{slot}"] = np.asarray(value)
    return out


def rank_save_and_continue(tmp):
    import numpy as np

    import hybridsync

    for name in OPTIMIZERS:
        model, opt = _wrapped(name)
        _train(model, opt, range(STEPS))
        hybridsync.save_checkpoint(f"{tmp}/{name}", model, opt, extra={"step": STEPS})
        at_save = _snapshot(model, opt)
        _train(model, opt, range(STEPS, 2 * STEPS))
        final = _snapshot(model, opt)
        if hybridsync.rank() == 0:
            np.savez(f"{tmp}/{name}-at-save.npz", **at_save)
            np.savez(f"{tmp}/{name}-final.npz", **final)


def rank_load_and_continue(tmp):
    import numpy as np

    import hybridsync

    for name in OPTIMIZERS:
        model, opt = _wrapped(name)
        extra = hybridsync.load_checkpoint(f"{tmp}/{name}", model, opt)
        assert extra == {"step": STEPS}, extra
        for stage, steps in (("at-save", ()), ("final", range(STEPS, 2 * STEPS))):
            _train(model, opt, steps)
            want, got = np.load(f"{tmp}/{name}-{stage}.npz"), _snapshot(model, opt)
            assert set(want.files) == set(got), (sorted(want.files), sorted(got))
            for key in want.files:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"{name} {stage} {key}")
        print(f"rank {hybridsync.rank()}: {name} checkpoint restored and continued at {hybridsync.size()} ranks", flush=True)


def rank_bad_checkpoints(tmp):
    import shutil
    from pathlib import Path

    import pytest

    import hybridsync
    from hybridsync import comm
    from hybridsync.checkpoint import CheckpointError

    model, opt = _wrapped("adagrad")
    _train(model, opt, range(2))
    path = Path(tmp) / "good"
    hybridsync.save_checkpoint(path, model, opt)
    hybridsync.save_checkpoint(path, model, opt)  # overwriting swaps the link; one version remains
    assert path.is_symlink() and len(list(Path(tmp).glob(".good.*"))) == 1
    rank = hybridsync.rank()

    def broken(change):
        """A copy of the good checkpoint, spoiled by `change` on rank 0."""
        copy = Path(tmp) / f"bad-{change.__name__}"
        if rank == 0:
            shutil.copytree(path.resolve(), copy)
            change(copy)
        comm.objects().barrier()  # the copy exists before any rank reads it
        return copy

    def corrupt(d):
        with open(d / "table-0-shard-1.safetensors", "r+b") as fh:
            fh.seek(-4, 2)
            fh.write(b"\xff\xfe\xfd\xfc")

    def missing(d):
        os.remove(d / "table-1-shard-0.safetensors")

    def no_manifest(d):
        os.remove(d / "manifest.json")

    for change, message in ((corrupt, r"table-0-shard-1.safetensors is corrupt"),
                            (missing, r"incomplete checkpoint: .*table-1-shard-0.safetensors is missing"),
                            (no_manifest, r"incomplete checkpoint: .*manifest.json is missing")):
        bad = broken(change)
        with pytest.raises(CheckpointError, match=message):
            hybridsync.load_checkpoint(bad, model, opt)
    # Another model: a table of another size is named.
    import torch

    import hybridsync.torch as hvd

    other = _model()
    other.emb = torch.nn.Embedding(41, 4, sparse=True)
    other_opt = hvd.DistributedOptimizer(torch.optim.Adagrad(other.parameters(), lr=0.2), model=other,
                                         config={"variables": [{"match": "rep.weight", "sync": "ps",
                                                                "placement": "replicated"}]})
    with pytest.raises(CheckpointError, match=r"variable 'emb.weight' 41x4 does not match the checkpoint"):
        hybridsync.load_checkpoint(path, other, other_opt)
    print(f"rank {rank}: bad checkpoints named on every rank", flush=True)


def rank_crash_during_save(tmp):
    import hybridsync
    from hybridsync import checkpoint

    model, opt = _wrapped("sgd")
    _train(model, opt, range(1))
    hybridsync.save_checkpoint(f"{tmp}/ckpt", model, opt, extra={"version": 1})
    _train(model, opt, range(1, 2))
    if hybridsync.rank() == 1:  # dies after writing part of the second checkpoint
        real = checkpoint._write_safetensors

        def write_then_die(arrays, path):
            real(arrays, path)
            os.kill(os.getpid(), signal.SIGKILL)

        checkpoint._write_safetensors = write_then_die
    hybridsync.save_checkpoint(f"{tmp}/ckpt", model, opt, extra={"version": 2})


def rank_load_previous(tmp):
    import hybridsync

    model, opt = _wrapped("sgd")
    assert hybridsync.load_checkpoint(f"{tmp}/ckpt", model, opt) == {"version": 1}


def _hidden(tmp, name="ckpt"):
    return sorted(p.name for p in __import__("pathlib").Path(tmp).iterdir() if p.name.startswith(f".{name}."))


def rank_stale_versions_are_removed(tmp):
    """What a crashed save of a name left (a full hidden version directory, the link it was about
    to publish) is removed by the next save of that name; the live checkpoint, its new version
    and other names' directories are kept, and the new checkpoint loads."""
    import numpy as np

    import hybridsync
    import hybridsync.torch as hvd

    rank = hybridsync.rank()
    model, opt = _wrapped("adagrad")
    _train(model, opt, range(2))
    hybridsync.save_checkpoint(f"{tmp}/ckpt", model, opt, extra={"version": 1})
    live = os.readlink(f"{tmp}/ckpt")
    crashed, link, other = ".ckpt.0123456789ab", ".ckpt.link-.ckpt.0123456789ab", ".ckpt.v2.0123456789ab"
    if rank == 0:  # a save that died after writing its files (a copy of the live one's)
        import shutil

        shutil.copytree(f"{tmp}/{live}", f"{tmp}/{crashed}")
        os.symlink(crashed, f"{tmp}/{link}")
        os.mkdir(f"{tmp}/{other}")  # another checkpoint's ('ckpt.v2'): not ours to remove
    hvd.barrier()
    _train(model, opt, range(2, 3))
    hybridsync.save_checkpoint(f"{tmp}/ckpt", model, opt, extra={"version": 2})
    at_save = _snapshot(model, opt)
    hvd.barrier()
    now_live = os.readlink(f"{tmp}/ckpt")
    assert _hidden(tmp) == sorted([now_live, other]), (_hidden(tmp), now_live)
    assert now_live != live and now_live != crashed
    model2, opt2 = _wrapped("adagrad")
    assert hybridsync.load_checkpoint(f"{tmp}/ckpt", model2, opt2) == {"version": 2}
    loaded = _snapshot(model2, opt2)
    for key, value in at_save.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
    # A save that finds nothing stale removes nothing but the version it replaced.
    hybridsync.save_checkpoint(f"{tmp}/ckpt", model2, opt2, extra={"version": 3})
    hvd.barrier()
    assert _hidden(tmp) == sorted([os.readlink(f"{tmp}/ckpt"), other]), _hidden(tmp)
    print(f"rank {rank}: stale versions removed", flush=True)


def rank_elastic(tmp, epochs):
    import hybridsync
    import hybridsync.elastic as elastic

    model, opt = _wrapped("adagrad")
    state = elastic.CheckpointState(f"{tmp}/elastic", model, opt, epoch=0, batch=0, seen=[])

    def train(state):
        for state.epoch in state.remaining_epochs_until(int(epochs)):
            for batch in range(state.batch, 3):
                _train(model, opt, [state.epoch * 3 + batch])
                state.batch = batch + 1
                state.seen = state.seen + [[state.epoch, batch, hybridsync.size()]]
                state.commit()
            state.batch = 0
        return state

    state = elastic.run(train, state)
    print(f"ELASTIC resumed={state.resumed} seen={state.seen}", flush=True)


def _keras_model():
    import keras
    import numpy as np

    import hybridsync
    import hybridsync.tensorflow as htf

    keras.utils.set_random_seed(1)
    ids = keras.Input(shape=(2,), dtype="int64")
    a = keras.layers.Flatten()(htf.Embedding(40, 4, name="table")(ids))  # sharded on the PS
    b = keras.layers.Flatten()(keras.layers.Embedding(30, 4, name="rep")(ids))  # replicated
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(keras.layers.Concatenate()([a, b])))
    model.compile(optimizer=htf.DistributedOptimizer(keras.optimizers.Adagrad(0.2)), loss="mse", jit_compile=False)
    rng = np.random.default_rng(hybridsync.rank())
    model.fit(rng.integers(0, 30, (6, 2)), rng.standard_normal((6, 1)), batch_size=6, verbose=0)  # builds the plan
    return model


def _keras_snapshot(model):
    out = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    out["table"] = model.get_layer("table").get_table()
    out["slots"] = model.optimizer._hs_vars[0].table.read(0)
    return out


def rank_keras_save(tmp):
    import numpy as np

    import hybridsync

    model = _keras_model()
    hybridsync.save_checkpoint(f"{tmp}/keras", model, model.optimizer, extra={"epoch": 1})
    snapshot = _keras_snapshot(model)  # collective: gathers the tables
    if hybridsync.rank() == 0:
        np.savez(f"{tmp}/keras.npz", **snapshot)


def rank_keras_load(tmp):
    import numpy as np

    import hybridsync

    model = _keras_model()  # one step of its own, then overwritten by the checkpoint
    assert hybridsync.load_checkpoint(f"{tmp}/keras", model, model.optimizer) == {"epoch": 1}
    want, got = np.load(f"{tmp}/keras.npz"), _keras_snapshot(model)
    for key in want.files:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)
    print(f"rank {hybridsync.rank()}: keras checkpoint restored at {hybridsync.size()} ranks", flush=True)


def rank_meta_model():
    """A model built on the meta device: its tables are made on the shards, never whole."""
    import numpy as np
    import torch

    import hybridsync
    import hybridsync.torch as hvd
    from hybridsync import ps

    with torch.device("meta"):
        model = _model()
    model.mlp.to_empty(device="cpu")
    model.mlp.reset_parameters()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    assert ps.engine().row_store_bytes() <= (20 + 15 + 2) * 4 * 4  # this rank's half of both tables
    _train(model, opt, range(2))
    table = model.state_dict()["emb.weight"]  # gathered here only to check it
    assert table.shape == (40, 4) and 0.7 < float(table.std()) < 1.3, float(table.std())
    print(f"rank {hybridsync.rank()}: meta-device model trained with its tables only on the shards", flush=True)
    np.testing.assert_array_equal(table.isfinite().numpy(), True)


def rank_killed_peer():
    import numpy as np

    import hybridsync
    from hybridsync import ps

    engine = ps.engine()
    table = engine.add_table("t", 10, 2, 0, "cyclic", "sgd", {"lr": 0.1})
    if hybridsync.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    engine.pull([table], [np.arange(4)])  # rank 0 waits for a peer that is gone


@pytest.mark.parametrize("load_np", [3, 1])
def test_save_at_two_ranks_load_and_continue_elsewhere(tmp_path, load_np):
    run_ranks(__file__, "rank_save_and_continue", 2, str(tmp_path), timeout=240)
    run_ranks(__file__, "rank_load_and_continue", load_np, str(tmp_path), timeout=240)


def test_keras_checkpoint_saved_at_two_ranks_loads_at_three(tmp_path):
    run_ranks(__file__, "rank_keras_save", 2, str(tmp_path), timeout=240)
    run_ranks(__file__, "rank_keras_load", 3, str(tmp_path), timeout=240)


def test_corrupt_missing_and_foreign_checkpoints_are_named(tmp_path):
    run_ranks(__file__, "rank_bad_checkpoints", 2, str(tmp_path), timeout=240)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    rc, out = launch(mpirun_prefix(2) + [sys.executable, "-u", __file__, "rank_crash_during_save", str(tmp_path)], 120)
    assert rc != 0, out
    run_ranks(__file__, "rank_load_previous", 2, str(tmp_path), timeout=120)


@pytest.mark.parametrize("np_", [2, 3])
def test_the_next_save_removes_what_a_crashed_save_left(tmp_path, np_):
    run_ranks(__file__, "rank_stale_versions_are_removed", np_, str(tmp_path), timeout=180)


def test_elastic_state_resumes_at_another_world_size(tmp_path):
    out = run_ranks(__file__, "rank_elastic", 2, str(tmp_path), "1", timeout=240)
    assert "ELASTIC resumed=False" in out
    out = run_ranks(__file__, "rank_elastic", 3, str(tmp_path), "2", timeout=240)
    assert "resumed=True seen=[[0, 0, 2], [0, 1, 2], [0, 2, 2], [1, 0, 3], [1, 1, 3], [1, 2, 3]]" in out, out


def test_a_meta_device_model_gets_its_tables_on_the_shards():
    run_ranks(__file__, "rank_meta_model", 2, timeout=120)


def test_a_killed_rank_ends_the_job_within_seconds():
    start = time.monotonic()
    rc, out = launch(mpirun_prefix(2) + [sys.executable, "-u", __file__, "rank_killed_peer"], 120)
    elapsed = time.monotonic() - start
    assert rc != 0, out
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end after a rank was killed\n{out}"


if __name__ == "__main__":
    rank_main(globals())
