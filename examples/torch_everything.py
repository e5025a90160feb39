"""One recommendation model with every hybridsync feature at once: copy it and delete what you
do not need.

    mpirun -np 2 python examples/torch_everything.py --checkpoint /tmp/everything   # as root: --allow-run-as-root
    mpirun -np 3 python examples/torch_everything.py --checkpoint /tmp/everything --epochs 4   # resumes

- `items`: an nn.Embedding(sparse=True), sharded on the parameter server (rows live on the shards);
- `users`: a DynamicEmbedding over raw 64-bit ids -- admission after 2 touches, LRU eviction at a
  capacity, expiry of rows untouched for 200 steps -- bags of 3 ids (with duplicates);
- `history`: a table with bounded staleness (`staleness: 2`: a slow rank holds the others back only
  once they are 2 steps ahead);
- `country`: a small, hot table, all-reduced as a dense gradient (`allreduce-as-dense`);
- an MLP, all-reduced;
- the adaptive batch size (goodput), gradient accumulation allowed (`adaptive={"rescale_accumulators":
  "auto"}` would also rescale Adagrad's accumulators at each batch change: opt-in, docs/adaptive.md);
- a step whose loss is not finite is skipped, as a GradScaler would skip it;
- every epoch's last batches are uneven across ranks and end in `hvd.join()`;
- an elastic state committed every epoch, a checkpoint too: restart at any number of ranks;
- Horovod's own save idiom at the end: `torch.save(model.state_dict())` on rank 0.
"""
from __future__ import annotations

import argparse
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

import hybridsync
import hybridsync.torch as hvd

ITEMS, COUNTRIES, HISTORY, DIM, DENSE = 50_000, 40, 5_000, 16, 8

CONFIG = {
    "variables": [
        {"match": "history.*", "staleness": 2, "optimizer": {"name": "sgd", "lr": 0.05}},
        {"match": "country.*", "sync": "allreduce-as-dense"},
        {"match": "users.*", "dynamic": {"capacity": 20_000, "evict": "lru", "ttl_steps": 200, "admit_after": 2}},
    ],
}


class Recommender(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.items = torch.nn.Embedding(ITEMS, DIM, sparse=True)
        self.users = hvd.DynamicEmbedding(DIM, mode="sum", name="users", seed=1)
        self.history = torch.nn.Embedding(HISTORY, DIM, sparse=True)
        self.country = torch.nn.Embedding(COUNTRIES, DIM, sparse=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DENSE + 4 * DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, dense, item, users, history, country):
        x = torch.cat([dense, self.items(item), self.users(users), self.history(history), self.country(country)], 1)
        return self.mlp(x).squeeze(1)


def synthetic_clicks(n: int, seed: int = 0):
    """(dense, item, user bag, history, country, label); the label comes from a fixed teacher."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((n, DENSE)).astype(np.float32)
    item = rng.zipf(1.2, n) % ITEMS
    users = (rng.zipf(1.1, (n, 3)).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)  # raw hashes
    users[::7, 1] = users[::7, 0]
    history = rng.integers(0, HISTORY, n)
    country = rng.integers(0, COUNTRIES, n)
    teacher = np.random.default_rng(1234)
    w, item_score = teacher.standard_normal(DENSE), teacher.standard_normal(ITEMS)
    label = ((dense @ w + 2 * item_score[item] + 0.3 * rng.standard_normal(n)) > 0).astype(np.float32)
    cols = (dense, item, users, history, country, label)
    return torch.utils.data.TensorDataset(*(torch.from_numpy(np.ascontiguousarray(c)) for c in cols))


def loss_of(model, batch):
    dense, item, users, history, country, label = batch
    return F.binary_cross_entropy_with_logits(model(dense, item, users, history, country), label)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16_384)
    parser.add_argument("--batch-size", type=int, default=256, help="the global batch the LR was set for")
    parser.add_argument("--max-batch-size", type=int, default=2048)
    parser.add_argument("--checkpoint", default=None, help="directory: resume from it, commit to it every epoch")
    parser.add_argument("--nan-at-step", type=int, default=5, help="make this step's loss NaN on rank 0 (-1: never)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = Recommender()
    optimizer = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.05), model=model,
                                         config=CONFIG, adaptive=True)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    state = hybridsync.elastic.CheckpointState(args.checkpoint, model, optimizer, epoch=0) if args.checkpoint \
        else hvd.elastic.TorchState(model, optimizer, epoch=0)
    if args.checkpoint and state.restore() and rank == 0:
        print(f"resumed at epoch {state.epoch} on {size} rank(s)", flush=True)

    loader = hvd.AdaptiveDataLoader(synthetic_clicks(args.samples), batch_size=args.batch_size)
    loader.autoscale_batch_size(args.max_batch_size, gradient_accumulation=True)
    uneven = synthetic_clicks(16 * 8 * size, seed=rank + 100)  # each rank's own extra data, of its own length
    step = 0

    def train(batch, nan=False) -> float | None:
        """One backward pass; on a step's last micro-step, the step -- skipped where not finite."""
        nonlocal step
        loss = loss_of(model, batch)
        (loss * math.nan if nan else loss).backward()  # NaN: a loss-scaled step that overflowed, say
        if not optimizer.last_micro_step:
            optimizer.step()  # an accumulation micro-step of the adaptive batch: gradients add up
            return None
        optimizer.synchronize()  # dense gradients all-reduced (the same on every rank); tables wait
        step += 1
        if all(torch.isfinite(g).all() for g in _dense_grads(model)):
            with optimizer.skip_synchronize():
                optimizer.step()
            optimizer.zero_grad()
            return loss.item()
        optimizer.zero_grad()  # the step is skipped: no table moves either
        if rank == 0:
            print(f"step {step}: the gradients are not finite, the step is skipped", flush=True)
        return None

    for epoch in range(state.epoch, args.epochs):
        losses = [train(batch, nan=step == args.nan_at_step and rank == 0) for batch in loader]
        losses = [x for x in losses if x is not None]
        # Uneven data: rank r has r + 1 more batches, then joins; the others go on without it.
        for b in range((rank + 1) * loader.accumulation_steps):
            train(uneven[b * 16:(b + 1) * 16])
        last = hvd.join()  # the rank that joined last took every step: the others' dense layers lag behind it
        hvd.broadcast_parameters(model.state_dict(), root_rank=last)
        hvd.broadcast_optimizer_state(optimizer, root_rank=last)
        state.epoch = epoch + 1
        state.commit()
        mean = hvd.allreduce(torch.tensor(float(np.mean(losses)) if losses else 0.0), name="loss").item()
        if rank == 0:
            print(f"epoch {epoch}  loss {mean:.4f}  batch {loader.current_batch_size}  "
                  f"noise scale {optimizer.gradient_stats()['noise_scale']:.0f}", flush=True)
    if rank == 0:
        hybridsync.explain()
        torch.save(model.state_dict(), (args.checkpoint or "everything") + ".state.pt")  # Horovod's idiom


def _dense_grads(model):
    for p in model.parameters():
        if p.grad is not None:
            yield p.grad.coalesce().values() if p.grad.is_sparse else p.grad


if __name__ == "__main__":
    main()
