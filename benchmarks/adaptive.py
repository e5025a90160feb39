"""Adaptive batch size (hybridsync.adaptive) against fixed batch sizes: wall-clock training time
to a fixed validation loss, DLRM and word2vec, at 2 ranks and across an elastic restart from 2
to 3 ranks.

    python benchmarks/adaptive.py --repeats 5                       # both scenarios (~25 minutes on a quiet 2-core machine)
    python benchmarks/adaptive.py --scenarios steady --repeats 5    # 2 ranks only
    python benchmarks/adaptive.py --models dlrm --scenarios steady  # one model
    python benchmarks/adaptive.py --rerender                        # table and plot from the JSON
    python benchmarks/adaptive.py --models dlrm --configs large adaptive --name adaptive-dlrm   # a subset, saved apart
    mpirun -np 2 python benchmarks/adaptive.py --worker --model dlrm --config adaptive   # one run

Each run trains for at most --budget seconds of training time on a fixed in-memory training set
(examples/torch_dlrm.py's SyntheticCriteo, examples/torch_word2vec.py's skip-gram pairs; tables
smaller than the examples' so a run is short) and measures the loss on a fixed held-out set of
HELD_OUT samples every `eval_every` global samples (evaluation time is not counted). Every
configuration uses Adagrad with the same learning rate, written for the default batch, and the
same scaling rule ('auto': Adagrad's LR unscaled, its best setting for the fixed sizes too) through
hybridsync.torch.AdaptiveDataLoader: the
fixed sizes with autoscale off, `adaptive` starting at the default batch with
loader.autoscale_batch_size() choosing the batch from the measured noise scale and step times.
The time to a target is the training time at the first evaluation at or below it; each run
goes on to the model's lower target (or the budget), and the table reads both targets off the
same runs. The
repeats run interleaved (every configuration once, then again), so a drift in the shared
machine's load hits all of them; the table shows each configuration's median run.

The restart scenario trains `switch` samples at 2 ranks, saves a checkpoint
(hybridsync.save_checkpoint: model, server state, the adaptive statistics, batch and progress),
and continues at 3 ranks from it (hybridsync.load_checkpoint; the batch is chosen again for the
new world size); the time is both phases' training time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARK = "ADAPTIVE-RESULT"
# The adaptive configurations: where each starts. `adaptive-rescale` is the same run with the
# opt-in rescale of Adagrad's accumulators at each batch change (rescale_accumulators 'auto'), to
# measure what it is worth side by side with the default.
ADAPTIVE = {"adaptive": "default", "adaptive-rescale": "default"}
HELD_OUT = 32768  # held-out samples: a loss measured on them varies little from one evaluation to the next

# Per model: the base (default) global batch, the fixed sizes compared, the adaptive limits, the
# loss targets, and where the restart scenario moves from 2 to 3 ranks (samples). Two targets,
# read off the same runs (each run trains until the lower one or the budget): an early one
# (DLRM: ~110 steps at the default batch, ~2-3 s; word2vec: ~670 steps) where the small and
# default sizes reach it within the budget, and a late one (DLRM: ~430 steps at the default,
# ~12 s; word2vec: ~830 steps), still in the first epoch for the default batch and above the
# large batch's plateau (DLRM 0.213, word2vec 2.368; both then overfit the fixed training set).
# In the early target's 2-3 s a run's startup and its first steps decide much of the time;
# over the late one the noise scale grows ~100x and the best batch with it.
MODELS = {
    "dlrm": {"base": 512, "fixed": {"small": 128, "default": 512, "large": 4096}, "max_batch": 8192,
             "local_bounds": (32, 4096), "lr": 0.05, "targets": (0.26, 0.22), "eval_every": 8192, "switch": 32768},
    "word2vec": {"base": 1024, "fixed": {"small": 256, "default": 1024, "large": 8192}, "max_batch": 16384,
                 "local_bounds": (64, 8192), "lr": 0.2, "targets": (2.38, 2.37), "eval_every": 16384,
                 "switch": 262144},
}


# -- one run, on every rank ----------------------------------------------------------------------
def _dlrm(rank):
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from torch_dlrm import DLRM, SyntheticCriteo

    tables, rows, dim = 8, 20_000, 16
    torch.manual_seed(0)
    model = DLRM(tables, rows, dim)
    train = SyntheticCriteo(400_000, tables, rows, seed=1).batch()
    held = SyntheticCriteo(HELD_OUT, tables, rows, seed=2).batch()

    def loss_of(batch):
        dense, sparse, label = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), label)

    return model, torch.utils.data.TensorDataset(*train), held, loss_of


def _word2vec(rank):
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from torch_word2vec import SkipGram, SkipGramBatches, negative_sampling_loss
    from zipf_text import ZipfText

    torch.manual_seed(0)
    text = ZipfText(20_000, 3_000_000, 1.1, seed=0)  # enough text that no run sees a pair twice
    data = SkipGramBatches(text, window=3, negatives=5, seed=0)
    model = SkipGram(20_000, 32)
    n = 2_000_000
    train = data.batch(0, n, 0, n)
    held = data.batch(0, HELD_OUT, 0, HELD_OUT, held_out=True)

    def loss_of(batch):
        return negative_sampling_loss(model(*batch))

    return model, torch.utils.data.TensorDataset(*train), held, loss_of


def worker(args) -> None:
    import torch

    import hybridsync
    import hybridsync.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    spec = MODELS[args.model]
    model, train, held, loss_of = (_dlrm if args.model == "dlrm" else _word2vec)(rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    # Every configuration: the learning rate written for the default batch, with the rule Adagrad
    # gets ('auto': 'none', the LR unscaled; the opt-in 'adagrad' rule made the large batch ~1.7x
    # slower to DLRM's targets, docs/adaptive.md). `adaptive` starts
    # at the default batch (AdaptDL's semantics: batch_size is the smallest batch, the batch
    # only grows, when predicted goodput says so).
    batch = spec["fixed"][ADAPTIVE.get(args.config, args.config)]
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=spec["lr"]), model=model,
                                   adaptive={"scaling_rule": "auto", "base_batch_size": spec["base"],
                                             "rescale_accumulators": "auto" if args.config == "adaptive-rescale" else False})
    loader = hvd.AdaptiveDataLoader(train, batch_size=batch, seed=3, interval=10, warmup=10)
    if args.config in ADAPTIVE:
        loader.autoscale_batch_size(spec["max_batch"], local_bsz_bounds=spec["local_bounds"])

    def held_out() -> float:
        with torch.no_grad():
            loss = loss_of(held).item()
        return hvd.allreduce(torch.tensor(loss), name="val").item()

    def agreed(seconds: float) -> float:
        """Rank 0's training time: every rank stops at the same step, whatever its own clock says."""
        return hvd.broadcast(torch.tensor([seconds], dtype=torch.float64), root_rank=0, name="trained_s").item()

    trained_s, seen, next_eval, batches, clock = 0.0, 0, spec["eval_every"], [], []  # clock: training time after each step
    curve, worlds = [(0.0, 0, held_out())], []
    if args.phase == "second":  # an elastic restart: the first phase's state, at this world size
        extra = hybridsync.load_checkpoint(args.ckpt, model, opt)
        trained_s, seen, next_eval = extra["trained_s"], extra["seen"], extra["next_eval"]
        curve, batches, worlds = [tuple(c) for c in extra["curve"]], extra["batches"], extra["worlds"]
        clock = extra["clock"]
        loader.batches.epoch = extra["epoch"] + 1
    stop_at = args.switch if args.phase == "first" else None
    last_target = min(spec["targets"])
    done = False
    while not done:
        start = time.perf_counter()
        for b in loader:
            opt.zero_grad()
            loss_of(b).backward()
            opt.step()
            seen += len(b[0]) * size
            batches.append(opt.adaptive.global_batch())
            clock.append(round(trained_s + time.perf_counter() - start, 4))
            if seen >= next_eval:  # every rank at the same step: the samples seen are the same
                trained_s = agreed(trained_s + time.perf_counter() - start)
                next_eval += spec["eval_every"]
                curve.append((trained_s, seen, held_out()))
                if curve[-1][2] <= last_target or trained_s >= args.budget or (stop_at and seen >= stop_at):
                    done = True
                    break
                start = time.perf_counter()
        else:
            trained_s += time.perf_counter() - start
    worlds.append([size, seen])
    if args.phase == "first":
        hybridsync.save_checkpoint(args.ckpt, model, opt, extra={
            "trained_s": trained_s, "seen": seen, "next_eval": next_eval, "curve": curve, "batches": batches,
            "clock": clock, "worlds": worlds, "epoch": loader.epoch})
    if rank == 0:
        stats = opt.gradient_stats()
        result = {"model": args.model, "config": args.config, "ranks": size, "curve": curve,
                  "final_batch": opt.adaptive.global_batch(), "batches": sorted(set(batches)),
                  "batches_in_order": _batch_path({"batches": batches}),
                  "changes": loader.changes, "decisions": opt.adaptive.decider.log,
                  "rescales": opt.adaptive.accumulators.log,  # Adagrad's sums at each change (docs/adaptive.md)
                  "phases": _phases(batches, clock),
                  "step_times": {str(b): [round(v, 5) for v in row[:3]]  # (median s per micro-step, sync s, rel. error)
                                 for b, row in opt.adaptive.throughput.sizes(size).items()}
                  if opt.adaptive.throughput.fitted(size) else {},
                  "step_samples": opt.adaptive.throughput.state_dict()["samples"],  # (local batch, micro s, sync s, k)
                  "judgements": opt.adaptive.decider.judgements,
                  "noise_scale": stats["noise_scale"], "by_variable": stats["by_variable"],
                  "efficiency_of_final": opt.adaptive.summary()["efficiency"], "steps": opt.adaptive.steps,
                  "progress": opt.progress, "worlds": worlds, "phase": args.phase}
        print(MARK + " " + json.dumps(result), flush=True)


