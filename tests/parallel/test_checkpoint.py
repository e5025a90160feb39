"""Checkpoints: saved at -np 2, loaded at -np 3 and -np 1 with identical parameters and server
state, and training continued from them gives the numbers of the uninterrupted run (SGD,
Adagrad, Adam); every dtype (float32/64/16, bfloat16, integer and bool buffers, optimizer state,
PyTorch and Keras) round-trips bit for bit with its dtype; a Keras model loads right after
compile(), before its first step; corrupt, missing and foreign checkpoints are errors naming the file or the
variable on every rank; a rank killed mid-save leaves the previous checkpoint loadable; a killed
rank ends the job within seconds; elastic State resumes at another world size."""
import os
import signal
import sys

import pytest

from tests.parallel.harness import (launch, mark_event, mpirun_prefix, rank_main, run_ranks, run_scenarios,
                                   seconds_since_event, subcase_output)

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


def _dtypes_model():
    """Layers in every floating dtype torch trains in and integer / bool buffers, under Adam
    (its moments take the parameters' dtypes, its step is a 0-d float32 tensor)."""
    import torch

    import hybridsync.torch as hvd

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.f32 = torch.nn.Linear(4, 4)
            self.f64 = torch.nn.Linear(4, 4).double()
            self.f16 = torch.nn.Linear(4, 4).half()
            self.bf16 = torch.nn.Linear(4, 4).to(torch.bfloat16)
            self.bn = torch.nn.BatchNorm1d(4)  # num_batches_tracked: an int64 step counter
            self.register_buffer("i32", torch.tensor([-7, 3], dtype=torch.int32))
            self.register_buffer("u8", torch.tensor([255, 1], dtype=torch.uint8))
            self.register_buffer("flag", torch.tensor([True, False]))

        def forward(self, x):
            h = self.f64(self.f32(x).double()).float()
            return self.bn(self.bf16(self.f16(h.half()).bfloat16()).float()).sum(1)

    model = Net()
    # (Horovod's torch ops refuse bfloat16: this model all-reduces over MPI whatever the default)
    return model, hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3),
                                           named_parameters=model.named_parameters(), backend="mpi")


def _dtypes_step(model, opt, step):
    import torch

    import hybridsync

    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step * 10 + hybridsync.rank()))
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return float(loss)


def _dtypes_state(model, opt):
    """Every buffer, parameter and optimizer state tensor, with its dtype (plain tensors)."""
    import torch

    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for index, values in torch.optim.Optimizer.state_dict(opt)["state"].items():
        state.update({f"opt.{index}.{k}": v.clone() for k, v in values.items() if isinstance(v, torch.Tensor)})
    return state


def _save_dtypes(tmp):
    import torch

    import hybridsync

    model, opt = _dtypes_model()
    for step in range(3):
        _dtypes_step(model, opt, step)
    hybridsync.save_checkpoint(f"{tmp}/dtypes", model, opt)
    if hybridsync.rank() == 0:
        torch.save(_dtypes_state(model, opt), f"{tmp}/dtypes.pt")


def _load_dtypes(tmp):
    """Bit for bit, dtype kept: float32/64/16, bfloat16, int32/64, uint8 and bool; then it trains."""
    import math

    import torch

    import hybridsync

    model, opt = _dtypes_model()
    hybridsync.load_checkpoint(f"{tmp}/dtypes", model, opt)
    want, got = torch.load(f"{tmp}/dtypes.pt", weights_only=True), _dtypes_state(model, opt)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for key, value in want.items():
        assert got[key].dtype == value.dtype, (key, got[key].dtype, value.dtype)
        assert torch.equal(got[key], value), key
    assert {v.dtype for v in want.values()} >= {torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                                 torch.int64, torch.int32, torch.uint8, torch.bool}
    assert math.isfinite(_dtypes_step(model, opt, 3))


def rank_save_and_continue(tmp):
    import numpy as np

    import hybridsync

    _save_dtypes(tmp)
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

    _load_dtypes(tmp)
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


