"""What a batch switch costs under Adagrad at an unscaled LR: samples to the held-out targets
along a batch *schedule*, against the fixed batches. One process, no engine.

    python benchmarks/adaptive_switch.py                  # DLRM, the schedules below, 2 data orders (~3-5 min)
    python benchmarks/adaptive_switch.py --seeds 3 --schedules 4096 512:15360,1024:20480,4096
    python benchmarks/adaptive_switch.py --swap-accumulators --schedules 512:15360,1024:20480,3232
    python benchmarks/adaptive_switch.py --rescale-accumulators 1000 --schedules 512:15360,1024:20480,3232
    python benchmarks/adaptive_switch.py --model word2vec --schedules 1024 8192 1024:30720,2048:92160,6472:221600,16384

benchmarks/adaptive_efficiency.py's DLRM (the benchmark's sizes, data, initial model, Adagrad LR
0.05 written for 512 and left unscaled, held-out loss every 4,096 samples), or its word2vec
(--model word2vec; the default schedules are DLRM's, give word2vec's with --schedules). A schedule is
`batch:until_samples,...,batch` (the last batch runs to the target): `512:15360,1024:20480,3232` is
the median adaptive run of benchmarks/adaptive.py (30 steps at 512, 5 at 1024, then ~3,236).

Any efficiency model of the form eff(phi, M) <= 1, decreasing in M, puts a schedule's samples
between the smallest and the largest batch's. Under Adagrad the step is lr / sqrt(accumulator),
and the accumulator sums every past step's squared gradient: a small-batch prefix adds many
noisy steps early, while |G|^2 is large, and the big batch that follows steps at the learning
rate that history left -- so the prefix costs samples after the switch, which no statistic of the
current gradients carries. --swap-accumulators tests that: at the switch, the path's Adagrad
accumulators are replaced by a fixed run's at the final batch (same samples), the parameters kept.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import adaptive_efficiency as ae  # noqa: E402


def parse(schedule: str) -> list[tuple[int, float]]:
    """'512:15360,1024:20480,3232' -> [(512, 15360), (1024, 20480), (3232, inf)]."""
    phases = []
    for part in schedule.split(","):
        batch, _, until = part.partition(":")
        phases.append((int(batch), float(until) if until else float("inf")))
    if phases[-1][1] != float("inf"):
        raise ValueError(f"schedule '{schedule}': the last phase needs no ':until' (it runs to the target)")
    return phases


def run(phases, seed, targets, train_set, held, eval_every=4096, max_samples=None, swap=False,
        rescale=None):
    """Samples to each target along `phases`. With `swap`, when the last phase starts, Adagrad's
    accumulators are replaced by those of a run at the last phase's batch from the first step,
    trained on as many samples (to the nearest step): the parameters keep the path, the
    learning rates lose its history. With `rescale` (a noise scale phi), at every batch change
    from b to B the accumulators are multiplied by what a sample adds to them at B over at b,
    (B + phi) / B^2 against (b + phi) / b^2 (E g^2 ~ |G|^2 (1 + phi / M), 1 / M steps per
    sample): an estimate of the swap from the statistics alone."""
    max_samples = max_samples or ae.PROBLEM.max_samples
    model = ae.PROBLEM.model()
    opt = torch.optim.Adagrad(model.parameters(), lr=ae.PROBLEM.lr)
    rng = np.random.default_rng(seed)
    n = len(train_set[0])
    seen, next_eval, batch = 0, eval_every, None
    with torch.no_grad():
        curve = [(0, ae.loss_of(model, held).item())]
    order, pos = torch.from_numpy(rng.permutation(n)), 0
    low = min(targets)
    last_batch, switch = phases[-1][0], (phases[-2][1] if len(phases) > 1 else 0)
    while seen < max_samples and curve[-1][1] > low:
        previous, batch = batch if seen else None, next(b for b, until in phases if seen < until)
        if swap and switch and seen == switch:
            steps = max(1, round(switch / last_batch))
            sums = accumulators(last_batch, steps, seed, train_set)
            ratios = []
            for p, total in zip(model.parameters(), sums):
                ratios.append(float(total.sum()) / float(opt.state[p]["sum"].sum()))
                opt.state[p]["sum"].copy_(total)
            print(f"  swap at {seen}: fixed run's accumulator / the path's, per parameter: "
                  + " ".join(f"{r:.3f}" for r in ratios), flush=True)
        if rescale is not None and previous and batch != previous:
            factor = ((batch + rescale) / batch ** 2) / ((previous + rescale) / previous ** 2)
            for p in model.parameters():
                opt.state[p]["sum"].mul_(factor)
        if pos + batch > n:
            order, pos = torch.from_numpy(rng.permutation(n)), 0
        idx = order[pos:pos + batch]
        pos += batch
        opt.zero_grad()
        ae.loss_of(model, tuple(t[idx] for t in train_set)).backward()
        opt.step()
        seen += batch
        if seen >= next_eval:
            next_eval += eval_every
            with torch.no_grad():
                curve.append((seen, ae.loss_of(model, held).item()))
    return {str(t): ae._crossing(curve, t) for t in targets}


def accumulators(batch, steps, seed, train_set):
    """Adagrad's accumulators after `steps` steps at a fixed `batch` from the initial model."""
    model = ae.PROBLEM.model()
    opt = torch.optim.Adagrad(model.parameters(), lr=ae.PROBLEM.lr)
    order = torch.from_numpy(np.random.default_rng(1000 + seed).permutation(len(train_set[0])))
    for step in range(steps):
        idx = order[step * batch:(step + 1) * batch]
        opt.zero_grad()
        ae.loss_of(model, tuple(t[idx] for t in train_set)).backward()
        opt.step()
    return [opt.state[p]["sum"].clone() for p in model.parameters()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedules", nargs="+",
                    default=["512", "3232", "4096", "512:15360,1024:20480,3232", "512:15360,1024:20480,4096"])
    ap.add_argument("--model", choices=sorted(ae.PROBLEMS), default="dlrm")
    ap.add_argument("--eval-every", type=int, default=4096, help="samples between held-out evaluations")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="data orders")
    ap.add_argument("--targets", type=float, nargs="+", help="held-out losses (default: the benchmark's two)")
    ap.add_argument("--swap-accumulators", action="store_true",
                    help="at the last phase's start, Adagrad's accumulators of a run at that batch from the first step")
    ap.add_argument("--rescale-accumulators", type=float, metavar="PHI",
                    help="at each batch change, rescale the accumulators for noise scale PHI (see run())")
    args = ap.parse_args()
    ae.PROBLEM = ae.PROBLEMS[args.model]()
    args.targets = args.targets or ae.PROBLEM.targets
    torch.set_num_threads(1)
    train_set, held = ae.PROBLEM.data()
    print("schedule | seed | samples to " + " / ".join(map(str, args.targets)), flush=True)
    for seed in args.seeds:
        for schedule in args.schedules:
            got = run(parse(schedule), seed, args.targets, train_set, held, eval_every=args.eval_every,
                      swap=args.swap_accumulators,
                      rescale=args.rescale_accumulators)
            print(f"{schedule} | {seed} | " + " / ".join(f"{got[str(t)]:.0f}" if got[str(t)] else "-"
                                                         for t in args.targets), flush=True)


if __name__ == "__main__":
    main()
