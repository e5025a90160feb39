#!/usr/bin/env python
"""Runs Horovod's own TensorFlow 2 examples against hybridsync, with only their horovod import
switched, on `mpirun -np N` (default 2):

  examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py   model.fit + DistributedOptimizer
  examples/tensorflow2/tensorflow2_synthetic_benchmark.py         tf.function + DistributedGradientTape
  examples/tensorflow2/tensorflow2_keras_mnist.py                 model.fit + Horovod's callbacks

The files are read from a Horovod git directory at run time (this repository holds none of
Horovod's code). The benchmarks take their sizes as arguments (a small Keras application, tiny
batches, few iterations: SIZES below). The MNIST example takes none: its download is replaced
by random images of MNIST's shape and its 24 epochs of 500 steps of 128 by a few small ones
(EDITS below, each printed; an edit that no longer matches the file is an error, so an upstream
change is noticed). Not part of the project's test suite (it needs Horovod's repository);
tests/parallel/test_tf_horovod_api.py exercises the same calls on our own small scripts.

    python scripts/horovod_examples.py --git-dir /path/to/horovod/.git --rev v0.28.1
    python scripts/horovod_examples.py --git-dir /path/to/horovod/.git -k mnist --np 3 --keep out/
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "examples/tensorflow2"

# The import switch: the one change a user makes.
IMPORTS = (("import horovod.tensorflow.keras as hvd", "import hybridsync.tensorflow.keras as hvd"),
           ("import horovod.tensorflow as hvd", "import hybridsync.tensorflow as hvd"))

# Benchmarks: their own arguments, for a small model and a few small steps on CPU.
SMALL_BENCHMARK = ["--model", "MobileNetV3Small", "--batch-size", "2", "--num-iters", "2", "--no-cuda"]
SIZES = {
    "tensorflow2_keras_synthetic_benchmark.py": SMALL_BENCHMARK + ["--num-batches-per-iter", "2"],
    "tensorflow2_synthetic_benchmark.py": SMALL_BENCHMARK + ["--num-batches-per-iter", "2", "--num-warmup-batches", "1"],
    "tensorflow2_keras_mnist.py": [],
}

# The MNIST example: no download (random images and labels of MNIST's shapes), and small sizes.
EDITS = {
    "tensorflow2_keras_mnist.py": (
        (r"tf\.keras\.datasets\.mnist\.load_data\(path='mnist-%d\.npz' % hvd\.rank\(\)\)",
         "((tf.random.uniform([256, 28, 28], 0, 256, tf.int32).numpy().astype('uint8'), "
         "tf.random.uniform([256], 0, 10, tf.int64).numpy()), None)",
         "random images and labels instead of downloading MNIST"),
        (r"\.shuffle\(10000\)\.batch\(128\)", ".shuffle(256).batch(16)", "batches of 16 instead of 128"),
        (r"steps_per_epoch=500 // hvd\.size\(\)", "steps_per_epoch=6 // hvd.size()", "6 steps per epoch, not 500"),
        (r"epochs=24", "epochs=3", "3 epochs (the warmup's), not 24"),
    ),
}


def read_example(git_dir: str, rev: str, name: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{rev}:{FOLDER}/{name}"], check=True,
                          capture_output=True, text=True).stdout


def prepare(source: str, name: str) -> tuple[str, list[str]]:
    """The example with its horovod import switched and its EDITS applied; what was changed."""
    changes = []
    for horovod_line, ours in IMPORTS:
        pattern = re.compile(rf"^{re.escape(horovod_line)}[ \t]*$", re.M)
        if pattern.search(source):
            source = pattern.sub(ours, source, count=1)
            changes.append(f"import: {horovod_line} -> {ours}")
    if not changes:
        raise SystemExit(f"{name}: no horovod import to switch")
    for pattern, replacement, why in EDITS.get(name, ()):
        source, n = re.subn(pattern, replacement, source)
        if n != 1:
            raise SystemExit(f"{name}: edit '{why}' matched {n} times (expected once): has the example changed?")
        changes.append(f"edit: {why}")
    return source, changes


def run(path: Path, args: list[str], np_: int, timeout: float) -> tuple[str, float, str]:
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", "--tag-output"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, "-u", str(path), *args]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="2")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=path.parent, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        outcome = "passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        outcome = "hung"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return outcome, time.monotonic() - start, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--git-dir", required=True, help="a Horovod git directory")
    parser.add_argument("--rev", default="v0.28.1", help="revision in --git-dir (default v0.28.1)")
    parser.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per example before it counts as hung")
    parser.add_argument("-k", "--select", help="only examples whose name contains one of these comma-separated words")
    parser.add_argument("--keep", help="folder to keep each example's copy and output in")
    args = parser.parse_args(argv)
    wanted = [w for w in (args.select or "").split(",") if w]
    names = [n for n in SIZES if not wanted or any(w in n for w in wanted)]
    failures = 0
    with tempfile.TemporaryDirectory(prefix="horovod_examples.") as tmp:
        for name in names:
            source, changes = prepare(read_example(args.git_dir, args.rev, name), name)
            folder = Path(args.keep or tmp) / Path(name).stem
            folder.mkdir(parents=True, exist_ok=True)
            copy = folder / name
            copy.write_text(source)
            print(f"== {name} (-np {args.np}) {' '.join(SIZES[name])}")
            for change in changes:
                print(f"   {change}")
            outcome, seconds, out = run(copy, SIZES[name], args.np, args.timeout)
            (folder / "output.txt").write_text(out)
            print(f"   {outcome} in {seconds:.0f} s")
            if outcome != "passed":
                failures += 1
                print("\n".join("   | " + line for line in out.splitlines()[-30:]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
