"""Every feature at once, on one model, at every world size and under both dense backends.

One DLRM-like model holds a sharded fixed table, a DynamicEmbedding (admission, LRU eviction, TTL
expiry, bags with duplicate ids), a table with `staleness: 2`, a table on `allreduce-as-dense`
and a dense MLP. Job 1 trains it with the adaptive batch (accumulation allowed), skips one
non-finite step as a GradScaler would, commits and restores an elastic state, runs uneven data
into `hvd.join()`, then saves a checkpoint and Horovod's `torch.save(model.state_dict())`. Job 2,
at another world size, loads both (each equals what job 1 saved, bit for bit, every table and
server slot) and trains on with the adaptive loader.

Parity: a one-process reference (plain torch for the fixed, stale and dense parts; the dict model
of tests/dynamic_reference.py for the dynamic table, on as many shards as the job had) replays
the steps both jobs logged -- which samples each step took, and how many ranks' worth it was
divided by -- and every parameter and row must agree within 1e-4 (see _check_parity). The stale table takes part in
the parity too: its gradient does not depend on the rows it reads (its rows only shift the loss),
and its server rule is SGD, which sums pushes in any order, so the bound changes what a pull
reads but not where the table ends up.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.parallel.harness import rank_main, run_ranks

DIM, FIXED_ROWS, STALE_ROWS, SMALL_ROWS = 4, 40, 30, 20
DENSE_IN, SAMPLES, BASE_BATCH = 3, 72, 6  # 6 divides over 1, 2 and 3 ranks
LR, STALE_LR = 0.1, 0.05
DYN = dict(capacity=24, evict="lru", ttl_steps=6, admit_after=2, mode="sum", seed=7, name="dyn")
BAG = 3  # ids per bag


# -- the model and its data -------------------------------------------------------------------------
def _pool():
    """Raw int64 ids of the dynamic table: the extremes, -1, and hashes from the whole range."""
    import numpy as np

    rng = np.random.default_rng(3)
    drawn = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=37, dtype=np.int64)
    return np.concatenate([[np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1], drawn]).astype(np.int64)


def _data(seed: int, n: int = SAMPLES):
    """(index, dense, fixed id, stale id, small id, dynamic bag, label) columns of n samples."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    pool = _pool()
    bag = pool[np.minimum(rng.zipf(1.3, (n, BAG)) - 1, len(pool) - 1)]
    bag[::5, 1] = bag[::5, 0]  # duplicate ids inside a bag
    cols = (np.arange(n) + seed * 10_000, rng.standard_normal((n, DENSE_IN)).astype(np.float32),
            rng.integers(0, FIXED_ROWS, n), rng.integers(0, STALE_ROWS, n), rng.integers(0, SMALL_ROWS, n), bag,
            rng.standard_normal(n).astype(np.float32))
    return tuple(torch.from_numpy(np.ascontiguousarray(c)) for c in cols)


def _plain_model():
    """The model as a user writes it (nn.Embedding(sparse=True) everywhere but the dynamic table)."""
    import torch

    import hybridsync.torch as hvd

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fixed = torch.nn.Embedding(FIXED_ROWS, DIM, sparse=True)
            self.stale = torch.nn.Embedding(STALE_ROWS, DIM, sparse=True)
            self.small = torch.nn.Embedding(SMALL_ROWS, DIM, sparse=True)
            self.dyn = hvd.DynamicEmbedding(DIM, **DYN)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(DENSE_IN + 3 * DIM, 8), torch.nn.Tanh(),
                                           torch.nn.Linear(8, 1))
            self.register_buffer("stale_weight", torch.randn(DIM))

        def forward(self, dense, fixed, stale, small, bag):
            x = torch.cat([dense, self.fixed(fixed), self.small(small), self.dyn(bag)], 1)
            # The stale table's rows shift the loss but never another gradient: its gradient is
            # the constant stale_weight, so a pull that misses steps changes nothing it trains.
            return self.mlp(x).squeeze(1), (self.stale(stale) * self.stale_weight).sum(1)

    return Net()


# The stale table also keeps only a few rows in memory, the rest in a disk tier (docs/storage.md):
# the same numbers as all in memory, so the parity below covers it. memory_per_rank: the budget
# `sync: auto` chooses within (the fixed table is auto's: measured, tried, kept).
TIER_DIR = os.path.join(os.environ.get("TMPDIR", "/tmp"), "hybridsync-composition-tiers")
CONFIG = {"memory_per_rank": "1GiB", "variables": [
    {"match": "stale.*", "staleness": 2, "optimizer": {"name": "sgd", "lr": STALE_LR},
     "storage": {"memory_rows": 6, "path": TIER_DIR}},
    {"match": "small.*", "sync": "allreduce-as-dense"},
]}


