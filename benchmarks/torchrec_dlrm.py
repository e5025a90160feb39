"""TorchRec baseline: the flagship DLRM workload with TorchRec's own model parallelism, on CPU.

The workload is benchmarks/run_one.py's, step for step: 8 tables x 250,000 x 32 fp32, 13 dense
features, MLP 269-256-64-1 on [dense, the 8 looked-up rows], batch 512 per rank, ids ~ Zipf(1.2)
mod rows and the teacher's labels (examples/torch_dlrm.py's SyntheticCriteo), the same global
batches sliced per rank (run_one.global_batches), SGD, 1 thread per rank. The tables are one
EmbeddingBagCollection (one id per feature and sample: a bag of one is a lookup), initialised as
the DLRM's, uniform(+-1/sqrt(rows)); the MLP is built as the DLRM's. DistributedModelParallel
over Gloo shards the collection with TorchRec's default planner (its plan is printed) and wraps
the MLP in DDP; the tables' SGD is fused into the backward pass (apply_optimizer_in_backward ->
FBGEMM's EXACT_SGD), the MLP's is a torch.optim.SGD.

Runs in a venv with TorchRec (not one of hybridsync's dependencies; scripts/torchrec-venv.sh
builds one), under torchrun:

    OMP_NUM_THREADS=1 VENV/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/torchrec_dlrm.py --steps 200

benchmarks/bench.py (system "torchrec-cpu") and benchmarks/network.py launch it. Rank 0 prints
the plan, then one line `BENCH-RESULT {json}` with the keys run_one.py reports.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE))

SYSTEM = "torchrec-cpu"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=512, help="per rank")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=250_000)
    p.add_argument("--dim", type=int, default=32)
    # The same default as run_one.py's, so bench.py's systems train with one learning rate.
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wire-iface", default=None,
                   help="count the bytes this host sends/receives on this interface over the timed steps")
    return p.parse_args()


def require_torchrec():
    """Imports TorchRec, or exits with what to do: this script runs in TorchRec's own venv."""
    try:
        import fbgemm_gpu  # noqa: F401  (registers the CPU kernels TorchRec's sharded tables call)
        import torchrec  # noqa: F401
    except ImportError as e:
        sys.exit(f"torchrec_dlrm.py: TorchRec does not import in {sys.executable} ({e}). Run it with the "
                 "python of a TorchRec venv: `bash scripts/torchrec-venv.sh` builds one and prints its python.")


class TorchRecDLRM:
    """Builds the unsharded model: the tables on the meta device (DistributedModelParallel
    creates each shard where the plan puts it), the MLP as examples/torch_dlrm.py's DLRM has it."""

    @staticmethod
    def build(args):
        import torch
        import torch.nn as nn
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        from torch_dlrm import DENSE_FEATURES

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.features = [f"f{k}" for k in range(args.tables)]
                self.tables = EmbeddingBagCollection(
                    tables=[EmbeddingBagConfig(name=f"t{k}", embedding_dim=args.dim, num_embeddings=args.rows,
                                               feature_names=[f"f{k}"], pooling=PoolingType.SUM)
                            for k in range(args.tables)],
                    device=torch.device("meta"))
                self.mlp = nn.Sequential(nn.Linear(DENSE_FEATURES + args.tables * args.dim, 256), nn.ReLU(),
                                         nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))

            def forward(self, dense, ids):
                pooled = self.tables(ids).to_dict()
                looked_up = [pooled[f] for f in self.features]
                return self.mlp(torch.cat([dense] + looked_up, dim=1)).squeeze(1)

        return Model()


