#!/usr/bin/env python
"""Runs Horovod's own PyTorch test suite (test/parallel/test_torch.py) against hybridsync.torch,
or against Horovod itself with --horovod, one test per `mpirun -np N` launch.

Not part of the project's test suite: it needs a checkout of Horovod's repository.

    python scripts/horovod_suite.py --git-dir /path/to/horovod/.git --rev v0.28.1 --backend mpi
    python scripts/horovod_suite.py path/to/test_torch.py --backend horovod --json out.json
    python scripts/horovod_suite.py path/to/test_torch.py --horovod          # real Horovod

The copy of the test file differs from the original only in its `import horovod.torch as hvd`
line (left as is with --horovod). Horovod's test/utils/common.py needs packages this project does
not install (mock, horovod.runner), so the copy gets a small helper module of our own with the
three functions test_torch.py takes from it. Each test is one mpirun job under its own process
group; one that runs past --timeout is killed whole and counted as HUNG.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_LINE = re.compile(r"^import horovod\.torch as hvd[ \t]*$", re.M)
OUTCOMES = ("passed", "failed", "hung", "skipped")

# What test_torch.py imports from Horovod's test/utils/common.py, written here (not copied).
COMMON_HELPERS = '''\
import contextlib, os, shutil, tempfile


def mpi_env_rank_and_size():
    """(rank, size) from the MPI launcher's environment; (0, 1) outside one."""
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    if os.environ.get("HOROVOD_TEST_GPU", "0") not in ("", "0"):
        test.fail(message)
    test.skipTest(message)


@contextlib.contextmanager
def temppath():
    folder = tempfile.mkdtemp()
    try:
        yield os.path.join(folder, "temp_test_file")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
