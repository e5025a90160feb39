"""Horovod's save idiom with dynamic tables: `if hvd.rank() == 0: torch.save(model.state_dict(), p)`
(and the optimizer's), then a fresh model loads it on rank 0 and broadcasts, at the same world
size and at another.

- model.state_dict() carries each DynamicEmbedding's ids, rows, counts, last touches, pending
  ids and step (read one-sided by the saving rank, when torch.save reads them);
  optimizer.state_dict() its server optimizer's slots. Loaded, the tables hold exactly what was
  saved, and the held-out loss is the trained one, not a fresh model's.
- Training on from the loaded model is bit-identical to the uninterrupted run at the same world
  size (slots included), and within float rounding at another.
- A table larger than a message is read and written in chunks.
"""
import pytest

from tests.parallel.harness import rank_main, run_ranks

STEPS, MORE, BATCH = 8, 4, 12  # BATCH divides over 2 and 3 ranks


def _model():
    """Two dynamic tables -- admission with expiry under Adagrad, one under Adam -- and a dense
    head. (No capacity: a shard holds capacity / shards rows, so a bounded table trains
    differently at another world size, and the continuations could not be compared.)"""
    import torch

    import hybridsync.torch as hvd

    torch.manual_seed(3)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.users = hvd.DynamicEmbedding(4, seed=21, admit_after=2, ttl_steps=4)
            self.items = hvd.DynamicEmbedding(4, seed=22)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, ids):
            return self.head(torch.cat([self.users(ids[:, 0]), self.items(ids[:, 1])], 1)).squeeze(1)

    model = Net()
    config = {"variables": [{"match": "items.*", "sync": "ps", "optimizer": {"name": "adam", "lr": 0.05}}]}
    return model, hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model=model,
                                           config=config)


def _batch(step, size=BATCH):
    """Raw int64 ids (hot ones and a tail) and targets that are a function of the ids."""
    import numpy as np

    from tests.parallel.test_dynamic_tables import _pool

    pool, rng = _pool(), np.random.default_rng(step)
    ids = pool[rng.integers(0, len(pool), size=(size, 2))]
    ids[: size // 3] = pool[rng.integers(0, 5, size=(size // 3, 2))]
    y = (np.sin(ids[:, 0] % 13) + np.cos(ids[:, 1] % 11)).astype(np.float32)
    return ids, y


def _step(model, opt, step):
    """One step; rank r takes rows r::size of the global batch (the same at any world size)."""
    import torch

    import hybridsync.torch as hvd

    ids, y = _batch(step)
    mine = slice(hvd.rank(), BATCH, hvd.size())
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(torch.from_numpy(ids[mine])), torch.from_numpy(y[mine])).backward()
    opt.step()


def _held_out(model) -> float:
    """The loss on a batch no step trains on (every rank computes all of it: pulls are collective)."""
    import torch

    ids, y = _batch(999, 24)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(torch.from_numpy(ids)), torch.from_numpy(y)))


def _everything(model, opt, slots=True):
    """Every stored id with its row, count and last touch (and server slots), the pending ids,
    the tables' steps, the dense head and its Adagrad state: gathered from every shard."""
    import torch

    from tests.parallel.test_dynamic_tables import snapshot

    out = snapshot({"users": model.users.table, "items": model.items.table})
    if not slots:
        out = {k: v for k, v in out.items() if ".slot." not in k}
    out.update({f"step.{name}": getattr(model, name).table.step for name in ("users", "items")})
    out.update({f"head.{k}": v.detach().numpy().copy() for k, v in model.head.state_dict().items()})
    if slots:
        for i, p in enumerate(model.head.parameters()):
            out.update({f"adagrad.{i}.{k}": torch.as_tensor(v).numpy().copy() for k, v in opt.state[p].items()})
    return out


def _load_like_horovod(model, opt, path):
    """Rank 0 loads, the others take the dense state by broadcast (the tables are on the shards)."""
    import torch

    import hybridsync.torch as hvd

    if hvd.rank() == 0:
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)


def _same(got, want, what, exact=True):
    import numpy as np

    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for key in want:
        if exact or np.asarray(want[key]).dtype.kind != "f":
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")
        else:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"{what}: {key}")