def _loss(model, batch, divisor):
    """Sum of the samples' losses / divisor: the mean over the global batch of a step. The batch
    goes to the model's device (tests/gpu runs this file on CUDA)."""
    device = model.mlp[0].weight.device
    _, dense, fixed, stale, small, bag, label = (c.to(device) for c in batch)
    out, shift = model(dense, fixed, stale, small, bag)
    return ((out - label) ** 2).sum() / divisor + shift.sum() / divisor


def _wrap(model, adaptive=True):
    import torch

    import hybridsync.torch as hvd

    os.makedirs(TIER_DIR, exist_ok=True)

    opt = torch.optim.Adagrad(model.parameters(), lr=LR)
    wrapped = hvd.DistributedOptimizer(opt, model=model, config=CONFIG,
                                       adaptive={"scaling_rule": "auto", "rescale_accumulators": "auto"} if adaptive else None)
    if adaptive:  # Adagrad at its unscaled LR ('auto'): the square-root statistical efficiency
        assert wrapped.adaptive.efficiency_model == "sqrt", wrapped.adaptive.efficiency_reason
    return wrapped


# -- what a run logs, and the snapshot of everything it holds ------------------------------------------
class Log:
    """Per optimizer step: the global sample indices it took and the divisor of their losses."""

    def __init__(self, steps=None):
        self.steps = steps or []

    def add(self, my_indices, divisor, rescale=None):
        """rescale: the factor the step multiplied the Adagrad sums by (a batch change took effect)."""
        import hybridsync

        everyone = hybridsync.allgather_object([int(i) for i in my_indices])
        self.steps.append({"indices": sorted(i for part in everyone for i in part), "divisor": float(divisor),
                           "world": hybridsync.size(), "ranks": hybridsync.size(),
                           **({"rescale": rescale} if rescale is not None else {})})


def _gather_shards(table):
    """A dynamic table's stored entries from every shard, by id (world-size independent)."""
    import hybridsync

    out = {}
    for part in hybridsync.allgather_object({k: v.tolist() for k, v in table.shard_state().items()}):
        for n, i in enumerate(part["ids"]):
            out[("row", i)] = part["rows"][n]
            out[("count", i)] = part["counts"][n]
            out[("last", i)] = part["last_touch"][n]
            for key in part:
                if key.startswith("slot."):
                    out[(key, i)] = part[key][n]
        for n, i in enumerate(part["pending_ids"]):
            out[("pending", i)] = (part["pending_counts"][n], part["pending_last"][n])
    return out


def _snapshot(model, opt) -> dict:
    """Every parameter, every table's rows and server slots, the dense optimizer state, the
    dynamic table's entries with their counters (collective)."""
    import numpy as np

    import hybridsync.torch as hvd

    hvd.barrier()  # the bounded table's pushes still in flight land first (docs/staleness.md)
    snap = {}
    for key, value in model.state_dict().items():
        if key.startswith("dyn."):
            continue
        snap[f"param.{key}"] = np.asarray(value.cpu().numpy() if hasattr(value, "numpy") else value).copy()
    for route, tables in opt.state_dict().get("hybridsync", {}).items():
        for var, state in tables.items():
            if isinstance(state, dict):
                # (a dynamic table's slots are listed by stored id: compared below, entry by entry)
                for slot, value in (state.get("slots", {}) if var != "dyn.weight" else {}).items():
                    snap[f"slot.{var}.{slot}"] = np.asarray(value).copy()
                snap[f"step.{var}"] = np.asarray(state.get("step", -1))
    for p, name in ((p, n) for n, p in model.named_parameters()):
        for key, value in opt.state.get(p, {}).items():
            snap[f"dense-slot.{name}.{key}"] = np.asarray(value.cpu() if hasattr(value, "cpu") else value).copy()
    dyn = _gather_shards(model.dyn.table)
    for key, value in dyn.items():
        snap[f"dyn.{key[0]}.{key[1]}"] = np.asarray(value)
    snap["dyn.step"] = np.asarray(model.dyn.table.step)
    return snap