def _keras_model(fit=True):
    """Compiled, and (fit=True) one step taken. The optimizer is named: a second model in the
    process has the same variable names."""
    import keras

    import hybridsync.tensorflow as htf

    keras.utils.set_random_seed(1)
    ids = keras.Input(shape=(2,), dtype="int64")
    a = keras.layers.Flatten()(htf.Embedding(40, 4, name="table")(ids))  # sharded on the PS
    b = keras.layers.Flatten()(keras.layers.Embedding(30, 4, name="rep")(ids))  # replicated
    model = keras.Model(ids, keras.layers.Dense(1, name="head")(keras.layers.Concatenate()([a, b])))
    model.compile(optimizer=htf.DistributedOptimizer(keras.optimizers.Adagrad(0.2, name="adagrad")), loss="mse",
                  jit_compile=False)
    if fit:
        _keras_fit(model, 0)  # builds the plan
    return model


def _keras_fit(model, seed):
    import numpy as np

    import hybridsync

    rng = np.random.default_rng(hybridsync.rank() + 10 * seed)
    model.fit(rng.integers(0, 30, (6, 2)), rng.standard_normal((6, 1)), batch_size=6, verbose=0)


def _keras_snapshot(model):
    out = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    out["table"] = model.get_layer("table").get_table()
    out["slots"] = model.optimizer._hs_vars[0].table.read(0)
    return out


def rank_keras_load_before_the_first_step(tmp):
    """A fresh Keras model, compiled and never stepped (its optimizer has no plan yet), loads a
    trained one's checkpoint: weights, the PS table's rows and slots and the optimizer's state
    are the saved ones, and its first step is the saved model's next step, exactly."""
    import numpy as np

    import hybridsync

    trained = _keras_model()
    hybridsync.save_checkpoint(f"{tmp}/keras-early", trained, trained.optimizer)
    fresh = _keras_model(fit=False)
    assert fresh.optimizer._hs_plan is None
    hybridsync.load_checkpoint(f"{tmp}/keras-early", fresh, fresh.optimizer)

    def everything(model):
        out = _keras_snapshot(model)
        out.update({f"opt.{v.path}": v.numpy() for v in model.optimizer.variables})
        return out

    for stage in ("loaded", "one step later"):
        want, got = everything(trained), everything(fresh)
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{stage}: {key}")
        _keras_fit(trained, 1)
        _keras_fit(fresh, 1)
    print(f"rank {hybridsync.rank()}: keras checkpoint loaded before the first step", flush=True)


def _keras_dtypes_model():
    """Dense layers in every floating dtype Keras trains in, under Adam (int64 iterations), on a
    PS table; trained 2 steps. The optimizer is named: a second one in the process matches."""
    import keras
    import numpy as np

    import hybridsync
    import hybridsync.tensorflow as htf

    keras.utils.set_random_seed(2)
    ids = keras.Input(shape=(2,), dtype="int64")
    x = keras.layers.Flatten()(htf.Embedding(20, 4, name="dtypes_table")(ids))
    for dtype in ("float64", "float16", "bfloat16", "float32"):
        x = keras.layers.Dense(4, dtype=dtype, name=f"dense_{dtype}")(x)
    model = keras.Model(ids, keras.layers.Dense(1, name="dtypes_head")(x))
    opt = htf.DistributedOptimizer(keras.optimizers.Adam(0.01, epsilon=1e-3, name="adam_dtypes"))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    rng = np.random.default_rng(hybridsync.rank())
    model.fit(rng.integers(0, 20, (6, 2)), rng.standard_normal((6, 1)), batch_size=6, epochs=2, verbose=0)
    return model


def _keras_dtypes_state(model):
    """Every variable of the model and its optimizer by path: (dtype name, raw bytes)."""
    import numpy as np

    return {v.path: (str(v.dtype), np.atleast_1d(v.numpy()).view(np.uint8).tobytes())
            for v in model.variables + model.optimizer.variables}


def rank_keras_save(tmp):
    import json

    import numpy as np

    import hybridsync

    dtypes = _keras_dtypes_model()
    hybridsync.save_checkpoint(f"{tmp}/keras-dtypes", dtypes, dtypes.optimizer)
    if hybridsync.rank() == 0:
        state = {k: [dtype, raw.hex()] for k, (dtype, raw) in _keras_dtypes_state(dtypes).items()}
        open(f"{tmp}/keras-dtypes.json", "w").write(json.dumps(state))
    model = _keras_model()
    hybridsync.save_checkpoint(f"{tmp}/keras", model, model.optimizer, extra={"epoch": 1})
    snapshot = _keras_snapshot(model)  # collective: gathers the tables
    if hybridsync.rank() == 0:
        np.savez(f"{tmp}/keras.npz", **snapshot)