def _chunked_round_trip():
    """A table of 3000 rows under a 16 KiB message limit (the job's HYBRIDSYNC_MAX_MESSAGE_BYTES):
    rank 0 loads one model's state dict into another, read and written in many chunks."""
    import numpy as np
    import torch

    import hybridsync.torch as hvd
    from tests.parallel.test_dynamic_tables import snapshot

    def make():
        model = torch.nn.ModuleDict({"emb": hvd.DynamicEmbedding(8, seed=5, ttl_steps=9), "out": torch.nn.Linear(8, 1)})
        return model, hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1), model=model)

    (big, big_opt), (copy, _) = make(), make()
    ids = np.random.default_rng(7).integers(-2**62, 2**62, size=3000)[hvd.rank()::hvd.size()]
    big_opt.zero_grad()
    big["out"](big["emb"](torch.from_numpy(ids))).sum().backward()
    big_opt.step()
    if hvd.rank() == 0:
        copy.load_state_dict(big.state_dict())
    hvd.allgather_object(None)  # (rank 0's one-sided writes are in)
    want, got = snapshot({"t": big["emb"].table}), snapshot({"t": copy["emb"].table})
    assert len(want["t.ids"]) == 3000
    for key in ("t.ids", "t.rows", "t.counts", "t.last_touch", "t.pending"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert copy["emb"].table.step == big["emb"].table.step == 1


def rank_save(path):
    """Trains, saves with Horovod's idiom on rank 0, and loads it into a fresh model in this job:
    its tables are the saved ones and it trains on bit-identically to the original."""
    import numpy as np
    import torch

    import hybridsync.torch as hvd

    model, opt = _model()
    for step in range(STEPS):
        _step(model, opt, step)
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}.pt")
    saved, trained_loss = _everything(model, opt), _held_out(model)
    fresh, fresh_opt = _model()
    fresh_loss = _held_out(fresh)
    _load_like_horovod(fresh, fresh_opt, f"{path}.pt")
    loaded_loss = _held_out(fresh)  # the trained rows, not fresh ones
    assert loaded_loss == trained_loss and abs(fresh_loss - trained_loss) > 1e-3, (loaded_loss, trained_loss, fresh_loss)
    _same(_everything(fresh, fresh_opt, slots=False), _everything(model, opt, slots=False), "loaded")
    state = fresh.state_dict()
    assert state["users.ids"].dtype == torch.int64 and tuple(state["users.rows"].shape) == (len(saved["users.ids"]), 4)
    for step in range(STEPS, STEPS + MORE):
        _step(model, opt, step)
        _step(fresh, fresh_opt, step)
    final = _everything(model, opt)
    _same(_everything(fresh, fresh_opt), final, "trained on after the load")
    if hvd.rank() == 0:
        np.savez(f"{path}.saved.npz", **{k: np.asarray(v) for k, v in saved.items()})
        np.savez(f"{path}.final.npz", **{k: np.asarray(v) for k, v in final.items()})
        np.save(f"{path}.loss.npy", np.array([trained_loss, fresh_loss]))
    _chunked_round_trip()
    print(f"rank {hvd.rank()}: STATE-DICT-SAVED at {hvd.size()} ranks, held-out loss {trained_loss:.5f} "
          f"(fresh {fresh_loss:.5f})", flush=True)


def rank_load(path):
    """Another job at another world size: a fresh model loads the state dict with Horovod's
    idiom; its tables and held-out loss are the saved ones, and training on matches the
    uninterrupted run."""
    import numpy as np

    import hybridsync.torch as hvd

    model, opt = _model()
    _load_like_horovod(model, opt, f"{path}.pt")
    saved = dict(np.load(f"{path}.saved.npz"))
    _same(_everything(model, opt, slots=False), {k: v for k, v in saved.items() if ".slot." not in k and
                                                  not k.startswith("adagrad.")}, "loaded at another world size")
    trained_loss, _ = np.load(f"{path}.loss.npy")
    assert _held_out(model) == trained_loss, (_held_out(model), trained_loss)
    for step in range(STEPS, STEPS + MORE):
        _step(model, opt, step)
    _same(_everything(model, opt), dict(np.load(f"{path}.final.npz")), "trained on at another world size", exact=False)
    _errors(model, opt)
    print(f"rank {hvd.rank()}: STATE-DICT-LOADED at {hvd.size()} ranks", flush=True)


def _errors(model, opt):
    """Rows of another width are named; a state dict taken before a step cannot be read after it."""
    import io

    import torch

    import hybridsync.torch as hvd

    state = model.state_dict() if hvd.rank() == 0 else None
    if hvd.rank() == 0:
        narrow = {k: v.materialize()[:, :3] if k == "users.rows" else v for k, v in state.items()}
        with pytest.raises(RuntimeError, match=r"size mismatch for users.rows: .* rows are 4 wide"):
            model.load_state_dict(narrow)
    _step(model, opt, 100)
    if hvd.rank() == 0:
        with pytest.raises(RuntimeError, match=r"dynamic table 'items.weight' changed after its state dict was taken"):
            torch.save(state, io.BytesIO())


@pytest.mark.parametrize("np_", [2, 3])
def test_horovod_save_idiom_carries_dynamic_tables(tmp_path, np_):
    """Saved at np_ ranks (and loaded there, in the same job); loaded at the other size."""
    path = str(tmp_path / "state")
    out = run_ranks(__file__, "rank_save", np_, path, timeout=240,
                    env={"HYBRIDSYNC_TIMEOUT_S": "60", "HYBRIDSYNC_MAX_MESSAGE_BYTES": "16384"})
    assert out.count("STATE-DICT-SAVED") == np_
    out = run_ranks(__file__, "rank_load", 5 - np_, path, timeout=240, env={"HYBRIDSYNC_TIMEOUT_S": "60"})
    assert out.count("STATE-DICT-LOADED") == 5 - np_


if __name__ == "__main__":
    rank_main(globals())
