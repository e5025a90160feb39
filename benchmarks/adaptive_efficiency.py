"""Which noise scale predicts Adagrad's statistical efficiency? One process, no engine.

benchmarks/adaptive.py's DLRM (examples/torch_dlrm.py's model and SyntheticCriteo, the same
sizes, seeds, Adagrad learning rate and held-out set; or its word2vec, --model word2vec) trained in one process with plain
torch.optim.Adagrad (sparse nn.Embedding tables: the same update as the PS's Adagrad rule), at
fixed global batches, e.g. 512 and 4096, with the learning rate written for 512 and left unscaled
(the benchmark's `auto` rule for Adagrad).

(a) Measured efficiency of batch M against the base M0: samples to a held-out target at M0 over
    samples at M (the held-out loss is evaluated every `--eval-every` samples and the crossing
    interpolated linearly in samples), per data-order seed.
(b) Along the base batch's run, every step splits its batch into `--micro` micro-batches (as
    ranks would be): the micro-batches' mean |g_b|^2 and the whole batch's |g_B|^2 give
    (|G|^2, tr(Sigma)) as hybridsync/adaptive/gns.py does, smoothed by its GradientStats
    (smoothing 0.8, the default). Three times:
      plain  the gradients as they are: phi = tr(Sigma) / |G|^2 (what the controller uses)
      pre    each element multiplied by Adagrad's preconditioner 1 / (sqrt(accumulator) + eps),
             the accumulator as it was before the step (independent of the step's gradients;
             an element never updated before -- a table row touched for the first time -- takes
             the step's own): phi_P = tr(P Sigma P) / |P G|^2 (Pollux's treatment of adaptive
             optimizers)
      post   the same with the accumulator the step divided by (it holds the step's own g^2,
             which biases |P g_B|^2 down)
      seen   as pre, leaving out the elements never updated before (P = 0 there)
    Also each variable group's own phi (the MLP, all-reduced in the benchmark; the tables, on
    the PS there).
(c) Predicted efficiency of M, over the base run up to the target: the base run's samples over
    the samples the model says M needs for the same progress, i.e. the harmonic mean over the
    base run's steps of eff(phi_t), for
      sgd   eff = (phi + M0) / (phi + M)          (goodput.efficiency: AdaScale / McCandlish)
      sqrt  eff = sqrt((phi + M0) / (phi + M))    (Adagrad at an unscaled LR moves
                                                   ~ 1/sqrt(M|G|^2 + sigma^2) per sample:
                                                   scaling.py's derivation)
    each with each kind of phi (and 'sgd' with each group's own phi alone).

    python benchmarks/adaptive_efficiency.py                       # DLRM: 512 vs 1024/2048/4096, 3 seeds, forks
    python benchmarks/adaptive_efficiency.py --model word2vec --seeds 2   # 1024 vs 2048/4096/8192
    python benchmarks/adaptive_efficiency.py --batches 512 4096 --seeds 1 --targets 0.26

(d) Forks (DLRM by default): the local efficiency at a state of the base run -- from its model and
    accumulators at `--forks` samples, `--fork-span` samples at the bigger batch, against the base
    batch's samples from the same state to the same held-out loss -- and the predictions from
    that state's smoothed noise scales.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from hybridsync.adaptive.gns import GradientStats  # noqa: E402
from torch_dlrm import DLRM, SyntheticCriteo  # noqa: E402

HELD_OUT = 32768  # benchmarks/adaptive.py's held-out set
EPS = 1e-10  # torch.optim.Adagrad's (and the PS rule's) default
GROUPS = ("dense", "tables")  # the dense layers (all-reduced in the benchmark) and the embedding tables (on the PS)
KINDS = ("plain", "pre", "post", "seen")  # see (b) above


class DlrmProblem:
    """benchmarks/adaptive.py's DLRM: sizes, data seeds, initial model and Adagrad LR."""
    lr, batches, targets, forks, max_samples = 0.05, [512, 1024, 2048, 4096], [0.26, 0.22], [32768, 98304, 196608], 400_000

    def data(self):
        tables, rows = 8, 20_000
        return (SyntheticCriteo(400_000, tables, rows, seed=1).batch(),
                SyntheticCriteo(HELD_OUT, tables, rows, seed=2).batch())

    def model(self):
        torch.manual_seed(0)
        return DLRM(8, 20_000, 16)

    def loss(self, model, batch):
        dense, sparse, label = batch
        return F.binary_cross_entropy_with_logits(model(dense, sparse), label)


