"""A DLRM-style CTR model on Criteo-shaped synthetic data, trained with hybridsync.

13 dense + 8 sparse features; 8 tables x 250,000 rows x 32 dims (244 MiB of fp32 rows);
MLP 269 -> 256 -> 64 -> 1; ids ~ Zipf(1.2) mod rows; labels from a fixed seeded "teacher"
so the loss falls. The embedding tables are sharded on the parameter server (each rank holds
1/N of the rows); the MLP is all-reduced.

    mpirun -np 2 python examples/torch_dlrm.py            # as root: mpirun --allow-run-as-root
    horovodrun -np 2 python examples/torch_dlrm.py --steps 500 --placement replicated
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

DENSE_FEATURES, TABLES, ROWS, DIM = 13, 8, 250_000, 32


def torch_embedding(rows, dim):
    """A sparse nn.Embedding with DLRM's small uniform initial rows."""
    emb = nn.Embedding(rows, dim, sparse=True)
    nn.init.uniform_(emb.weight, -1.0 / np.sqrt(rows), 1.0 / np.sqrt(rows))
    return emb


class DLRM(nn.Module):
    """embedding(rows, dim) builds each table: torch_embedding by default, or e.g. a
    hybridsync.torch.Embedding factory so the rows are created on the PS shards directly."""

    def __init__(self, tables=TABLES, rows=ROWS, dim=DIM, dense=DENSE_FEATURES, embedding=torch_embedding, hot_rows=0):
        super().__init__()
        # hot_rows > 0: table 0 is small and most of its rows are used every step (a dense-ish table).
        self.embeddings = nn.ModuleList(embedding(hot_rows if k == 0 and hot_rows else rows, dim)
                                        for k in range(tables))
        self.mlp = nn.Sequential(nn.Linear(dense + tables * dim, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                                 nn.Linear(64, 1))

    def forward(self, dense, sparse):
        looked_up = [emb(sparse[:, k]) for k, emb in enumerate(self.embeddings)]
        return self.mlp(torch.cat([dense] + looked_up, dim=1)).squeeze(1)


class SyntheticCriteo:
    """Batches of (dense, sparse ids, label). The label comes from a fixed teacher: a linear
    function of the dense features plus one seeded score per (table, id), thresholded."""

    def __init__(self, batch_size, tables=TABLES, rows=ROWS, dense=DENSE_FEATURES, seed=0, teacher_seed=1234,
                 hot_rows=0):
        self.batch_size, self.tables, self.rows, self.dense = batch_size, tables, rows, dense
        self.hot_rows = hot_rows  # > 0: table 0's ids are uniform over its hot_rows rows
        self.rng = np.random.default_rng(seed)
        teacher = np.random.default_rng(teacher_seed)
        self.dense_weight = teacher.standard_normal(dense).astype(np.float32) / np.sqrt(dense)
        self.id_score = teacher.standard_normal((tables, rows)).astype(np.float32)

    def batch(self):
        dense = self.rng.standard_normal((self.batch_size, self.dense)).astype(np.float32)
        sparse = (self.rng.zipf(1.2, (self.batch_size, self.tables)) % self.rows).astype(np.int64)
        if self.hot_rows:
            sparse[:, 0] = self.rng.integers(0, self.hot_rows, self.batch_size)
        logit = dense @ self.dense_weight + self.id_score[np.arange(self.tables), sparse].mean(1) * 3.0
        label = (logit > 0).astype(np.float32)
        return torch.from_numpy(dense), torch.from_numpy(sparse), torch.from_numpy(label)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=512, help="per rank")
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--tables", type=int, default=TABLES)
    parser.add_argument("--dim", type=int, default=DIM)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--placement", choices=["sharded", "replicated"], default="sharded")
    parser.add_argument("--ps-embeddings", action="store_true",
                        help="build the tables directly on the PS shards (no rank ever holds a whole table)")
    parser.add_argument("--config", default=None, help="YAML config with per-variable overrides")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--checkpoint", metavar="DIR", default=None,
                        help="commit a checkpoint here every --checkpoint-every steps and resume from it on "
                             "restart, at any number of ranks")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--horovod", action="store_true",
                        help="train with horovod.torch itself (sparse gradients all-gathered), for comparisons")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu",
                        help="where the model runs, e.g. cuda (each rank takes GPU local_rank %% GPUs); the PS "
                             "tables' rows stay on the shards in host memory")
    parser.add_argument("--slow-ms", type=float, default=0.0,
                        help="a straggler: the last rank sleeps this long every step (a slow data loader; see "
                             "docs/staleness.md)")
    args = parser.parse_args()

    import hybridsync
    if args.horovod:
        import horovod.torch as hvd
    else:
        import hybridsync.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    embedding = torch_embedding
    if args.ps_embeddings:
        bound = 1.0 / np.sqrt(args.rows)
        embedding = lambda rows, dim: hvd.Embedding(rows, dim, initializer=("uniform", -bound, bound))
    model = DLRM(args.tables, args.rows, args.dim, embedding=embedding).to(device)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if args.horovod:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    elif args.placement == "sharded":  # embedding rows live only on the PS shards
        optimizer = hybridsync.DistributedOptimizer(optimizer, model=model, config=args.config)
    else:  # every rank keeps a replica of each table, Horovod-style
        optimizer = hybridsync.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                    config=args.config)
    data = SyntheticCriteo(args.batch_size, args.tables, args.rows, seed=args.seed * 1000 + rank)
    first = 1
    if args.checkpoint:
        import hybridsync.elastic as elastic

        state = elastic.CheckpointState(args.checkpoint, model, optimizer, step=0)
        if state.restore():
            first = state.step + 1
            for _ in range(state.step):  # the data position: this rank's stream, replayed
                data.batch()
            if rank == 0:
                print(f"resumed from {args.checkpoint} at step {state.step} on {size} rank(s)\n", end="", flush=True)

    losses, start = [], time.perf_counter()
    for step in range(first, args.steps + 1):
        dense, sparse, label = (t.to(device) for t in data.batch())
        if args.slow_ms and rank == size - 1:
            time.sleep(args.slow_ms / 1000)
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), label)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == 1 and rank == 0 and not args.horovod:
            hybridsync.explain()
        if step % args.log_every == 0 or step == args.steps:
            mean = hvd.allreduce(torch.tensor(np.mean(losses[-args.log_every:])), name="loss").item()
            if rank == 0:  # the newline in the same write: horovodrun tags each chunk it reads
                print(f"step {step:5d}  loss {mean:.4f}\n", end="", flush=True)
        if args.checkpoint and (step % args.checkpoint_every == 0 or step == args.steps):
            state.step = step
            state.commit()
    elapsed = time.perf_counter() - start
    if rank == 0:
        rate = (args.steps - first + 1) * args.batch_size * size / elapsed
        print(f"{args.steps} steps on {size} rank(s): {rate:,.0f} samples/s\n", end="", flush=True)
        for v in [] if args.horovod else optimizer.plan.variables:
            if getattr(v, "staleness", 0):
                from hybridsync.planning.report import describe_staleness

                print(f"staleness: {describe_staleness(v)}\n", end="", flush=True)


if __name__ == "__main__":
    main()