def _phases(batches: list, clock: list) -> list:
    """[global batch, steps, training seconds] of each stretch at one batch size, in order: where a
    run's time went."""
    phases, before = [], 0.0
    for batch, at in zip(batches, clock):
        if not phases or phases[-1][0] != batch:
            phases.append([batch, 0, 0.0])
        phases[-1][1] += 1
        phases[-1][2] = round(phases[-1][2] + at - before, 3)
        before = at
    return phases


# -- the driver ----------------------------------------------------------------------------------------
def at_target(run: dict, target: float) -> dict:
    """The run seen against one target: the training time and samples at the first evaluation
    at or below it (None: not reached)."""
    hit = next(((t, n) for t, n, v in run["curve"] if v <= target), (None, None))
    return {**run, "target": target, "time_to_target_s": hit[0], "samples_to_target": hit[1]}


def run_one(model: str, config: str, ranks: int, budget: float, phase: str = "all", ckpt: str = "",
            switch: int = 0) -> dict:
    cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none", "--allow-run-as-root",
           sys.executable, "-u", __file__, "--worker", "--model", model, "--config", config, "--budget", str(budget),
           "--phase", phase, "--ckpt", ckpt, "--switch", str(switch)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=budget * 4 + 120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) + 1:])
    raise RuntimeError(f"{model}/{config} produced no result (exit {out.returncode})\n{out.stdout}\n{out.stderr}")


