"""Bounded staleness: throughput at `staleness: k` = 0, 1, 4 on DLRM and word2vec (examples/),
2 ranks, with no straggler and with the last rank slowed by 30%, next to Horovod (horovod.torch
as users run it, and with OMPI_MCA_mpi_yield_when_idle=1) and to another checkout's engine at
k = 0 (--main; "k = 0 no slower than today's engine"); plus the idle serving thread's CPU.

    python benchmarks/staleness.py [--repeats 3] [--main /work/main]

"Slowed by 30%": the last rank sleeps, every step, 30% of the step time hybridsync k = 0 measured
without a straggler (the same absolute sleep for every system). Every system trains the same
script, data and sizes; systems take turns within each repeat, and the table gives medians.
Writes benchmarks/results/staleness.{md,json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

MODELS = {  # model -> (script, its arguments, batch per rank)
    "dlrm": ("torch_dlrm.py", ["--rows", "100000", "--steps", "80", "--log-every", "1000"], 512),
    "word2vec": ("torch_word2vec.py", ["--vocab", "50000", "--tokens", "500000", "--steps", "120",
                                       "--log-every", "1000"], 1024),
}
KS = (0, 1, 4)
RATE = re.compile(r"steps on \d+ rank\(s\): ([\d,]+) (?:samples|pairs)/s")
MAX_LAG = re.compile(r"staleness: .*?max (\d+)")


def mpirun(env_names) -> list[str]:
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    for name in env_names:
        cmd += ["-x", name]
    return cmd


def run(model: str, system: str, slow_ms: float, workdir: Path, main: Path | None, timeout=600) -> dict:
    """One training run; {"rate": samples/s, "max_lag": the largest lag rank 0's pulls saw}."""
    script, args, _ = MODELS[model]
    checkout = main if system == "main k=0" else ROOT
    env = dict(os.environ, PYTHONPATH=str(checkout))
    argv = [sys.executable, "-u", str(ROOT / "examples" / script), *args]
    if slow_ms:
        argv += ["--slow-ms", f"{slow_ms:.2f}"]
    if system.startswith("horovod"):
        argv.append("--horovod")
        env["OMPI_MCA_mpi_yield_when_idle"] = "1" if "yield" in system else "0"
    elif system.startswith("k="):
        config = workdir / f"{system.replace('=', '')}.yaml"
        config.write_text(f"defaults:\n  sparse: {{sync: ps, staleness: {int(system[2:])}}}\n")
        argv += ["--config", str(config)]
    else:  # main k=0: that checkout's engine, synchronous PS tables
        config = workdir / "main.yaml"
        config.write_text("defaults:\n  sparse: {sync: ps}\n")
        argv += ["--config", str(config)]
    names = ["PYTHONPATH"] + (["OMPI_MCA_mpi_yield_when_idle"] if "OMPI_MCA_mpi_yield_when_idle" in env else [])
    done = subprocess.run(mpirun(names) + argv, capture_output=True, text=True, env=env, cwd=checkout,
                          timeout=timeout)
    out = done.stdout + done.stderr
    found = RATE.search(out)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{model} / {system} failed (exit {done.returncode}):\n{out[-3000:]}")
    lags = [int(x) for x in MAX_LAG.findall(out)]
    return {"rate": float(found.group(1).replace(",", "")), "max_lag": max(lags) if lags else None}


def idle_cpu(seconds: float) -> list[float]:
    """The serving thread's CPU seconds per rank over `seconds` of a rank idle in Python."""
    cmd = mpirun(["PYTHONPATH"]) + [sys.executable, "-u", str(ROOT / "tests" / "parallel" / "test_staleness.py"),
                                    "rank_idle_serving_thread_cpu", str(seconds)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return [float(x) for x in re.findall(r"IDLE-CPU rank=\d+ serving thread ([0-9.]+) s", done.stdout)]


def systems(with_main: bool, straggler: bool) -> list[str]:
    names = [f"k={k}" for k in KS] + ["horovod", "horovod yield"]
    return names + (["main k=0"] if with_main and not straggler else [])


def summarise(raw: list) -> list:
    groups = {}
    for r in raw:
        groups.setdefault((r["model"], r["straggler"], r["system"]), []).append(r)
    out = []
    for (model, straggler, system), runs in groups.items():
        lags = [r["max_lag"] for r in runs if r["max_lag"] is not None]
        out.append({"model": model, "straggler": straggler, "system": system, "runs": len(runs),
                    "samples_per_s": statistics.median(r["rate"] for r in runs),
                    "max_lag": max(lags) if lags else None, "slow_ms": runs[0]["slow_ms"]})
    for s in out:  # ratios within each (model, straggler) group
        peers = {p["system"]: p for p in out if (p["model"], p["straggler"]) == (s["model"], s["straggler"])}
        s["vs_k0"] = s["samples_per_s"] / peers["k=0"]["samples_per_s"]
        s["vs_horovod_yield"] = s["samples_per_s"] / peers["horovod yield"]["samples_per_s"]
    return out


def markdown(summary: list, meta: dict) -> str:
    lines = [f"Bounded staleness, 2 ranks on one host ({meta['host_cores']} cores), medians of {meta['repeats']} "
             f"runs ({meta['date']}). Straggler: the last rank sleeps {meta['slow_fraction']:.0%} of hybridsync "
             "k=0's step time every step. max lag: the most steps of the other rank that rank 0's pulls missed.", "",
             "| model | straggler | system | samples/s | vs k=0 | vs Horovod (yield) | max lag |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    order = {name: i for i, name in enumerate(systems(True, False))}
    for s in sorted(summary, key=lambda s: (s["model"], s["straggler"], order[s["system"]])):
        slow = f"{s['slow_ms']:.1f} ms/step" if s["straggler"] else "none"
        lag = "-" if s["max_lag"] is None else str(s["max_lag"])
        lines.append(f"| {s['model']} | {slow} | {s['system']} | {s['samples_per_s']:,.0f} | {s['vs_k0']:.2f}x | "
                     f"{s['vs_horovod_yield']:.2f}x | {lag} |")
    cpu = meta.get("idle_cpu_s")
    if cpu:
        lines += ["", f"Idle serving thread: {', '.join(f'{c:.3f}' for c in cpu)} s of CPU per rank over "
                      f"{meta['idle_s']:.0f} s of a rank sleeping in Python ({max(cpu) / meta['idle_s']:.1%} of a "
                      "core at most)."]
    return "\n".join(lines)


def plot(summary: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(s["model"], s["straggler"]) for s in summary})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4.2), squeeze=False)
    order = systems(True, False)
    for ax, (model, straggler) in zip(axes[0], panels):
        rows = sorted((s for s in summary if (s["model"], s["straggler"]) == (model, straggler)),
                      key=lambda s: order.index(s["system"]))
        ax.bar([s["system"] for s in rows], [s["samples_per_s"] for s in rows],
               color=["tab:blue" if s["system"].startswith("k=") else "tab:gray" if "main" in s["system"]
                      else "tab:orange" for s in rows])
        ax.set_title(f"{model}, {'one rank slowed 30%' if straggler else 'no straggler'}", fontsize=10)
        ax.set_ylabel("samples/s")
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default="dlrm,word2vec")
    p.add_argument("--slow-fraction", type=float, default=0.3)
    p.add_argument("--main", type=Path, default=None, help="another checkout (e.g. /work/main): its engine at k=0")
    p.add_argument("--idle-s", type=float, default=10.0, help="seconds of the idle-CPU measurement (0: skip)")
    p.add_argument("--out", type=Path, default=RESULTS / "staleness")
    args = p.parse_args()
    models = args.models.split(",")
    raw = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        slow_ms = {}
        for straggler in (False, True):
            for rep in range(args.repeats):
                for model in models:
                    for system in systems(args.main is not None, straggler):
                        sleep = slow_ms[model] if straggler else 0.0
                        got = run(model, system, sleep, workdir, args.main)
                        raw.append({"model": model, "system": system, "straggler": straggler, "repeat": rep,
                                    "slow_ms": sleep, **got})
                        print(f"{model:9s} {'straggler' if straggler else 'even':9s} {system:14s} "
                              f"{got['rate']:>10,.0f} samples/s  max lag {got['max_lag']}", flush=True)
            if not straggler:  # the straggler's sleep: a fraction of hybridsync k=0's step time
                for model in models:
                    rate = statistics.median(r["rate"] for r in raw if r["model"] == model and r["system"] == "k=0")
                    slow_ms[model] = args.slow_fraction * 1000 * MODELS[model][2] * 2 / rate
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "repeats": args.repeats,
            "host_cores": os.cpu_count(), "slow_fraction": args.slow_fraction, "main": str(args.main or ""),
            "sizes": {m: MODELS[m][1] for m in models}, "idle_s": args.idle_s}
    if args.idle_s > 0:
        meta["idle_cpu_s"] = idle_cpu(args.idle_s)
    summary = summarise(raw)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(summary, meta)
    Path(f"{args.out}.md").write_text(text + "\n")
    Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "summary": summary, "raw": raw}, indent=1))
    plot(summary, Path(f"{args.out}.png"))
    if args.out == RESULTS / "staleness":
        update_docs(text + f"\n\n![staleness benchmark](../benchmarks/results/staleness.png)")
    print(text)


def update_docs(text: str) -> None:
    """Puts the table between docs/staleness.md's `<!-- staleness:start/end -->` markers."""
    page = ROOT / "docs" / "staleness.md"
    body = page.read_text()
    start, end = "<!-- staleness:start -->", "<!-- staleness:end -->"
    if start in body and end in body:
        head, rest = body.split(start, 1)
        page.write_text(f"{head}{start}\n{text}\n{end}{rest.split(end, 1)[1]}")


if __name__ == "__main__":
    main()