def rank_keras_load(tmp):
    import json

    import numpy as np

    import hybridsync

    dtypes = _keras_dtypes_model()  # trained on other data, then overwritten: bit for bit, dtype kept
    hybridsync.load_checkpoint(f"{tmp}/keras-dtypes", dtypes, dtypes.optimizer)
    want = {k: (dtype, bytes.fromhex(raw)) for k, (dtype, raw) in json.loads(open(f"{tmp}/keras-dtypes.json").read()).items()}
    assert _keras_dtypes_state(dtypes) == want
    assert {dtype for dtype, _ in want.values()} == {"float16", "bfloat16", "float32", "float64", "int64"}
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
        mark_event("killed")
        os.kill(os.getpid(), signal.SIGKILL)
    engine.pull([table], [np.arange(4)])  # rank 0 waits for a peer that is gone


# The scenarios share launches: one per world size (each launch starts ranks that import torch
# and TensorFlow: seconds each on 2 cores). Each scenario writes under a directory of its own,
# and a failure names its sub-case. The meta-device model goes first: it counts the engine's rows.
def test_checkpoints_saved_at_two_ranks_load_at_three_and_one_and_bad_or_crashed_saves(tmp_path):
    """Saved at 2 ranks, loaded at 3 and 1 (torch: SGD, Adagrad, Adam and every dtype) and at 3
    (Keras, every dtype); Keras loads right after compile(); corrupt, missing and foreign
    checkpoints are named; a rank killed mid-save leaves the previous checkpoint; the next save
    removes what a crashed save left (2 and 3 ranks); elastic state resumes at 3 ranks; a
    meta-device model's tables are made on the shards."""
    dirs = {name: tmp_path / name for name in ("torch", "keras", "keras-early", "bad", "crash", "stale2",
                                               "stale3", "elastic")}
    for d in dirs.values():
        d.mkdir()
    # A rank killed mid-save: the job fails, the previous checkpoint is what loads (at 2 ranks below).
    rc, out = launch(mpirun_prefix(2) + [sys.executable, "-u", __file__, "rank_crash_during_save",
                                         str(dirs["crash"])], 120)
    assert rc != 0, out
    out = run_scenarios(__file__, 2, "rank_meta_model", ("rank_load_previous", dirs["crash"]),
                        ("rank_save_and_continue", dirs["torch"]), ("rank_keras_save", dirs["keras"]),
                        ("rank_keras_load_before_the_first_step", dirs["keras-early"]),
                        ("rank_bad_checkpoints", dirs["bad"]), ("rank_stale_versions_are_removed", dirs["stale2"]),
                        ("rank_elastic", dirs["elastic"], 1), timeout=480)
    assert "ELASTIC resumed=False" in subcase_output(out, 8), out
    out = run_scenarios(__file__, 3, ("rank_load_and_continue", dirs["torch"]), ("rank_keras_load", dirs["keras"]),
                        ("rank_stale_versions_are_removed", dirs["stale3"]), ("rank_elastic", dirs["elastic"], 2),
                        timeout=480)
    elastic = subcase_output(out, 4)
    assert "resumed=True seen=[[0, 0, 2], [0, 1, 2], [0, 2, 2], [1, 0, 3], [1, 1, 3], [1, 2, 3]]" in elastic, out
    run_ranks(__file__, "rank_load_and_continue", 1, str(dirs["torch"]), timeout=240)


def test_a_killed_rank_ends_the_job_within_seconds():
    rc, out = launch(mpirun_prefix(2) + [sys.executable, "-u", __file__, "rank_killed_peer"], 120)
    elapsed = seconds_since_event(out, "killed")  # (not since the launch: starting takes what the load makes it)
    assert rc != 0, out
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end after a rank was killed\n{out}"


if __name__ == "__main__":
    rank_main(globals())