def _assert_same(got: dict, want: dict, what: str, exact=True, rtol=1e-5, atol=1e-6):
    import numpy as np

    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want))[:10])
    for key in want:
        if exact:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")
        else:
            np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=atol, err_msg=f"{what}: {key}")


# -- the reference --------------------------------------------------------------------------------
def _samples():
    """Every sample any job draws, by its index."""
    out = {}
    for seed, n in ((1, SAMPLES), (3, 2 * 2 * 3 * 3), (4, SAMPLES), (6, SAMPLES // 2)):
        cols = _data(seed, n)
        for pos in range(n):
            out[int(cols[0][pos])] = tuple(c[pos] for c in cols)
    return out


def _reshard(table, shards):
    """The reference dynamic table's entries moved to `shards` shards (a load at another world size)."""
    from hybridsync.ps import dynamic_options as dyn
    from tests.dynamic_reference import ReferenceTable

    new = ReferenceTable(table.dim, shards, table.capacity, table.admit_after, table.evict, table.ttl, table.seed,
                         table.initializer, (table.rule, table.hp))
    new.step = table.step
    for old in table.shard:
        for key in ("rows", "slots", "count", "last", "pending"):
            for i, value in old[key].items():
                new.shard[int(dyn.hash_shard([i], shards)[0])][key][i] = value
    return new


def _replay(initial: dict, steps: list):
    """One process replays the logged steps: (plain modules, their Adagrad, the dynamic table)."""
    import numpy as np
    import torch

    from tests.dynamic_reference import ReferenceTable

    ref = torch.nn.ModuleDict({"fixed": torch.nn.Embedding(FIXED_ROWS, DIM), "stale": torch.nn.Embedding(STALE_ROWS, DIM),
                               "small": torch.nn.Embedding(SMALL_ROWS, DIM),
                               "mlp": torch.nn.Sequential(torch.nn.Linear(DENSE_IN + 3 * DIM, 8), torch.nn.Tanh(),
                                                          torch.nn.Linear(8, 1))})
    with torch.no_grad():
        for key, p in ref.named_parameters():
            p.copy_(torch.from_numpy(initial[key]))
    stale_weight = torch.from_numpy(initial["stale_weight"])
    adagrad = torch.optim.Adagrad([p for k, p in ref.named_parameters() if not k.startswith("stale")], lr=LR)
    sgd = torch.optim.SGD(ref["stale"].parameters(), lr=STALE_LR)
    options = {k: v for k, v in DYN.items() if k in ("capacity", "evict", "ttl_steps", "admit_after", "seed")}
    table, samples = None, _samples()
    for step in steps:
        if table is None or table.shards != step["world"]:
            table = (ReferenceTable(DIM, step["world"], rule=("adagrad", {"lr": LR}), **options) if table is None
                     else _reshard(table, step["world"]))
        cols = [torch.stack([samples[i][c] for i in step["indices"]]) for c in range(7)]
        _, dense, fixed, stale, small, bag, label = cols
        unique, inverse = np.unique(bag.numpy(), return_inverse=True)
        rows = torch.tensor(np.stack([table.row(int(i)) for i in unique]), dtype=torch.float32, requires_grad=True)
        bags = rows[torch.from_numpy(inverse.reshape(bag.shape))].sum(1)
        out = ref["mlp"](torch.cat([dense, ref["fixed"](fixed), ref["small"](small), bags], 1)).squeeze(1)
        loss = ((out - label) ** 2).sum() / step["divisor"] + (ref["stale"](stale) * stale_weight).sum() / step["divisor"]
        adagrad.zero_grad()
        sgd.zero_grad()
        loss.backward()
        if "rescale" in step:  # a batch change took effect: every Adagrad sum (the SGD table has none)
            for state in adagrad.state.values():
                state["sum"].mul_(step["rescale"])
            for shard in table.shard:
                for slots in shard["slots"].values():
                    slots[0] = slots[0] * step["rescale"]
        adagrad.step()
        sgd.step()
        table.push({int(i): rows.grad[n].double().numpy() for n, i in enumerate(unique)})
    return ref, adagrad, table


def _check_parity(initial: dict, steps: list, snap: dict, device: str = "cpu") -> None:
    """Everything the distributed run holds equals the one-process replay of its steps, to 1e-4
    relative and 1e-5 absolute: the ranks sum their shares of a gradient and the replay the whole
    batch, so float32 rounds differently (a CUDA run's products too), and Adagrad divides a
    component's step by the root of its summed squares, which for a row seldom pushed can be
    ~1e-7: there a 1e-7 relative gradient difference becomes 1e-5 in the row (a row moves up to
    LR = 0.1 a step, so a lost, doubled or misscaled update is still many times the tolerance)."""
    import numpy as np

    ref, adagrad, table = _replay(initial, steps)
    want = {f"param.{k}": p.detach().numpy() for k, p in ref.named_parameters()}
    want["param.stale_weight"] = initial["stale_weight"]
    for k, p in ref.named_parameters():
        for key, value in adagrad.state.get(p, {}).items():
            name = "slot.fixed.weight.sum" if k == "fixed.weight" and key == "sum" else f"dense-slot.{k}.{key}"
            if k != "fixed.weight" or key == "sum":
                want[name] = np.asarray(value)
    for var in ("fixed.weight", "dyn.weight"):
        want[f"step.{var}"] = np.asarray(len(steps))
    # A bounded table's rule applies each rank's push on its own: its step counts pushes.
    want["step.stale.weight"] = np.asarray(sum(step["ranks"] for step in steps))
    want["dyn.step"] = np.asarray(table.step)
    for shard in table.shard:
        for i, row in shard["rows"].items():
            want[f"dyn.row.{i}"] = row
            want[f"dyn.slot.sum.{i}"] = shard["slots"][i][0]
            want[f"dyn.count.{i}"] = np.asarray(shard["count"][i])
            want[f"dyn.last.{i}"] = np.asarray(shard["last"][i])
        for i, pending in shard["pending"].items():
            want[f"dyn.pending.{i}"] = np.asarray(pending)
    _assert_same(snap, want, f"parity with one process after {len(steps)} steps on {device}", exact=False,
                 rtol=1e-4, atol=1e-5)


# -- the jobs ---------------------------------------------------------------------------------------
def _elastic_round_trip(model, opt):
    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    state = hvd.elastic.TorchState(model, opt, batch=0)
    state.commit()
    committed = _snapshot(model, opt)
    extra = _data(seed=2, n=4 * size)
    for s in range(2):
        opt.zero_grad()
        _loss(model, [c[s * 2 * size + rank * 2: s * 2 * size + rank * 2 + 2] for c in extra], 2).backward()
        opt.step()
    state.restore()
    _assert_same(_snapshot(model, opt), committed, "elastic restore")


def _skip_a_non_finite_step(model, opt, k):
    import math

    import torch

    import hybridsync.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    before, skipped = _snapshot(model, opt), opt.gradient_stats()["nonfinite_steps"]
    batch = _data(seed=5, n=2 * k * size)
    opt.zero_grad()
    for m in range(k):
        mine = [c[((rank * k) + m) * 2:((rank * k) + m) * 2 + 2] for c in batch]
        loss = _loss(model, mine, 2)
        (loss * math.inf if rank == 0 and m == k - 1 else loss).backward()
        if m < k - 1:
            opt.step()  # an accumulation micro-step
    opt.synchronize()
    grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in model.parameters() if p.grad is not None]
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    assert not finite, "an inf loss on rank 0 left every all-reduced gradient finite"
    opt.zero_grad()  # the step is skipped: no table, row, slot or counter moves
    _assert_same(_snapshot(model, opt), before, "a skipped step")
    assert opt.gradient_stats()["nonfinite_steps"] == skipped + 1
    # The step's inf left out: every average finite. (The noise scale itself may read inf -- all
    # noise, |G|^2's newest average below zero -- a reading, not a failure: test_adaptive_nonfinite.)
    stats = opt.gradient_stats()
    assert all(math.isfinite(v["sqr"]) and math.isfinite(v["var"]) for v in stats["by_variable"].values()), stats
    assert stats["noise_scale"] > 0, stats


def rank_job1(tmp, device="cpu"):
    import numpy as np
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    model = _plain_model()
    if rank == 0:  # what the one-process reference starts from
        np.savez(os.path.join(tmp, "initial.npz"), **{k: v.numpy() for k, v in model.state_dict().items()})
    model.to(device)
    opt = _wrap(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = _data(seed=1)
    log = Log()

    # 1. The adaptive batch, with accumulation allowed, over one epoch.
    loader = _adaptive_epoch(model, opt, data, log, seed=5)

    # 2. An elastic commit, more training, a restore: everything is back at the commit.
    _elastic_round_trip(model, opt)

    # 3. A step whose loss is not finite on one rank is skipped, as a GradScaler would skip it:
    #    synchronize(), look at the (all-reduced, so everywhere the same) gradients, zero_grad().
    _skip_a_non_finite_step(model, opt, loader.accumulation_steps)

    # 4. Uneven data: rank r has r + 1 more steps, then joins; the last rank takes every step. Each
    #    step is as many micro-batches as the adaptive batch has (the optimizer counts them).
    k = loader.accumulation_steps
    uneven = _data(seed=3, n=2 * 2 * 3 * 3)  # enough for 3 ranks and 2 micro-steps
    at = lambda s, r, m: (((s * size + r) * k + m) * 2)  # the first sample of a micro-batch
    for s in range(rank + 1):
        opt.zero_grad()
        for m in range(k):
            _loss(model, [c[at(s, rank, m):at(s, rank, m) + 2] for c in uneven], 2).backward()
            opt.step()
    last = hvd.join()
    assert last == size - 1, last
    for s in range(size):  # step s took the batches of the ranks still stepping; joined ones count as zeros
        rows = [at(s, r, m) + j for r in range(size) if s < r + 1 for m in range(k) for j in range(2)]
        log.steps.append({"indices": [int(uneven[0][i]) for i in rows], "divisor": float(2 * k * size), "world": size,
                          "ranks": sum(s < r + 1 for r in range(size))})
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)  # the joined ranks' dense layers lag
    hvd.broadcast_optimizer_state(opt, root_rank=last)
    everyone = hvd.allgather_object(opt.adaptive.state_dict())
    assert all(state == everyone[0] for state in everyone), "join() left the ranks' adaptive states apart"

    # 5. The adaptive loader goes on after the join (its re-choices at the same steps everywhere),
    #    at fewer samples per rank and no micro-steps: the global batch shrinks, and the Adagrad
    #    sums (dense and on the shards) are rescaled by the factor every rank agreed on.
    rescales = len(opt.adaptive.accumulators.log)
    _adaptive_epoch(model, opt, _data(seed=6, n=SAMPLES // 2), log, seed=7,
                    most_per_rank=max(1, opt.adaptive.local_batch - 1), max_accumulation=1)
    from hybridsync.adaptive.scaling import accumulator_factor
    new = opt.adaptive.accumulators.log[rescales:]
    assert new and new[0]["applied"] and new[0]["from"] != new[0]["to"], new
    assert new[0]["factor"] == accumulator_factor(new[0]["from"], new[0]["to"], new[0]["noise_scale"]), new
    assert hvd.allgather_object(new) == [new] * size, "the ranks rescaled differently"

    # 6. Saved both ways.
    hybridsync.save_checkpoint(os.path.join(tmp, "ckpt"), model, opt, extra={"steps": len(log.steps)})
    snap = _snapshot(model, opt)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(tmp, "model.pt"))
        torch.save(opt.state_dict(), os.path.join(tmp, "opt.pt"))
        np.savez(os.path.join(tmp, "job1.npz"), **snap)
        with open(os.path.join(tmp, "job1.json"), "w") as fh:
            json.dump(log.steps, fh)
        _check_parity(dict(np.load(os.path.join(tmp, "initial.npz"))), log.steps, snap, device)
    hybridsync.barrier() if hasattr(hybridsync, "barrier") else hvd.barrier()


def _adaptive_epoch(model, opt, data, log, seed, most_per_rank=BASE_BATCH, max_accumulation=2):
    """One epoch of the adaptive loader (accumulation allowed); every step logged. Limits
    (most_per_rank, max_accumulation) the batch in force breaks: the loader starts at the nearest
    allowed one, a durable change (with Adagrad at an unscaled LR, its sums are rescaled at the
    first step)."""
    import torch

    import hybridsync.torch as hvd

    loader = hvd.AdaptiveDataLoader(torch.utils.data.TensorDataset(*data), batch_size=BASE_BATCH, seed=seed,
                                    interval=2, warmup=2)
    loader.autoscale_batch_size(4 * BASE_BATCH, local_bsz_bounds=(1, most_per_rank), gradient_accumulation=True,
                                max_accumulation=max_accumulation)
    taken = []
    for batch in loader:
        k, b = loader.accumulation_steps, loader.current_local_bsz
        opt.zero_grad()
        _loss(model, batch, b).backward()  # a micro-batch's mean: the optimizer averages micro-steps and ranks
        taken += batch[0].tolist()
        steps_before = opt.adaptive.steps
        opt.step()
        if opt.adaptive.steps != steps_before:  # the step's last micro-step
            # (the rescale a batch change applied at this step, if any: the replay applies it too)
            rescale = [r["factor"] for r in opt.adaptive.accumulators.log if r["step"] == steps_before and r["applied"]]
            log.add(taken, b * k * hvd.size(), rescale[0] if rescale else None)
            taken = []
    assert loader.epoch == 1 and not taken, "the adaptive epoch ended inside a step"
    # Adagrad at an unscaled LR: each batch change rescales the sums (the replay does too)
    assert opt.adaptive.accumulators.enabled
    if hvd.rank() == 0:  # (what the batch did: the controller decides from measured times)
        print(f"adaptive batch: (step, local batch, micro-steps) changes {loader.changes}; rescales "
              f"{[(r['step'], r['from'], r['to'], r['factor']) for r in opt.adaptive.accumulators.log]}", flush=True)
    return loader


def rank_job2(tmp, device="cpu"):
    import numpy as np
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    torch.set_num_threads(1)
    want = dict(np.load(os.path.join(tmp, "job1.npz")))
    with open(os.path.join(tmp, "job1.json")) as fh:
        log = Log(json.load(fh))
    model = _plain_model().to(device)
    opt = _wrap(model)

    # Horovod's idiom, saved by rank 0 of job 1: torch.load + load_state_dict, at another world size.
    model.load_state_dict(torch.load(os.path.join(tmp, "model.pt"), weights_only=True))
    opt.load_state_dict(torch.load(os.path.join(tmp, "opt.pt"), weights_only=True))
    _assert_same(_snapshot(model, opt), want, "torch.save(model.state_dict()) / load_state_dict")

    # The checkpoint, over whatever the model holds now.
    extra = hybridsync.load_checkpoint(os.path.join(tmp, "ckpt"), model, opt)
    assert extra == {"steps": len(log.steps)}, extra
    _assert_same(_snapshot(model, opt), want, "hybridsync.load_checkpoint")

    # Training goes on, with the adaptive batch restored at this world size.
    _adaptive_epoch(model, opt, _data(seed=4), log, seed=6)
    snap = _snapshot(model, opt)
    if hvd.rank() == 0:
        _check_parity(dict(np.load(os.path.join(tmp, "initial.npz"))), log.steps, snap, device)


def rank_load_right_after_wrapping():
    """A rank that loads optimizer state (one-sided writes to every shard) and reads it back right
    after wrapping must not reach a shard whose rank has not set the table's rule yet: setting it
    restarts the slots, and before it the shard has none to read. Rank 1 is held up between making
    its tables and setting their rules."""
    import time

    import numpy as np
    import torch

    import hybridsync.torch as hvd
    from hybridsync.sync import ps_routes

    if hvd.rank() == 1:
        prepare = ps_routes.ShardedPS.prepare
        ps_routes.ShardedPS.prepare = lambda self: (time.sleep(1.0), prepare(self))[1]
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, DIM, sparse=True), "out": torch.nn.Linear(DIM, 1)})
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=LR), model=model)
    slots = np.arange(10 * DIM, dtype=np.float32).reshape(10, DIM)
    state = opt.state_dict()
    state["hybridsync"]["ps/sharded"]["emb.weight"]["slots"]["sum"] = torch.from_numpy(slots)
    opt.load_state_dict(state)
    got = opt.state_dict()["hybridsync"]["ps/sharded"]["emb.weight"]["slots"]["sum"].numpy()
    np.testing.assert_array_equal(got, slots)


@pytest.mark.parametrize("np_", [2, 3])
def test_state_loaded_right_after_wrapping_reaches_every_shard(np_):
    run_ranks(__file__, "rank_load_right_after_wrapping", np_)


@pytest.mark.parametrize("backend", ["mpi", "horovod"])
@pytest.mark.parametrize("np_,resume_np", [(1, 2), (2, 3), (3, 1)])
def test_everything_at_once(tmp_path, backend, np_, resume_np):
    env = {"HYBRIDSYNC_BACKEND": backend}
    run_ranks(__file__, "rank_job1", np_, str(tmp_path), env=env, timeout=240)
    run_ranks(__file__, "rank_job2", resume_np, str(tmp_path), env=env, timeout=240)


if __name__ == "__main__":
    rank_main(globals())
