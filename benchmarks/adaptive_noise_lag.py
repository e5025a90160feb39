"""How far the adaptive controller's noise scale lags the true one early in DLRM training.

    python benchmarks/adaptive_noise_lag.py      # ~1-2 minutes, one process
    python benchmarks/adaptive_noise_lag.py --batch 4096 --steps 60 --every 10   # late training, the large batch

benchmarks/adaptive.py's DLRM (same tables, data and Adagrad learning rate) at batch 512 for 40
steps, in one process: each step's two halves stand in for two ranks of 256, and their squared
norms go through the controller's own statistics (hybridsync.adaptive.GradientStats at the
default smoothing, steady(): what the batch decisions read). At steps 10, 20, 30 and 40 the true
noise scale tr(Sigma) / |G|^2 is measured from 256 chunks of 64 fresh training samples (|G|^2
with the chunks' mean's own noise taken out). Early on |G|^2 falls by about as much per step as
the average forgets, so the average holds the first steps' large gradients and reads the noise
scale several times too small, with one-standard-error bounds that do not reach the truth
(docs/adaptive.md, "How the batch climbs").

--batch / --steps / --every replay another fixed batch (its two halves the ranks, each step
weighing batch / base as in the controller) further into training: late on, against the truth
over both the whole training set and the part not yet seen, the reading is within the truth's own
scatter (docs/adaptive.md, "Why DLRM's late target stays at ~1.3x")."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from torch_dlrm import DLRM, SyntheticCriteo  # noqa: E402

from hybridsync.adaptive import GradientStats  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=512, help="global batch, two 'ranks' of half each")
    parser.add_argument("--base", type=int, default=512, help="the controller's base batch (a step weighs batch / base)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="steps between readings against the truth")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tables, rows, dim = 8, 20_000, 16  # benchmarks/adaptive.py's DLRM
    model = DLRM(tables, rows, dim)
    dense, sparse, label = SyntheticCriteo(400_000, tables, rows, seed=1).batch()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    params = list(model.parameters())

    def loss(idx):
        return torch.nn.functional.binary_cross_entropy_with_logits(model(dense[idx], sparse[idx]), label[idx])

    def gradient(idx) -> torch.Tensor:
        model.zero_grad()
        loss(idx).backward()
        return torch.cat([(p.grad.to_dense() if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])

    rng = np.random.default_rng(0)

    def true_noise_scale(pool, chunks: int = 256, size: int = 64) -> float:
        idx = rng.choice(pool, chunks * size, replace=False)
        total, squares = 0, 0.0
        for j in range(chunks):
            g = gradient(torch.from_numpy(idx[j * size:(j + 1) * size]))
            total, squares = total + g, squares + float(g @ g)
        mean = total / chunks
        trace = size * (squares - chunks * float(mean @ mean)) / (chunks - 1)  # tr(Sigma), per sample
        return trace / (float(mean @ mean) - trace / (chunks * size))

    stats = GradientStats()
    order = rng.permutation(len(label))
    batch, half = args.batch, args.batch // 2
    print(f"batch {batch} (two halves of {half}), base {args.base}")
    # The truth two ways: over the whole training set, and over the samples the run has not yet
    # seen (what its next steps draw: one pass, so a trained-on sample never comes back).
    print("step  samples  true (all)  true (unseen)  read (steady)  one-standard-error bounds  read (summary)")
    for step in range(1, args.steps + 1):
        idx = order[step * batch:(step + 1) * batch]
        first, second = gradient(torch.from_numpy(idx[:half])), gradient(torch.from_numpy(idx[half:]))
        combined = (first + second) / 2
        stats.observe_step([("model", (float(first @ first) + float(second @ second)) / 2, half,
                             float(combined @ combined), batch, batch / args.base)])
        if step % args.every == 0:
            steady = stats.steady()
            lo, hi = steady["noise_scale_bounds"]
            print(f"{step:4d}  {step * batch:7d}  {true_noise_scale(len(label)):10.0f}  "
                  f"{true_noise_scale(order[(step + 1) * batch:]):13.0f}  {steady['noise_scale']:13.0f}  "
                  f"{lo:.0f} - {hi:.0f}  {stats.summary()['noise_scale']:.0f}", flush=True)
        model.zero_grad()
        loss(torch.from_numpy(idx)).backward()
        opt.step()


if __name__ == "__main__":
    main()