class Word2vecProblem:
    """benchmarks/adaptive.py's word2vec (skip-gram, two sparse tables, no dense layer)."""
    lr, batches, targets, forks, max_samples = 0.2, [1024, 2048, 4096, 8192], [2.38, 2.37], [], 1_600_000

    def data(self):
        from torch_word2vec import SkipGramBatches
        from zipf_text import ZipfText

        text = ZipfText(20_000, 3_000_000, 1.1, seed=0)
        pairs = SkipGramBatches(text, window=3, negatives=5, seed=0)
        n = 2_000_000
        return pairs.batch(0, n, 0, n), pairs.batch(0, HELD_OUT, 0, HELD_OUT, held_out=True)

    def model(self):
        from torch_word2vec import SkipGram

        torch.manual_seed(0)
        return SkipGram(20_000, 32)

    def loss(self, model, batch):
        from torch_word2vec import negative_sampling_loss

        return negative_sampling_loss(model(*batch))


PROBLEMS = {"dlrm": DlrmProblem, "word2vec": Word2vecProblem}
PROBLEM = DlrmProblem()  # main() sets the one asked for


def loss_of(model, batch):
    return PROBLEM.loss(model, batch)


def _crossing(curve, target):
    """Samples at which the held-out loss first reaches `target`, interpolated between evaluations."""
    for (n0, l0), (n1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return n0 + (n1 - n0) * (l0 - target) / (l0 - l1) if l0 > target else n0
    return None


class NormPairs:
    """Per step: mean |g_micro|^2 over the micro-batches and |g_batch|^2, plain and
    preconditioned, per variable group ('dense', 'tables')."""

    def __init__(self, model):
        self.tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}

    def group(self, p):
        return "tables" if id(p) in self.tables else "dense"

    @staticmethod
    def _sq(grad, precond):
        if grad.is_sparse:
            grad = grad.coalesce()
            values = grad.values()
            if precond is not None:
                values = values * precond[grad.indices()[0]]
            return float(values.double().pow(2).sum())
        return float((grad if precond is None else grad * precond).double().pow(2).sum())

    def norms(self, params, micro_grads, batch_grads, preconds):
        """{(kind, group): (mean |g_micro|^2, |g_batch|^2)}; preconds: {kind: one tensor per param or None}."""
        out = {}
        for kind, pcs in preconds.items():
            for i, p in enumerate(params):
                pc = None if pcs is None else pcs[i]
                small = np.mean([self._sq(g[i], pc) for g in micro_grads])
                big = self._sq(batch_grads[i], pc)
                key = (kind, self.group(p))
                s, b = out.get(key, (0.0, 0.0))
                out[key] = (s + small, b + big)
        return out