def as_kjt(sparse, tables):
    """(batch, tables) ids -> a KeyedJaggedTensor, one id per feature and sample."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch = sparse.shape[0]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{k}" for k in range(tables)], values=sparse.t().contiguous().reshape(-1),
        lengths=torch.ones(batch * tables, dtype=torch.int32))


def wire_bytes(iface):
    """(tx, rx) bytes of this host's interface so far; None without one."""
    if not iface:
        return None
    stats = Path("/sys/class/net") / iface / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def main():
    args = parse_args()
    require_torchrec()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from run_one import global_batches

    torch.set_num_threads(1)
    if "RANK" not in os.environ:
        sys.exit("torchrec_dlrm.py: launch it with torchrun (python -m torch.distributed.run --standalone "
                 "--nproc_per_node N ...): RANK is not set")
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    args.hot_rows = 0  # what run_one.global_batches reads
    batches, _ = global_batches(args, size, rank, args.batch)
    batches = [(dense, as_kjt(sparse, args.tables), label) for dense, sparse, label in batches]

    torch.manual_seed(args.seed)
    model = TorchRecDLRM.build(args)
    _apply_optimizer_in_backward(torch.optim.SGD, model.tables.parameters(), {"lr": args.lr})
    model = DistributedModelParallel(model, device=torch.device("cpu"))  # default planner and sharders
    plan = str(model.plan)
    if rank == 0:
        print(f"TorchRec sharding plan ({size} rank(s)):\n{plan}", flush=True)
    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    opt = torch.optim.SGD(dense_params.values(), lr=args.lr)
    wrap_peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    losses, step_ms = [], []
    phases = np.zeros(3)  # forward / backward (the tables' fused update runs here) / the MLP's step
    clock = time.perf_counter

    def step(dense, ids, label):
        t0 = clock()
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, ids), label)
        t1 = clock()
        loss.backward()
        t2 = clock()
        opt.step()
        losses.append(loss.item())
        t3 = clock()
        phases[:] += (t1 - t0, t2 - t1, t3 - t2)
        step_ms.append((t3 - t0) * 1e3)

    for b in batches[:args.warmup]:
        step(*b)
    dist.barrier()
    phases[:] = 0
    step_ms.clear()
    wire_start = wire_bytes(args.wire_iface)
    start = clock()
    for b in batches[args.warmup:]:
        step(*b)
    dist.barrier()
    elapsed = clock() - start
    wire_end = wire_bytes(args.wire_iface)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # The host's bytes, shared out to its ranks; counted once per host (by its local rank 0).
    wire = ([(e - b) / local_size / args.steps for b, e in zip(wire_start, wire_end)]
            if wire_start and local_rank == 0 else None)
    mine = {
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "wrap_rss": wrap_peak_rss,
        "phases_ms": (phases / args.steps * 1e3).tolist(),
        "median_step_ms": float(np.median(step_ms)),
        "wire": wire,
        "loss": float(np.mean(losses[-20:])),
    }
    everyone = [None] * size
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        result = {
            "system": SYSTEM, "ranks": size, "global_ranks": size, "batch": args.batch,
            "steps": args.steps, "warmup": args.warmup, "elapsed_s": elapsed,
            "samples_per_s": args.steps * args.batch * size / elapsed,
            "ms_per_step": elapsed / args.steps * 1e3,
            "median_step_ms": float(np.median([e["median_step_ms"] for e in everyone])),
            "rss_per_rank": [e["rss"] for e in everyone],
            "wrap_peak_rss_per_rank": [e["wrap_rss"] for e in everyone],
            "loss": float(np.mean([e["loss"] for e in everyone])),
            "ps_bytes_sent_per_rank_step": None, "ps_bytes_received_per_rank_step": None,
            "unique_row_min_bytes_per_rank_step": None,
            "table_bytes": args.tables * args.rows * args.dim * 4,
            "phases_ms": dict(zip(("forward", "backward", "step"),
                                  np.mean([e["phases_ms"] for e in everyone], axis=0).tolist())),
            "plan": plan,
            "versions": {"torch": torch.__version__, "torchrec": __import__("torchrec").__version__,
                         "fbgemm_gpu": getattr(__import__("fbgemm_gpu"), "__version__", "?")},
        }
        wires = [e["wire"] for e in everyone if e["wire"]]
        if wires:
            result["wire_tx_bytes_per_rank_step"] = float(np.mean([w[0] for w in wires]))
            result["wire_rx_bytes_per_rank_step"] = float(np.mean([w[1] for w in wires]))
        print("BENCH-RESULT " + json.dumps(result), flush=True)
    # Leave together: a rank that tears Gloo down first resets its peers' connections.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