def run_scenario(model: str, config: str, scenario: str, budget: float) -> dict:
    """'steady': 2 ranks throughout. 'restart': 2 ranks for the model's first `switch` samples,
    a checkpoint, then 3 ranks from it (hybridsync.load_checkpoint at the new world size; the
    restart's own time is not counted, the training time of both phases is)."""
    if scenario == "steady":
        r = run_one(model, config, 2, budget)
    else:
        with tempfile.TemporaryDirectory(prefix="adaptive-bench-") as tmp:
            ckpt = str(Path(tmp) / "ckpt")
            r = run_one(model, config, 2, budget, "first", ckpt, MODELS[model]["switch"])
            if at_target(r, min(MODELS[model]["targets"]))["time_to_target_s"] is None:
                r = run_one(model, config, 3, budget, "second", ckpt)
    r["scenario"] = scenario
    return r


def median_run(runs: list) -> dict:
    """The run with the median time to target (a run that missed it counts as slowest); all
    runs' times kept under "times"."""
    key = lambda r: r["time_to_target_s"] if r["time_to_target_s"] is not None else float("inf")
    ordered = sorted(runs, key=key)
    chosen = dict(ordered[len(ordered) // 2])
    chosen["times"] = [r["time_to_target_s"] for r in runs]
    chosen["samples"] = [r["samples_to_target"] for r in runs]
    chosen["traces"] = [_batch_path(r) for r in runs]  # every run's batch trace, in run order
    chosen["reversals_per_run"] = [reversals(_batch_path(r)) for r in runs]
    chosen["load_averages"] = [r.get("load_average") for r in runs]
    if key(chosen) == float("inf"):
        chosen["time_to_target_s"] = None
    return chosen


def table(results: list) -> str:
    lines = ["| model | scenario | configuration | batch (global) | time to target (s), median | vs best fixed | "
             "vs default | samples to target (k), median | noise scale | runs (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups = sorted({(r["model"], r.get("scenario", "steady"), r["target"]) for r in results},
                    key=lambda g: (g[0], g[1] != "steady", -g[2]))
    for model, scenario, target in groups:
        rows = [r for r in results if (r["model"], r.get("scenario", "steady"), r["target"]) == (model, scenario, target)]
        fixed = [r["time_to_target_s"] for r in rows if r["config"] not in ADAPTIVE and r["time_to_target_s"]]
        best = min(fixed) if fixed else None
        default = next((r["time_to_target_s"] for r in rows if r["config"] == "default"), None)
        where = "2 ranks" if scenario == "steady" else "2 -> 3 ranks"
        for r in rows:
            t = r["time_to_target_s"]
            batch = " -> ".join(str(b) for b in _batch_path(r))
            ratio = lambda ref: f"{t / ref:.2f}x" if t and ref else "-"
            samples = sorted(x for x in r.get("samples", [r["samples_to_target"]]) if x is not None)
            median_k = f"{samples[len(samples) // 2] / 1000:.0f}" if samples else "-"
            runs = ", ".join("-" if x is None else f"{x:.1f}" for x in r.get("times", [t]))
            lines.append(f"| {model} (target {r['target']}) | {where} | {r['config']} | {batch} | "
                         f"{f'{t:.1f}' if t else 'not reached'} | {ratio(best)} | {ratio(default)} | {median_k} | "
                         f"{r['noise_scale']:.0f} | {runs} |")
    return "\n".join(lines)


def _batch_path(r: dict) -> list:
    """The global batches a run went through, in order (consecutive repeats merged)."""
    path = []
    for b in r["batches_in_order"] if "batches_in_order" in r else r["batches"]:
        if not path or path[-1] != b:
            path.append(b)
    return path


REROUNDED = 0.01  # a change smaller than this (relative) is a batch re-rounded to a new world size


def reversals(path: list) -> int:
    """How often a batch trace turned back (grew after shrinking or shrank after growing). A
    restart at another world size takes the allowed global batch nearest the saved one (4096 at
    2 ranks: 4095 at 3); such a change of under REROUNDED is no decision and no move."""
    moves = [1 if b > a else -1 for a, b in zip(path, path[1:]) if abs(b - a) >= REROUNDED * a]
    return sum(1 for x, y in zip(moves, moves[1:]) if x != y)


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r.get("scenario", "steady")) for r in results}, key=lambda g: (g[0], g[1] != "steady"))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, (model, scenario) in zip(axes[0], groups):
        lowest_target = min(r["target"] for r in results if r["model"] == model)
        rows = [r for r in results if (r["model"], r.get("scenario", "steady"), r["target"]) ==
                (model, scenario, lowest_target)]  # each configuration's median run at the late target
        for r in rows:
            t, _, v = zip(*r["curve"])
            ax.plot(t, v, marker=".", label=f"{r['config']} ({' -> '.join(map(str, _batch_path(r)))})",
                    linewidth=2.5 if r["config"] in ADAPTIVE else 1.2)
        targets = sorted({r["target"] for r in results if r["model"] == model})
        for target in targets:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        lowest = min(v for r in rows for _, _, v in r["curve"])
        ax.set_ylim(lowest - 0.05 * targets[0], targets[-1] * 1.5)  # early spikes of the large batch go off the top
        ax.set_title(f"{model}, {'2 ranks' if scenario == 'steady' else '2 -> 3 ranks'}: held-out loss")
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("held-out loss")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--model", choices=sorted(MODELS), default="dlrm")
    parser.add_argument("--config", default="adaptive")
    parser.add_argument("--phase", choices=["all", "first", "second"], default="all")
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--switch", type=int, default=0)
    parser.add_argument("--models", nargs="+", default=sorted(MODELS))
    parser.add_argument("--configs", nargs="+", default=["small", "default", "large", "adaptive"])
    parser.add_argument("--scenarios", nargs="+", choices=["steady", "restart"], default=["steady", "restart"])
    parser.add_argument("--budget", type=float, default=25.0, help="training seconds at most per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs per configuration (the table shows medians)")
    parser.add_argument("--rerender", action="store_true", help="table and plot again from results/<name>.json")
    parser.add_argument("--name", default="adaptive",
                        help="results/<name>.{json,md,png} (default adaptive; a subset run: another name)")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    out = {ext: RESULTS / f"{args.name}.{ext}" for ext in ("json", "md", "png")}
    if args.rerender:
        results = json.loads(out["json"].read_text())
        print(table(results))
        out["md"].write_text(table(results) + "\n")
        return plot(results, out["png"])
    runs: dict = {}
    for _ in range(args.repeats):  # repeats outermost: a drift in the machine's load hits every configuration
        for scenario in args.scenarios:
            for model in args.models:
                for config in args.configs:
                    load = os.getloadavg()[0]  # (a busy machine makes every configuration slower: say so)
                    r = run_scenario(model, config, scenario, args.budget)
                    r["load_average"] = load
                    hits = [(T, at_target(r, T)["time_to_target_s"]) for T in MODELS[model]["targets"]]
                    print(f"{model:9s} {scenario:7s} {config:8s} load {load:.2f}  time to targets {hits}  "
                          f"batches {_batch_path(r)} ({reversals(_batch_path(r))} reversals)  "
                          f"noise scale {r['noise_scale']:.0f}", flush=True)
                    runs.setdefault((scenario, model, config), []).append(r)
    results = [median_run([at_target(r, T) for r in v]) for (_, model, _), v in runs.items()
               for T in MODELS[model]["targets"]]
    RESULTS.mkdir(exist_ok=True)
    saved = out["json"]
    if saved.exists():  # keep the saved results of the scenarios and models not run this time
        ran = {(r["scenario"], r["model"]) for r in results}
        results = [r for r in json.loads(saved.read_text()) if (r.get("scenario", "steady"), r["model"]) not in ran] + results
    results.sort(key=lambda r: (r["model"], r.get("scenario", "steady") != "steady", -r["target"],
                                [*MODELS[r["model"]]["fixed"], *ADAPTIVE].index(r["config"])))
    text = table(results)
    print(text)
    out["json"].write_text(json.dumps(results, indent=1))
    out["md"].write_text(text + "\n")
    plot(results, out["png"])


if __name__ == "__main__":
    main()