def train(batch, seed, targets, eval_every, max_samples, micro, measure, train_set, held, forks=()):
    model = PROBLEM.model()  # the benchmark's initial model
    opt = torch.optim.Adagrad(model.parameters(), lr=PROBLEM.lr)
    params = [p for p in model.parameters()]
    pairs = NormPairs(model)
    stats = {kind: GradientStats(0.8) for kind in KINDS}
    saved = []  # (samples, model state, optimizer state, the step's statistics) at each fork point
    forks = sorted(forks)
    steps = []  # per base step (measure only): samples so far, phi and phi_P (smoothed, as the controller reads them)
    rng = np.random.default_rng(seed)
    n = len(train_set[0])
    seen, next_eval = 0, eval_every
    with torch.no_grad():
        curve = [(0, loss_of(model, held).item())]
    low = min(targets)
    while seen < max_samples and curve[-1][1] > low:
        order = torch.from_numpy(rng.permutation(n))
        for start in range(0, n - batch + 1, batch):
            idx = order[start:start + batch]
            b = tuple(t[idx] for t in train_set)
            if measure:
                size = batch // micro
                micro_grads = []
                for k in range(micro):
                    mb = tuple(t[k * size:(k + 1) * size] for t in b)
                    micro_grads.append(torch.autograd.grad(loss_of(model, mb), params))
                batch_grads = []
                for i in range(len(params)):
                    g = micro_grads[0][i]
                    for mg in micro_grads[1:]:
                        g = g + mg[i]
                    g = g / micro
                    batch_grads.append(g.coalesce() if g.is_sparse else g)
                before = [opt.state[p]["sum"].clone() if p in opt.state else torch.zeros_like(p) for p in params]
                for p, g in zip(params, batch_grads):
                    p.grad = g
                opt.step()
                after = [opt.state[p]["sum"] for p in params]  # what this step divided by
                preconds = {"plain": None,
                            "post": [1.0 / (a.sqrt() + EPS) for a in after],
                            # the accumulator before the step (independent of its gradients); an
                            # element never updated before has none: the step's own there
                            "pre": [1.0 / (torch.where(b > 0, b, a).sqrt() + EPS) for b, a in zip(before, after)],
                            # the same, leaving out (P = 0) the elements never updated before
                            "seen": [torch.where(b > 0, 1.0 / (b.sqrt() + EPS), torch.zeros_like(b)) for b in before]}
                norms = pairs.norms(params, micro_grads, batch_grads, preconds)
                for kind in stats:
                    stats[kind].observe_step([(group, s, size, big, batch, 1.0)
                                              for (k2, group), (s, big) in sorted(norms.items()) if k2 == kind])
                steps.append({"samples": seen + batch,
                              **{kind: stats[kind].summary()["noise_scale"] for kind in stats},
                              **{f"{kind}_{g}": _phi(stats[kind].summary()["by_variable"].get(g, {"sqr": math.nan, "var": math.nan}))
                                 for kind in stats for g in GROUPS}})
            else:
                opt.zero_grad()
                loss_of(model, b).backward()
                opt.step()
            seen += batch
            if forks and seen >= forks[0]:
                forks.pop(0)
                saved.append((seen, copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                              steps[-1] if steps else {}))
            if seen >= next_eval:
                next_eval += eval_every
                with torch.no_grad():
                    curve.append((seen, loss_of(model, held).item()))
                if curve[-1][1] <= low or seen >= max_samples:
                    break
    return {"batch": batch, "seed": seed, "curve": curve, "steps": steps, "saved": saved,
            "samples_to": {str(t): _crossing(curve, t) for t in targets}}


def fork(saved, base, batch, span, seed, train_set, held, eval_every):
    """Local efficiency at a saved state of the base run: train `span` samples at `batch` from
    it, then count the samples the base batch needs from the same state to reach the held-out
    loss that reached (interpolated). Both continue the same Adagrad state (accumulators)."""
    _, model_state, opt_state, _ = saved

    def resume():
        model = PROBLEM.model()
        model.load_state_dict(model_state)
        opt = torch.optim.Adagrad(model.parameters(), lr=PROBLEM.lr)
        opt.load_state_dict(copy.deepcopy(opt_state))
        return model, opt

    def run(size, until_samples, until_loss):
        model, opt = resume()
        rng = np.random.default_rng(seed)
        n = len(train_set[0])
        seen = 0
        with torch.no_grad():
            curve = [(0, loss_of(model, held).item())]
        while True:
            order = torch.from_numpy(rng.permutation(n))
            for start in range(0, n - size + 1, size):
                idx = order[start:start + size]
                opt.zero_grad()
                loss_of(model, tuple(t[idx] for t in train_set)).backward()
                opt.step()
                seen += size
                if seen % eval_every < size:
                    with torch.no_grad():
                        curve.append((seen, loss_of(model, held).item()))
                    if seen >= until_samples or curve[-1][1] <= until_loss:
                        return curve

    reached = run(batch, span, -math.inf)[-1][1]
    base_curve = run(base, span * 4, reached)
    needed = _crossing(base_curve, reached)
    return {"loss_at_start": base_curve[0][1], "loss_reached": reached,
            "base_samples": needed, "efficiency": (needed / span) if needed else math.nan}  # nan: below 1/4