'''


def load_source(args) -> str:
    if args.git_dir:
        return subprocess.run(["git", f"--git-dir={args.git_dir}", "show", f"{args.rev}:test/parallel/test_torch.py"],
                              check=True, capture_output=True, text=True).stdout
    return Path(args.test_file).read_text()


def write_copy(source: str, real_horovod: bool, workdir: Path) -> Path:
    """test_torch.py with its import switched, in workdir/parallel/, beside workdir/utils/common.py
    (where the original's sys.path line looks for it)."""
    if len(IMPORT_LINE.findall(source)) != 1:
        raise SystemExit("expected exactly one line `import horovod.torch as hvd` in the test file")
    if not real_horovod:
        source = IMPORT_LINE.sub("import hybridsync.torch as hvd", source)
    (workdir / "parallel").mkdir(parents=True, exist_ok=True)
    (workdir / "utils").mkdir(exist_ok=True)
    (workdir / "utils" / "common.py").write_text(COMMON_HELPERS)
    copy = workdir / "parallel" / "test_torch.py"
    copy.write_text(source)
    return copy


def list_tests(source: str) -> list[str]:
    """`Class::test_name` of every test method of every unittest.TestCase subclass, in file order."""
    tests = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and any("TestCase" in ast.unparse(b) for b in node.bases):
            tests += [f"{node.name}::{f.name}" for f in node.body
                      if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
    return tests


# pytest -q's last line on each rank, e.g. "[1,0]<stdout>:1 passed, 2 warnings in 3.82s"; the ranks'
# output interleaves, so a tag may start mid-line.
_SUMMARY = re.compile(r"\[\d+,(\d+)\]<stdout>:[= ]*(\d+ (?:passed|failed|skipped|errors?|deselected)\b[^\[\n]*?) "
                      r"in [\d.]+s")


def classify(rc: int, output: str, np_: int) -> str:
    """passed / failed / skipped from every rank's pytest summary line."""
    per_rank = {int(rank): summary for rank, summary in _SUMMARY.findall(output)}
    if len(per_rank) != np_:
        return "failed"  # a rank crashed or was aborted before pytest could report
    if any(re.search(r"\b(failed|error|errors)\b", s) for s in per_rank.values()):
        return "failed"
    if rc != 0:
        return "failed"
    if all("skipped" in s and "passed" not in s for s in per_rank.values()):
        return "skipped"
    if all("passed" in s for s in per_rank.values()):
        return "passed"
    return "failed"  # e.g. skipped on one rank, passed on another


def run_one(copy: Path, test: str, args, env: dict) -> tuple[str, float, str]:
    cmd = ["mpirun", "-np", str(args.np), "--oversubscribe", "--bind-to", "none", "--tag-output"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, "-m", "pytest", f"{copy}::{test}", "-x", "-q", "-p", "no:cacheprovider", "--color=no",
            "-W", "ignore::DeprecationWarning"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=copy.parent, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
        outcome = classify(proc.returncode, out, args.np)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpirun and every rank it started
        out, _ = proc.communicate()
        outcome = "hung"
    except BaseException:  # Ctrl-C: leave no ranks behind
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return outcome, time.monotonic() - start, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_file", nargs="?", help="path of Horovod's test/parallel/test_torch.py")
    parser.add_argument("--git-dir", help="a Horovod git directory (instead of test_file)")
    parser.add_argument("--rev", default="v0.28.1", help="revision in --git-dir (default v0.28.1)")
    parser.add_argument("--backend", choices=("horovod", "mpi"), default="horovod",
                        help="hybridsync's dense backend (HYBRIDSYNC_BACKEND)")
    parser.add_argument("--horovod", action="store_true", help="run against real Horovod (no import switch)")
    parser.add_argument("--np", type=int, default=2, help="ranks per test (default 2)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per test before it counts as hung")
    parser.add_argument("-k", "--select", help="only tests whose name contains one of these comma-separated substrings")
    parser.add_argument("--json", help="where to write per-test outcomes (default: horovod_suite.<label>.json)")
    parser.add_argument("--logs", help="folder for each non-passing test's output")
    args = parser.parse_args(argv)
    if bool(args.test_file) == bool(args.git_dir):
        parser.error("give either test_file or --git-dir")

    from tqdm import tqdm

    source = load_source(args)
    wanted = [w for w in (args.select or "").split(",") if w]
    tests = [t for t in list_tests(source) if not wanted or any(w in t for w in wanted)]
    label = "horovod" if args.horovod else f"hybridsync-{args.backend}"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not args.horovod:
        env["HYBRIDSYNC_BACKEND"] = args.backend
    logs = Path(args.logs) if args.logs else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="horovod_suite.") as tmp:
        copy = write_copy(source, args.horovod, Path(tmp))
        bar = tqdm(tests, desc=label, unit="test")
        for test in bar:  # one at a time: each job already takes every core of a small host
            outcome, seconds, out = run_one(copy, test, args, env)
            results[test] = {"outcome": outcome, "seconds": round(seconds, 1)}
            bar.set_postfix({k: sum(r["outcome"] == k for r in results.values()) for k in OUTCOMES})
            if outcome in ("failed", "hung"):
                tqdm.write(f"{outcome.upper():7} {test}")
                if logs:
                    (logs / f"{test.replace('::', '.')}.log").write_text(out)
    counts = {k: sum(r["outcome"] == k for r in results.values()) for k in OUTCOMES}
    print(f"\n{label} ({args.rev if args.git_dir else args.test_file}, -np {args.np}, {len(tests)} tests)")
    print(" | ".join(f"{k} {counts[k]}" for k in OUTCOMES))
    for test, r in results.items():
        if r["outcome"] in ("failed", "hung"):
            print(f"  {r['outcome']:7} {test}")
    out_path = Path(args.json or f"horovod_suite.{label}.json")
    out_path.write_text(json.dumps({"label": label, "np": args.np, "counts": counts, "tests": results}, indent=1))
    print(f"per-test outcomes: {out_path}")
    return 0 if counts["failed"] == counts["hung"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