def _phi(v):
    """A variable group's own noise scale from its smoothed {"sqr", "var"} (nan: no such group)."""
    if math.isnan(v["sqr"]):
        return math.nan
    return max(v["var"], 0.0) / v["sqr"] if v["sqr"] > 0 else math.inf


def eff_sgd(phi, base, batch):
    return 1.0 if not math.isfinite(phi) else (max(phi, 0.0) + base) / (max(phi, 0.0) + batch)


MODELS = {"sgd": eff_sgd, "sqrt": lambda phi, base, batch: math.sqrt(eff_sgd(phi, base, batch))}


def predicted(base_run, base, batch, target_samples, kind, model):
    """Harmonic mean of eff(phi_t) over the base run's steps up to the target."""
    phis = [s[kind] for s in base_run["steps"] if s["samples"] <= target_samples]
    inv = [1.0 / MODELS[model](phi, base, batch) for phi in phis if not math.isnan(phi)]
    return len(inv) / sum(inv) if inv else math.nan


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(PROBLEMS), default="dlrm")
    ap.add_argument("--batches", type=int, nargs="+", help="the first is the base (default: the model's)")
    ap.add_argument("--seeds", type=int, default=3, help="data orders per batch size")
    ap.add_argument("--targets", type=float, nargs="+", help="held-out losses (default: the benchmark's two)")
    ap.add_argument("--eval-every", type=int, default=4096)
    ap.add_argument("--max-samples", type=int, help="the most samples a run trains (default: DLRM 400k, word2vec 1.6M)")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per base step for the statistics")
    ap.add_argument("--forks", type=int, nargs="*",
                    help="samples of the base run at which to measure the local efficiency (forks; default: "
                         "DLRM 32768 98304 196608, word2vec none)")
    ap.add_argument("--fork-span", type=int, default=32768, help="samples each fork trains at the bigger batch")
    ap.add_argument("--out", help="JSON (default: benchmarks/results/adaptive_efficiency[-word2vec].json)")
    args = ap.parse_args()
    global PROBLEM
    PROBLEM = PROBLEMS[args.model]()
    for key in ("batches", "targets", "forks", "max_samples"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(PROBLEM, key))
    args.out = args.out or str(ROOT / "benchmarks" / "results" /
                               ("adaptive_efficiency.json" if args.model == "dlrm" else f"adaptive_efficiency-{args.model}.json"))
    torch.set_num_threads(1)
    train_set, held = PROBLEM.data()
    base = args.batches[0]
    runs = []
    for seed in range(args.seeds):
        for batch in args.batches:
            t0 = time.perf_counter()
            run = train(batch, 3 + seed, args.targets, args.eval_every, args.max_samples, args.micro,
                        measure=batch == base, train_set=train_set, held=held,
                        forks=args.forks if batch == base else ())
            runs.append(run)
            print(f"batch {batch:5d} seed {seed}: samples to {run['samples_to']}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    report = {"args": vars(args), "runs": runs, "rows": []}
    print("\nefficiency against the base batch: measured (median over seeds; per seed) and predicted "
          "(harmonic mean over the base runs' steps up to the target, mean over seeds)")
    for target in args.targets:
        base_runs = [r for r in runs if r["batch"] == base]
        for batch in args.batches[1:]:
            measured = []
            for seed in range(args.seeds):
                nb = next(r for r in base_runs if r["seed"] == 3 + seed)["samples_to"][str(target)]
                nm = next(r for r in runs if r["batch"] == batch and r["seed"] == 3 + seed)["samples_to"][str(target)]
                measured.append(nb / nm if nb and nm else math.nan)
            row = {"target": target, "batch": batch, "measured": float(np.median(measured)),
                   "measured_per_seed": measured}
            for kind in KINDS:
                phi_at = [next((s[kind] for s in r["steps"] if s["samples"] >= (r["samples_to"][str(target)] or 0)),
                               math.nan) for r in base_runs]
                row[f"phi_{kind}_at_target"] = float(np.median(phi_at))
                for model in MODELS:
                    row[f"{model}_{kind}"] = float(np.mean([predicted(r, base, batch, r["samples_to"][str(target)] or 0,
                                                                      kind, model) for r in base_runs]))
            for kind in ("plain", "pre"):
                for g in GROUPS:
                    row[f"sgd_{kind}_{g}"] = float(np.mean([predicted(r, base, batch, r["samples_to"][str(target)] or 0,
                                                                      f"{kind}_{g}", "sgd") for r in base_runs]))
            report["rows"].append(row)
    header = ["target", "batch", "measured (per seed)"] + [f"phi_{k} at target" for k in KINDS] + \
        [f"{m}({k})" for k in KINDS for m in MODELS] + [f"sgd({k}, {g} only)" for k in ("plain", "pre") for g in GROUPS]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in report["rows"]:
        per_seed = ", ".join(f"{m:.2f}" for m in r["measured_per_seed"])
        cells = [str(r["target"]), str(r["batch"]), f"{r['measured']:.2f} ({per_seed})"]
        cells += [f"{r[f'phi_{k}_at_target']:.0f}" for k in KINDS]
        cells += [f"{r[f'{m}_{k}']:.2f}" for k in KINDS for m in MODELS]
        cells += [f"{r[f'sgd_{k}_{g}']:.2f}" for k in ("plain", "pre") for g in GROUPS]
        print("| " + " | ".join(cells) + " |")
    report["forks"] = []
    for run in (r for r in runs if r["batch"] == base):
        for saved in run["saved"]:
            for batch in args.batches[1:]:
                t0 = time.perf_counter()
                f = fork(saved, base, batch, args.fork_span, 100 + run["seed"], train_set, held, 2048)
                stats = saved[3]
                f.update({"seed": run["seed"], "at_samples": saved[0], "batch": batch,
                          **{f"phi_{k}": stats.get(k, math.nan) for k in KINDS},
                          **{f"{m}_{k}": MODELS[m](stats.get(k, math.nan), base, batch) for k in KINDS for m in MODELS},
                          **{f"sgd_{k}_{g}": eff_sgd(stats.get(f"{k}_{g}", math.nan), base, batch)
                             for k in ("plain", "pre") for g in GROUPS}})
                report["forks"].append(f)
                print(f"fork at {saved[0]} seed {run['seed']} batch {batch}: efficiency {f['efficiency']:.2f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        run.pop("saved")
    if report["forks"]:
        print(f"\nlocal efficiency at a state of the base run ({args.fork_span} samples at the batch from the "
              f"base run's state; the base batch's samples to the same held-out loss), against the "
              f"predictions from that state's smoothed noise scales (median over seeds)")
        header = ["at samples", "batch", "loss", "measured (per seed)"] + [f"phi_{k}" for k in KINDS] + \
            [f"{m}({k})" for k in KINDS for m in MODELS] + [f"sgd({k}, {g} only)" for k in ("plain", "pre") for g in GROUPS]
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for at in sorted({f["at_samples"] for f in report["forks"]}):
            for batch in args.batches[1:]:
                fs = [f for f in report["forks"] if f["at_samples"] == at and f["batch"] == batch]
                med = lambda key: float(np.median([f[key] for f in fs]))
                cells = [str(at), str(batch), f"{med('loss_at_start'):.3f}",
                         f"{med('efficiency'):.2f} (" + ", ".join(f"{f['efficiency']:.2f}" for f in fs) + ")"]  # nan: < 0.25
                cells += [f"{med(f'phi_{k}'):.0f}" for k in KINDS]
                cells += [f"{med(f'{m}_{k}'):.2f}" for k in KINDS for m in MODELS]
                cells += [f"{med(f'sgd_{k}_{g}'):.2f}" for k in ("plain", "pre") for g in GROUPS]
                print("| " + " | ".join(cells) + " |")
    Path(args.out).write_text(json.dumps(report, default=float))
    print(f"\n{args.out}")


if __name__ == "__main__":
    main()
